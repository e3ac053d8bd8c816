"""Multi-node on one machine: pools pinned to node types land on those nodes, and the
answer across nodes is token-exact. The cluster runs in a process of its own
(multi_node_run.py), so this module never touches the shared `ray_session`."""

from __future__ import annotations

import pytest

from cluster.config import REPO_ROOT, load_config
from tests import background
from tests.background import Job, free_port, private_ray_env
from tests.integration import multi_node_run as run
from tests.integration.reference import reference_generate


def start_run():
    """The multi-node run in a process (and session) of its own, on a Ray of its own."""
    return Job("tests.integration.multi_node_run", str(free_port()), env=private_ray_env())


@pytest.fixture(scope="module")
def outcome() -> dict:
    return background.json_outcome(
        "multi-node", start_run, timeout_s=400
    )  # started early, if listed


def test_each_pool_runs_on_its_node_type(outcome):
    workers = [
        p
        for p in outcome["placements"]
        if p["actor"] in ("EncoderWorker", "PrefillWorker", "DecodeWorker")
    ]
    placed = {(p["actor"], tuple(p["node_type"])) for p in workers}
    assert placed == {
        ("EncoderWorker", ("encoder_node",)),
        ("PrefillWorker", ("llm_node",)),
        ("DecodeWorker", ("llm_node",)),
    }, outcome["placements"]
    assert len(workers) == 3, outcome["placements"]
    encoder_nodes = {p["node"] for p in workers if p["actor"] == "EncoderWorker"}
    llm_nodes = {p["node"] for p in workers if p["actor"] != "EncoderWorker"}
    assert not encoder_nodes & llm_nodes  # embeddings really cross nodes


def test_a_pool_pinned_to_an_absent_node_type_is_refused(outcome):
    assert (
        outcome["refusal"]
        and "pool 'encoder'" in outcome["refusal"]
        and "vision_node" in outcome["refusal"]
    )


def test_answers_across_nodes_equal_generate(outcome):
    checkpoint = str(
        load_config(REPO_ROOT / "configs" / "multi_node_cpu.yaml").model.checkpoint_path
    )
    for messages, answer in zip(run.conversations(), outcome["answers"], strict=True):
        ids, text, finish = reference_generate(checkpoint, messages, run.MAX_TOKENS)
        assert answer["choices"][0]["message"]["content"] == text
        assert answer["usage"]["completion_tokens"] == len(ids)
        assert answer["choices"][0]["finish_reason"] == finish


def test_stopping_epd_leaves_another_serve_app_running(outcome):
    """Ctrl-C on `epd serve --address` on a shared cluster: epd's app and its fleet controller
    go, another team's Serve app keeps answering."""
    stopped = outcome["stopped"]
    assert stopped["apps"] == ["other"] and stopped["other_answers"] == "still here", stopped
    assert stopped["epd_controllers"] == []
