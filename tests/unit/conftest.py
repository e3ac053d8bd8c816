"""Shared unit-test fixtures: one torch thread, one tiny checkpoint per session."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """Tiny matrices gain nothing from intra-op threads, which thrash on a busy 2-core box."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory) -> Path:
    """The tiny-llava checkpoint, built once through the same code `epd build-model` runs."""
    from actors.checkpoints import build_checkpoint

    return build_checkpoint("tiny-llava", tmp_path_factory.mktemp("ck") / "tiny", progress=False)


@pytest.fixture(scope="session")
def omni_ckpt(tmp_path_factory) -> Path:
    from actors.checkpoints import build_checkpoint

    return build_checkpoint("tiny-omni", tmp_path_factory.mktemp("ck") / "omni", progress=False)


@pytest.fixture(scope="session")
def audio_ckpt(tmp_path_factory) -> Path:
    from actors.checkpoints import build_checkpoint

    return build_checkpoint("tiny-qwen2-audio", tmp_path_factory.mktemp("ck") / "audio", progress=False)


@pytest.fixture(scope="session")
def published_omni_ckpt(tmp_path_factory) -> Path:
    """Qwen2.5-Omni in the published layout: thinker + talker + token2wav in one repo."""
    from actors.checkpoints import build_checkpoint

    return build_checkpoint("tiny-qwen2.5-omni", tmp_path_factory.mktemp("ck") / "qwen2.5-omni", progress=False)
