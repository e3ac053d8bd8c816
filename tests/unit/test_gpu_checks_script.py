"""scripts/gpu_checks: the runbook's steps in order, each bounded by what is left of the budget.
The steps' python is a stand-in that prints what it was asked to run: the script's stepping is
under test here, not torch's import (12 s of CPU)."""

from __future__ import annotations

import os
import subprocess

from cluster.config import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "gpu_checks"


def run(tmp_path, budget_s: int, *steps: str, **env: str) -> subprocess.CompletedProcess:
    python = tmp_path / "python"
    python.write_text('#!/bin/sh\necho "stand-in python: $*"\n')
    python.chmod(0o755)
    env = {**os.environ, **env, "GPU_CHECKS_BUDGET_S": str(budget_s), "PYTHON": str(python)}
    return subprocess.run(
        [str(SCRIPT), str(tmp_path), *steps], env=env, capture_output=True, text=True, timeout=120
    )


def test_a_step_runs_and_leaves_its_log(tmp_path):
    done = run(tmp_path, 300, "env")
    assert done.returncode == 0 and "== env: exit" in done.stdout
    assert "import torch, ray, transformers" in (tmp_path / "env.log").read_text()


def test_steps_are_skipped_once_the_budget_is_spent(tmp_path):
    done = run(tmp_path, 10, "env", "test_gpu")
    assert "== env: skipped" in done.stdout and "== test_gpu: skipped" in done.stdout
    assert not (tmp_path / "test_gpu.log").exists()


def test_an_unknown_step_is_refused_by_name(tmp_path):
    done = run(tmp_path, 300, "benchmark_everything")
    assert done.returncode == 2 and "unknown step benchmark_everything" in done.stderr


def test_the_cuda_ipc_hang_step_runs_that_test_then_dumps_stacks(tmp_path):
    """No Ray process matches here: the step runs the one test, then lists no stacks."""
    done = run(
        tmp_path, 300, "cuda_ipc_hang", GPU_CHECKS_STACKS_AFTER_S="0", GPU_CHECKS_STACKS_OF="@none@"
    )
    assert done.returncode == 0 and "== cuda_ipc_hang: exit 0" in done.stdout
    log = (tmp_path / "cuda_ipc_hang.log").read_text()
    assert "stand-in python: -m pytest -m gpu" in log
    assert "test_workers_sharing_a_gpu_equal_generate[cuda_ipc]" in log
    assert "--- stacks of" not in log


def test_the_prefill_burst_step_runs_the_engine_benchmarks_burst_on_the_gpu_config(tmp_path):
    done = run(tmp_path, 300, "prefill_burst")
    assert done.returncode == 0 and "== prefill_burst: exit 0" in done.stdout
    log = (tmp_path / "prefill_burst.log").read_text()
    assert "scripts/bench_prefill_engine.py --config configs/single_gpu.yaml --only burst" in log


def test_the_graph_steps_run_the_graph_tests_and_an_eager_decode_config(tmp_path):
    done = run(tmp_path, 300, "decode_graphs", "decode_http_eager")
    assert done.returncode == 0 and "== decode_http_eager: exit 0" in done.stdout
    assert "tests/unit/test_step_graphs.py" in (tmp_path / "decode_graphs.log").read_text()
    assert "single_gpu_eager.yaml --only http" in (tmp_path / "decode_http_eager.log").read_text()
    from cluster.config import load_config

    eager = load_config(tmp_path / "single_gpu_eager.yaml")
    assert eager.decode.cuda_graphs.value == "off" and eager.decode.max_batch_size == 128


def test_the_shared_decode_steps_run_the_shared_phase_with_and_without_mps(tmp_path):
    """Without an MPS control binary the MPS step says so and fails alone."""
    done = run(tmp_path, 300, "decode_shared", "decode_shared_mps", PATH="/usr/bin:/bin")
    assert "== decode_shared: exit 0" in done.stdout
    assert "--only shared --batch-sizes 24" in (tmp_path / "decode_shared.log").read_text()
    mps = (tmp_path / "decode_shared_mps.log").read_text()
    assert "== decode_shared_mps: exit 3" in done.stdout and "no nvidia-cuda-mps-control" in mps


def test_the_media_uploads_step_serves_probes_and_stops(tmp_path):
    done = run(tmp_path, 300, "media_uploads")
    log = (tmp_path / "media_uploads.log").read_text()
    assert "== media_uploads: exit 0" in done.stdout, done.stdout + log
    assert "probe_server.py --url http://127.0.0.1:8000 --phases media" in log
    serve = (tmp_path / "media_serve.log").read_text()
    assert "-m cluster.cli serve --config configs/single_gpu.yaml" in serve
