"""Multi-node on one machine: pools pinned to node types land on those nodes, and the
answer across nodes is token-exact. The cluster runs in a process of its own
(multi_node_run.py), so this module never touches the shared `ray_session`."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile

import pytest

from cluster.config import REPO_ROOT, load_config
from tests.integration import multi_node_run as run
from tests.integration.reference import reference_generate


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def private_ray_env() -> dict:
    """The environment for a Ray of our own: its address file in a private RAY_TMPDIR, so
    `ray.init()` / `address='auto'` elsewhere on this machine never finds it; one auth mode
    for all its processes (`ray start` turns token auth on when ~/.ray/auth_token exists,
    a client of `serve run` does not)."""
    return {
        **os.environ,
        "RAY_TMPDIR": tempfile.mkdtemp(prefix="epd-ray-", dir="/tmp"),
        "RAY_AUTH_MODE": "disabled",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }


@pytest.fixture(scope="module")
def outcome() -> dict:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.multi_node_run", str(free_port())],
        cwd=REPO_ROOT,
        env=private_ray_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=400)
    finally:  # whatever happened, none of its raylets outlives it
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, stdout[-3000:] + stderr[-5000:]
    return json.loads(lines[-1])


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
