"""scripts/gpu_checks: the runbook's steps in order, each bounded by what is left of the budget."""

from __future__ import annotations

import os
import subprocess
import sys

from cluster.config import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "gpu_checks"


def run(tmp_path, budget_s: int, *steps: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "GPU_CHECKS_BUDGET_S": str(budget_s), "PYTHON": sys.executable}
    return subprocess.run(
        [str(SCRIPT), str(tmp_path), *steps], env=env, capture_output=True, text=True, timeout=120
    )


def test_a_step_runs_and_leaves_its_log(tmp_path):
    done = run(tmp_path, 300, "env")
    assert done.returncode == 0 and "== env: exit" in done.stdout
    assert (tmp_path / "env.log").read_text()  # torch's version, or its error where there is no GPU


def test_steps_are_skipped_once_the_budget_is_spent(tmp_path):
    done = run(tmp_path, 10, "env", "test_gpu")
    assert "== env: skipped" in done.stdout and "== test_gpu: skipped" in done.stdout
    assert not (tmp_path / "test_gpu.log").exists()


def test_an_unknown_step_is_refused_by_name(tmp_path):
    done = run(tmp_path, 300, "benchmark_everything")
    assert done.returncode == 2 and "unknown step benchmark_everything" in done.stderr
