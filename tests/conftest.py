"""Suite-wide hooks: GPU-only tests are skipped where torch sees no CUDA device, and the
default model, when a selected test needs it and it is not built yet, trains in the
background from the start of the run instead of when its first test asks."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# Tests that serve or load the embedded default model (a trained built-in).
NEEDS_DEFAULT_MODEL = ("test_shapes.py::test_trained", "test_default_model.py::")
_build: dict[str, subprocess.Popen] = {}


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (what a GPU run checks: docs/GPU_CHECKS.md)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _default_model_dir() -> tuple[str, Path]:
    from cluster.config import load_config

    model = load_config().model
    return model.builtin, Path(model.checkpoint).expanduser()


def pytest_collection_finish(session):
    """About 80 s of one core on a new machine: started beside the first tests, on the core
    they leave (unit tests run one torch thread). The build is atomic, so a second builder
    could only lose a race, never see half a checkpoint."""
    if not any(key in item.nodeid for item in session.items for key in NEEDS_DEFAULT_MODEL):
        return
    recipe, path = _default_model_dir()
    if recipe is None or (path / "config.json").is_file():
        return
    log = open(Path(tempfile.gettempdir()) / f"epd-default-model-build-{os.getpid()}.log", "w")
    argv = [sys.executable, "-m", "actors.checkpoints", recipe, str(path)]
    _build["default"] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)


@pytest.fixture(scope="session")
def default_model_built() -> Path:
    """The default model's directory, once the background build (if any) has finished."""
    proc = _build.get("default")
    if proc is not None and proc.wait() != 0:
        pytest.fail(f"building the default model failed (exit {proc.returncode}): {proc.args}")
    from actors.checkpoints.build import ensure_checkpoint

    recipe, path = _default_model_dir()
    return ensure_checkpoint(path, recipe)
