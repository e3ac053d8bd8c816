"""Suite-wide hooks: GPU-only tests are skipped where torch sees no CUDA device, and the slow
self-contained work that selected tests need starts in the background as soon as the run is
collected (tests/background.py): training the default model when it is not built yet, and
the clusters of their own that test_multi_node.py and test_serve_run.py start."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import background

# Tests that serve or load the embedded default model (a trained built-in).
NEEDS_DEFAULT_MODEL = (
    "test_shapes.py::test_trained",
    "test_default_model.py::",
    "test_serve_run.py::",
)
MULTI_NODE = "test_multi_node.py::"
SERVE_RUN = "test_serve_run.py::"
RAY_AUTOSCALER = "test_ray_autoscaler.py::"


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


def _selected(session, keys: tuple[str, ...]) -> bool:
    return any(key in item.nodeid for item in session.items for key in keys)


def pytest_collection_finish(session):
    """The default model takes about 80 s of one core on a new machine (unit tests run one
    torch thread, so a core is left); its build is atomic, so a second builder could only lose
    a race, never see half a checkpoint. The multi-node run and `serve run` bring Ray clusters
    of their own, as does the check with Ray's autoscaler."""
    recipe, path = _default_model_dir()
    if _selected(session, NEEDS_DEFAULT_MODEL) and recipe and not (path / "config.json").is_file():
        background.start("default-model", background.Job("actors.checkpoints", recipe, str(path)))
    if _selected(session, (MULTI_NODE,)):
        from tests.integration.test_multi_node import start_run

        background.start("multi-node", start_run())
    if _selected(session, (SERVE_RUN,)):
        from tests.integration import test_serve_run

        background.start("serve-run", test_serve_run.start_run())
    if _selected(session, (RAY_AUTOSCALER,)):
        from tests.integration import test_ray_autoscaler

        background.start("ray-autoscaler", test_ray_autoscaler.start_run())


def pytest_sessionfinish(session, exitstatus):
    background.kill_all()


@pytest.fixture(scope="session")
def default_model_built() -> Path:
    """The default model's directory, once the background build (if any) has finished."""
    job = background.take("default-model")
    if job is not None:
        status, out, err = job.finish(timeout_s=900)
        assert status == 0, f"building the default model failed:\n{out[-2000:]}\n{err[-3000:]}"
    from actors.checkpoints.build import ensure_checkpoint

    recipe, path = _default_model_dir()
    return ensure_checkpoint(path, recipe)
