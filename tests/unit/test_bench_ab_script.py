"""scripts/bench_ab: each side of a pair runs on its own tree's packages, in turning order.
The benchmark is a stand-in that records where `cluster` comes from: the venv's editable
install maps it to the tree it was made from, so a base run that forgets this measures the
new code."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from cluster.config import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "bench_ab"
PROBE = """import argparse, importlib.util, json, os
p = argparse.ArgumentParser(); p.add_argument("--tag"); p.add_argument("--out")
a = p.parse_args()
origin = importlib.util.find_spec("cluster").origin
json.dump({"cluster": origin, "cwd": os.getcwd(), "tag": a.tag}, open(a.out, "w"))
"""


def run_ab(tmp_path, pairs: int) -> subprocess.CompletedProcess:
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    argv = [str(SCRIPT), "HEAD", str(pairs), str(tmp_path / "out"), str(probe), "--tag", "t"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHON"] = sys.executable
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)


def test_each_side_imports_its_own_tree(tmp_path):
    done = run_ab(tmp_path, 1)
    assert done.returncode == 0, done.stderr
    new = json.loads((tmp_path / "out" / "new1.json").read_text())
    base = json.loads((tmp_path / "out" / "base1.json").read_text())
    assert new["cluster"].startswith(str(REPO_ROOT) + "/") and new["tag"] == "t"
    assert base["cluster"].startswith(base["cwd"] + "/cluster/")
    assert base["cwd"] != str(REPO_ROOT)


def test_pairs_turn_their_order_and_the_worktree_is_removed(tmp_path):
    done = run_ab(tmp_path, 2)
    order = [line.split()[1] for line in done.stderr.splitlines() if line[:2].isdigit()]
    assert order == ["new1", "base1", "base2", "new2"]
    base = json.loads((tmp_path / "out" / "base2.json").read_text())
    listed = subprocess.run(["git", "-C", str(REPO_ROOT), "worktree", "list"], capture_output=True)
    assert base["cwd"] not in listed.stdout.decode()
