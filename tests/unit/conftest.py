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
    from actors.checkpoints.build import build_checkpoint

    return build_checkpoint("tiny-llava", tmp_path_factory.mktemp("ck") / "tiny", progress=False)


@pytest.fixture(scope="session")
def omni_ckpt(tmp_path_factory) -> Path:
    from actors.checkpoints.build import build_checkpoint

    return build_checkpoint("tiny-omni", tmp_path_factory.mktemp("ck") / "omni", progress=False)


@pytest.fixture(scope="session")
def audio_ckpt(tmp_path_factory) -> Path:
    from actors.checkpoints.build import build_checkpoint

    return build_checkpoint(
        "tiny-qwen2-audio", tmp_path_factory.mktemp("ck") / "audio", progress=False
    )


@pytest.fixture(scope="session")
def published_omni_ckpt(tmp_path_factory) -> Path:
    """Qwen2.5-Omni in the published layout: thinker + talker + token2wav in one repo."""
    from actors.checkpoints.build import build_checkpoint

    return build_checkpoint(
        "tiny-qwen2.5-omni", tmp_path_factory.mktemp("ck") / "qwen2.5-omni", progress=False
    )


# -- the router tests' shared factories (router/: plain Python, no model) --------------------------

from router.sim.workload import Workload  # noqa: E402
from router.types import (  # noqa: E402
    ALL_MODALITIES,
    MediaJob,
    RequestProfile,
    WorkerInfo,
    WorkerKind,
)

E, P, D = WorkerKind.ENCODER, WorkerKind.PREFILL, WorkerKind.DECODE
VISION, AUDIO = frozenset({"image", "video"}), frozenset({"audio"})
BYTES_PER_EMBEDDING = 8192


def media(
    identifier: str, modality: str = "image", size: float = 0.113, num_embeddings: int = 576
) -> MediaJob:
    """A media item as the router sees it (default: a 336x336 image)."""
    return MediaJob(
        identifier, modality, size, num_embeddings, num_embeddings * BYTES_PER_EMBEDDING
    )


def audio(identifier: str) -> MediaJob:
    """30 s of audio."""
    return media(identifier, "audio", 30.0, 1500)


def fleet(e: int = 3, p: int = 3, d: int = 3, **encoder_mods: frozenset[str]) -> list[WorkerInfo]:
    """e encoders (all modalities unless e.g. e1=AUDIO), p prefill, d decode workers, one node."""
    return (
        [WorkerInfo(E, i, modalities=encoder_mods.get(f"e{i}", ALL_MODALITIES)) for i in range(e)]
        + [WorkerInfo(P, i) for i in range(p)]
        + [WorkerInfo(D, i) for i in range(d)]
    )


def split_fleet() -> list[WorkerInfo]:
    """Encoders 0-1: the vision tower; encoder 2: the audio tower; 2 prefill, 2 decode."""
    return fleet(3, 2, 2, e0=VISION, e1=VISION, e2=AUDIO)


def mixed_workload(n: int) -> Workload:
    """Image + audio requests (split on a -split cluster), single items, text, some repeats."""
    import numpy as np

    rng = np.random.default_rng(3)
    profiles = []
    for k in range(n):
        kind = k % 4
        items = {
            0: (media(f"i{k}"), audio(f"a{k}")),
            1: (media(f"j{k}"),),
            2: (audio(f"b{k}"),),
            3: (),
        }[kind]
        if kind == 0 and k % 8 == 0:
            items = items + (media(f"i{k - 8}"),)  # a repeat: the encoder cache may hold it
        profiles.append(
            RequestProfile(1000 + sum(it.num_embeddings for it in items), items, max_tokens=16)
        )
    return Workload("mixed", profiles, np.cumsum(rng.exponential(0.02, n)))


def assert_idle(router) -> None:
    """Every job the router booked was released."""
    view = router.view
    assert all(c == 0 for counts in view.outstanding.values() for c in counts), view.outstanding
    assert all(ms == 0.0 for values in view.outstanding_ms.values() for ms in values), (
        view.outstanding_ms
    )


def sim_run(shape: str, n: int, load: float, policy: str, seed: int = 3, **workload):
    """A poisson workload of n requests at `load` x the capacity of cluster `shape`, simulated."""
    from router.sim.cluster_model import SimCluster, capacity_rps
    from router.sim.loop import simulate
    from router.sim.workload import make_workload

    cluster = SimCluster.parse(shape)
    wl = make_workload("poisson", n, seed=seed, **workload)
    return simulate(
        cluster, wl.at_rate(load * capacity_rps(cluster, wl)), policy, seed=seed, slo_ms=1500.0
    )


def _build(tmp_path_factory, recipe: str) -> Path:
    from actors.checkpoints.build import build_checkpoint

    return build_checkpoint(recipe, tmp_path_factory.mktemp("ck") / recipe, progress=False)


@pytest.fixture(scope="session")
def qwen_vl_ckpt(tmp_path_factory) -> Path:
    """tiny-qwen2.5-vl, in the published repos' layout."""
    return _build(tmp_path_factory, "tiny-qwen2.5-vl")


@pytest.fixture(scope="session")
def llava_next_ckpt(tmp_path_factory) -> Path:
    """tiny-llava-next, in the published repos' layout."""
    return _build(tmp_path_factory, "tiny-llava-next")
