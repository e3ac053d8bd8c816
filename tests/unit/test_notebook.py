"""scripts/routing_simulation.ipynb: committed without outputs, and runs top to bottom.

The run uses fast mode (EPD_NOTEBOOK_FAST=1) on a temporary copy, in an ipykernel kernel
started with this interpreter (sys.executable), so it sees the same packages as the tests.
Needs nbclient, nbformat and ipykernel (the test extra).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK = REPO / "scripts" / "routing_simulation.ipynb"
POLICIES = ("joint", "least_loaded", "affinity", "round_robin", "random")


def test_committed_notebook_has_no_outputs():
    nb = json.loads(NOTEBOOK.read_text(encoding="utf-8"))
    assert nb["cells"], "empty notebook"
    dirty = [
        i
        for i, c in enumerate(nb["cells"])
        if c["cell_type"] == "code" and (c.get("outputs") or c.get("execution_count") is not None)
    ]
    assert not dirty, (
        f"cells {dirty} carry outputs or execution counts: strip them before committing"
    )
    assert nb["metadata"].get("kernelspec", {}).get("name") == "python3"
    first = next(c for c in nb["cells"] if c["cell_type"] == "code")
    assert 'os.environ.get("EPD_NOTEBOOK_FAST") == "1"' in "".join(first["source"])


def _kernel_manager(tmp_path: Path):
    """A KernelManager for kernel "python3" that runs ipykernel under sys.executable, whatever
    python3 kernelspecs the user or system may have installed elsewhere."""
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    spec = tmp_path / "kernels" / "python3"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "Python 3 (epd tests)",
                "language": "python",
            }
        ),
        encoding="utf-8",
    )
    ksm = KernelSpecManager(kernel_dirs=[str(spec.parent)], ensure_native_kernel=False)
    return KernelManager(kernel_name="python3", kernel_spec_manager=ksm)


def _texts(cell) -> str:
    out = []
    for o in cell.get("outputs", []):
        if o["output_type"] == "stream" and o.get("name") == "stdout":
            out.append(o["text"])
        elif o["output_type"] in ("execute_result", "display_data"):
            out.append(o.get("data", {}).get("text/plain", ""))
    return "".join(out)


@pytest.mark.timeout(300)
def test_notebook_runs_in_fast_mode(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat", reason="pip install -e '.[test]' (nbformat)")
    nbclient = pytest.importorskip("nbclient", reason="pip install -e '.[test]' (nbclient)")
    pytest.importorskip("ipykernel", reason="pip install -e '.[test]' (ipykernel)")

    work = tmp_path / "run"
    work.mkdir()
    copy = work / NOTEBOOK.name
    shutil.copy(NOTEBOOK, copy)
    nb = nbformat.read(copy, as_version=4)

    # the kernel inherits this environment
    monkeypatch.setenv("EPD_NOTEBOOK_FAST", "1")
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    )
    monkeypatch.delenv("MPLBACKEND", raising=False)

    client = nbclient.NotebookClient(
        nb,
        km=_kernel_manager(tmp_path),
        kernel_name="python3",
        timeout=300,
        resources={"metadata": {"path": str(work)}},
    )
    t0 = time.perf_counter()
    client.execute()  # raises CellExecutionError on the first failing cell
    elapsed = time.perf_counter() - t0
    print(f"notebook ran in fast mode in {elapsed:.1f} s")

    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    errors = [o for c in code_cells for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    assert all(c.execution_count is not None for c in code_cells), "a code cell did not run"
    assert "FAST=True" in _texts(code_cells[0]), "the notebook did not pick up EPD_NOTEBOOK_FAST=1"

    images = [
        o
        for c in code_cells
        for o in c.outputs
        if o.output_type in ("display_data", "execute_result") and "image/png" in o.get("data", {})
    ]
    assert len(images) >= 4, (
        f"expected the sweep, CDF, goodput and cache plots, got {len(images)} image(s)"
    )

    text = "\n".join(_texts(c) for c in code_cells)
    tables = [_texts(c) for c in code_cells if "Policy comparison:" in _texts(c)]
    assert tables, "no policy comparison table printed"
    head = tables[0]
    for column in ("policy", "p50", "p99", "good%"):
        assert column in head, f"comparison table lacks column {column!r}"
    for policy in POLICIES:
        assert f"\n{policy} " in head, f"comparison table lacks a row for {policy}"
    assert "joint p99 / least_loaded p99" in text, "no joint / least_loaded ratio printed"
    assert "encoder-cache hit rate" in text, "no cache-affinity results printed"
    assert "now |err| %" in text and "equal workers' estimates" in text, (
        "no calibration-through-a-burst results printed"
    )
