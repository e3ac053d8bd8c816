"""On a CUDA machine: CUDA towers and LM, each GPU transport between the actors, token-exact
against the checkpoint's own `generate` on the same GPU (float32), 3 copies of the varied
requests in flight. Workers share one GPU (fractional num_gpus) over the object store and CUDA
IPC; nccl needs a GPU per worker (on one GPU its first transfer hangs: docs/GPU_CHECKS.md)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.integration.conftest import cluster_config, deploy
from tests.integration.reference import reference_generate
from tests.integration.test_token_exact import MAX_TOKENS, _send_all, varied_requests

pytestmark = pytest.mark.gpu


def _check_against_generate(config) -> None:
    app = deploy(config)
    requests = varied_requests()
    refs = [
        reference_generate(str(config.model.checkpoint_path), m, MAX_TOKENS, device="cuda")
        for m in requests
    ]
    got = asyncio.run(_send_all(app, requests, copies=3))
    for i, response in enumerate(got):
        ids, text, finish = refs[i % len(refs)]
        assert response["choices"][0]["message"]["content"] == text
        assert response["usage"]["completion_tokens"] == len(ids)


@pytest.mark.parametrize("transport", ["object_store", "cuda_ipc"])
def test_workers_sharing_a_gpu_equal_generate(ray_session, transport):
    gpu = {"num_gpus": 0.25}
    _check_against_generate(
        cluster_config(
            model={"device": "cuda"},
            encoder=gpu,
            prefill=gpu,
            decode=gpu,
            transport={"embeddings": transport, "kv": transport},
        )
    )


@pytest.mark.skipif(
    torch.cuda.device_count() < 3,
    reason="nccl needs a GPU per worker: 3 here (one encoder, prefill, decode)",
)
def test_nccl_between_gpus_equals_generate(ray_session):
    gpu = {"num_gpus": 1}
    encoder = {**gpu, "num_workers": 1}
    _check_against_generate(
        cluster_config(
            model={"device": "cuda"},
            encoder=encoder,
            prefill=gpu,
            decode=gpu,
            transport={"embeddings": "nccl", "kv": "nccl"},
        )
    )
