"""Checkpoint locations: a local directory or a Hub repo id resolved through a Hugging Face
cache filled by hand (offline), pinned to a commit; the startup checks (`ensure_model`,
`epd serve --model`) that fail before any actor starts, naming the problem."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from huggingface_hub import constants

from actors.models.source import CheckpointNotFound, is_repo_id, resolve_checkpoint
from cluster.config import ConfigError, load_config
from cluster.prepare import ensure_model, with_model
from tests.hf_cache import fill_hf_cache

REPO = Path(__file__).resolve().parents[2]
COMMIT = "a" * 40


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


@pytest.fixture
def hub_cache(tmp_path, ckpt) -> Path:
    fill_hf_cache(tmp_path / "hub", "epd-test/tiny-llava", ckpt, COMMIT)
    return tmp_path / "hub"


@pytest.mark.parametrize(
    "location,repo",
    [
        ("Qwen/Qwen2.5-VL-3B-Instruct", True),
        ("gpt2", True),
        ("org/name.v2-x_y", True),
        ("~/models/x", False),
        ("/abs/dir", False),
        ("./rel", False),
        ("a/b/c", False),
        ("$HOME/m", False),
        ("../up", False),
    ],
)
def test_repo_ids_and_paths_are_told_apart(location, repo):
    assert is_repo_id(location) is repo


def test_an_existing_directory_is_never_a_repo_id(tmp_path, monkeypatch):
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert not is_repo_id("org/name")
    assert resolve_checkpoint("org/name") == Path("org/name")


def test_repo_id_resolves_offline_from_a_filled_cache(hub_cache, ckpt, offline):
    path = resolve_checkpoint("epd-test/tiny-llava", cache_dir=str(hub_cache))
    assert (
        path.name == COMMIT
        and (path / "config.json").read_bytes() == (ckpt / "config.json").read_bytes()
    )
    assert resolve_checkpoint("epd-test/tiny-llava", COMMIT, str(hub_cache)) == path


def test_a_pinned_commit_is_read_from_the_cache_without_asking_the_hub(hub_cache, monkeypatch):
    import huggingface_hub.hf_api as api

    for call in ("repo_info", "list_repo_tree"):
        monkeypatch.setattr(
            api.HfApi, call, lambda *a, **k: pytest.fail("asked the Hub for a cached pinned commit")
        )
    assert resolve_checkpoint("epd-test/tiny-llava", COMMIT, str(hub_cache)).name == COMMIT


def test_unknown_repo_id_offline_is_named(tmp_path, offline):
    with pytest.raises(CheckpointNotFound) as err:
        resolve_checkpoint("no-such-org/no-such-model", cache_dir=str(tmp_path))
    message = str(err.value)
    assert (
        "no-such-org/no-such-model" in message
        and str(tmp_path) in message
        and "HF_HUB_OFFLINE" in message
    )
    assert "recipe" not in message  # not the old advice to build a random model


def _config(**model):
    return load_config().replace(model={"builtin": None, "revision": None, **model})


def test_ensure_model_pins_a_repo_id_to_its_commit(hub_cache, tmp_path, offline):
    config = ensure_model(_config(checkpoint="epd-test/tiny-llava", hub_cache_dir=str(hub_cache)))
    assert config.model.revision == COMMIT
    assert (
        config.model.checkpoint_path
        == hub_cache / "models--epd-test--tiny-llava" / "snapshots" / COMMIT
    )


def test_a_relative_directory_is_made_absolute_for_the_workers(ckpt, monkeypatch):
    monkeypatch.chdir(ckpt.parent)
    config = ensure_model(_config(checkpoint=ckpt.name))
    assert config.model.checkpoint == str(ckpt.resolve())


def test_unknown_repo_id_fails_startup(tmp_path, offline):
    with pytest.raises(ConfigError, match="no-such-org/no-such-model"):
        ensure_model(_config(checkpoint="no-such-org/no-such-model", hub_cache_dir=str(tmp_path)))


def test_unsupported_model_type_is_named_with_the_supported_ones(tmp_path):
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(
        json.dumps({"model_type": "bert", "hidden_size": 8})
    )
    with pytest.raises(ConfigError) as err:
        ensure_model(_config(checkpoint=str(tmp_path / "bert")))
    assert "'bert'" in str(err.value)
    for supported in ("llava", "qwen2_audio", "qwen2_5_omni", "qwen2_5_omni_thinker"):
        assert supported in str(err.value)


def test_model_flag_overrides_the_checkpoint_and_names_the_model():
    base = load_config()
    config = with_model(base, "Qwen/Qwen2.5-VL-3B-Instruct")
    assert (config.model.checkpoint, config.model.served_name, config.model.builtin) == (
        "Qwen/Qwen2.5-VL-3B-Instruct",
    ) * 2 + (None,)
    assert with_model(base, "/data/m", "mine").model.served_name == "mine"
    assert with_model(base, None) == base


def test_epd_serve_with_an_unknown_repo_offline_exits_before_starting_anything(tmp_path):
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": str(tmp_path),
        "PYTHONPATH": str(REPO),
    }
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "serve", "--model", "no-such-org/no-such-model"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert "no-such-org/no-such-model" in out.stderr and "HF_HUB_OFFLINE" in out.stderr
    assert (
        "Traceback" not in out.stderr and "Ray" not in out.stderr + out.stdout
    )  # no cluster was started
    assert time.monotonic() - started < 60
