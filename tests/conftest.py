"""Suite-wide hooks: GPU-only tests are skipped where torch sees no CUDA device, and the slow
self-contained work that selected tests need starts in the background as soon as such a test
is collected (tests/background.py): training the default model when it is not built yet, and
the clusters of their own that test_multi_node.py, test_serve_run.py and
test_ray_autoscaler.py start."""

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
SERVE_RUN = ("test_serve_run.py::", "test_default_model.py::")  # both read the `serve run` run
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


def _default_model_job() -> background.Job | None:
    recipe, path = _default_model_dir()
    if recipe and not (path / "config.json").is_file():
        return background.Job("actors.checkpoints", recipe, str(path))
    return None


def _multi_node_job() -> background.Job:
    from tests.integration.test_multi_node import start_run

    return start_run()


def _serve_run_job() -> background.Job:
    from tests.integration import test_serve_run

    return test_serve_run.start_run()


def _ray_autoscaler_job() -> background.Job:
    from tests.integration import test_ray_autoscaler

    return test_ray_autoscaler.start_run()


# name -> (the tests that need it, what starts it: None where nothing needs doing)
BACKGROUND = {
    "default-model": (NEEDS_DEFAULT_MODEL, _default_model_job),
    "multi-node": ((MULTI_NODE,), _multi_node_job),
    "serve-run": (SERVE_RUN, _serve_run_job),
    "ray-autoscaler": ((RAY_AUTOSCALER,), _ray_autoscaler_job),
}


def pytest_itemcollected(item):
    """Each job starts as soon as a test that needs it is collected, not after the whole
    collection (some 15 s of one core importing test modules, the other core free). The
    default model takes about 80 s of one core on a new machine (unit tests run one torch
    thread, so a core is left); its build is atomic, so a second builder could only lose a
    race, never see half a checkpoint. The multi-node run and `serve run` bring Ray clusters
    of their own, as does the check with Ray's autoscaler. Nothing starts for
    `--collect-only`: no test will take it."""
    if item.config.option.collectonly:
        return
    for name, (keys, make) in BACKGROUND.items():
        if name not in _considered and any(key in item.nodeid for key in keys):
            _considered.add(name)
            if (job := make()) is not None:
                background.start(name, job)


_considered: set[str] = set()


def pytest_collection_finish(session):
    """A job whose tests were all deselected (-k, -m) stops now."""
    for name, (keys, _) in BACKGROUND.items():
        if not any(key in item.nodeid for item in session.items for key in keys):
            background.stop(name)


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
