"""epd's encoder autoscaling with Ray's own autoscaler (fake multi-node provider): an image
burst grows the pool from one worker to two on a node the autoscaler launches for it (the new
worker pending until then, routed to once ready, as /health and /metrics show); after the
burst the pool drains back to one and the autoscaler releases the node; every answer equals
`generate`. The cluster runs in a process of its own (autoscaler_run.py), started early."""

from __future__ import annotations

import pytest

from cluster.config import builtin_model, load_config
from tests import background
from tests.background import Job, free_port, private_ray_env
from tests.integration.burst import MAX_TOKENS, messages
from tests.integration.reference import reference_generate


def start_run() -> Job:
    return Job("tests.integration.autoscaler_run", str(free_port()), env=private_ray_env())


@pytest.fixture(scope="module")
def outcome() -> dict:
    return background.json_outcome("ray-autoscaler", start_run, timeout_s=500)


def test_the_autoscaler_launches_a_node_for_the_new_worker_and_releases_it(outcome):
    seen = outcome["seen"]  # [seconds, encoder nodes, routed encoders]
    assert seen[0][1:] == [1, 1], seen[:3]  # one node, launched for the pool's first worker
    assert any(nodes == 2 and routed == 2 for _, nodes, routed in seen), seen
    assert outcome["drained"] and outcome["released"], seen[-5:]
    assert seen[-1][1:] == [1, 1], seen[-3:]


def test_health_and_metrics_show_the_pool_grow_and_drain(outcome):
    before, grown, after = (outcome["views"][k] for k in ("before", "grown", "after"))
    assert before["pool"] == {"slots": 2, "routed": 1, "starting": 0, "draining": 0}
    assert before["second"] == "empty" and before["pool_workers"]["empty"] == 1
    assert grown["second"] == "encoded" and grown["pool_workers"]["serving"] == 2
    assert after["pool"] == before["pool"] and after["second"] == "empty"
    assert after["pool_workers"] == {"serving": 1, "starting": 0, "draining": 0, "empty": 1}


def test_answers_across_the_scaling_equal_generate(outcome):
    checkpoint = str(load_config().replace(model=builtin_model("tiny-llava")).model.checkpoint_path)
    answers = outcome["answers"]
    assert answers
    for seed, answer in answers[:: max(1, len(answers) // 5)] + answers[-2:]:
        _, text, _ = reference_generate(checkpoint, messages(seed), MAX_TOKENS)
        assert answer == text, f"seed {seed}"
