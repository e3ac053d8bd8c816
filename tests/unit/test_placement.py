"""Pools pinned to node types: the check that runs before any actor starts."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cluster.config import REPO_ROOT, load_config
from cluster.placement import NodeShape, PlacementError, check_placement, unplaceable

PINNED = load_config(REPO_ROOT / "configs" / "multi_node_cpu.yaml")
HEAD = NodeShape("node head", {"CPU": 2.0, "memory": 1e9, "node:127.0.0.1": 1.0})
ENCODER = NodeShape("node enc", {"CPU": 2.0, "encoder_node": 1.0})
LLM = NodeShape("node llm", {"CPU": 2.0, "llm_node": 2.0})


def test_pools_reserve_their_custom_resources():
    assert PINNED.encoder_pools[0].ray_resources() == {"CPU": 1.0, "encoder_node": 1.0}
    assert PINNED.decode.ray_resources() == {"CPU": 1.0, "llm_node": 1.0}
    assert [name for name, _ in PINNED.named_pools()] == ["encoder", "prefill", "decode"]


def test_a_cluster_with_every_node_type_places_every_pool():
    assert unplaceable(PINNED, [HEAD, ENCODER, LLM]) == []


def test_a_missing_node_type_names_the_pool_and_the_resource():
    problems = unplaceable(PINNED, [HEAD, ENCODER])
    assert len(problems) == 2 and all("llm_node" in p for p in problems)
    assert "pool 'prefill'" in problems[0] and "pool 'decode'" in problems[1]
    assert "encoder_node" in problems[0]  # what the cluster does offer


def test_a_resource_split_over_nodes_does_not_hold_one_actor():
    split = PINNED.replace(prefill={"num_cpus": 1, "num_gpus": 1})
    problems = unplaceable(
        split, [HEAD, ENCODER, LLM, NodeShape("node gpu", {"CPU": 8.0, "GPU": 1.0})]
    )
    assert (
        problems == [problems[0]]
        and "no single node can hold one actor of pool 'prefill'" in problems[0]
    )


def test_pools_that_need_more_than_the_nodes_offer_in_all_are_refused():
    more = PINNED.replace(
        prefill={"num_workers": 2}
    )  # 2 prefill + 1 decode = 3 llm_node; the LLM node has 2
    (problem,) = unplaceable(more, [HEAD, ENCODER, LLM])
    assert "3 llm_node in all (prefill 2, decode 1)" in problem and "offers 2" in problem
    assert unplaceable(more, [HEAD, ENCODER, LLM, LLM]) == []
    two_launchable = NodeShape(
        "node type gpu_llm (autoscaler)", {"CPU": 8.0, "llm_node": 1.0}, count=2
    )
    assert unplaceable(more, [HEAD, ENCODER, LLM, two_launchable]) == []


def test_a_node_type_the_autoscaler_may_launch_counts():
    launchable = NodeShape("node type gpu_llm (autoscaler)", {"CPU": 8.0, "llm_node": 1.0}, count=2)
    assert unplaceable(PINNED, [HEAD, ENCODER, launchable]) == []


def test_encoder_pools_in_a_list_are_named_by_index():
    omni = load_config(REPO_ROOT / "configs" / "omni_cpu.yaml")
    pools = [pool.model_dump() for pool in omni.encoder_pools]
    pools[1]["resources"] = {"audio_node": 1}
    problems = unplaceable(omni.replace(encoder=pools), [HEAD])
    assert len(problems) == 1 and "pool 'encoder[1]'" in problems[0] and "audio_node" in problems[0]


@pytest.mark.parametrize("resources", [{"GPU": 1}, {"CPU": 2}, {"encoder_node": 0}])
def test_resources_hold_custom_positive_amounts_only(resources):
    with pytest.raises(ValidationError, match="resources"):
        PINNED.replace(encoder={"resources": resources})


def test_check_placement_on_a_live_cluster_fails_before_any_actor(monkeypatch):
    import cluster.placement as placement

    monkeypatch.setattr(placement, "live_shapes", lambda: [HEAD, ENCODER])
    monkeypatch.setattr(placement, "autoscaler_shapes", lambda: [])
    with pytest.raises(PlacementError, match="llm_node"):
        check_placement(PINNED, wait_s=0)
    joined = iter([[HEAD, ENCODER], [HEAD, ENCODER, LLM]])  # the LLM node joins while we wait
    monkeypatch.setattr(placement, "POLL_S", 0.01)
    monkeypatch.setattr(placement, "live_shapes", lambda: next(joined))
    check_placement(PINNED, wait_s=5)
