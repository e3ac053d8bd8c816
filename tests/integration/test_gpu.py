"""On a CUDA machine: CUDA towers and LM, NCCL between the actors, token-exact against the
checkpoint's own `generate` on the same GPU (float32)."""

from __future__ import annotations

import asyncio

import pytest

from tests.integration.conftest import cluster_config, deploy
from tests.integration.reference import reference_generate
from tests.integration.test_token_exact import MAX_TOKENS, _send_all, varied_requests

pytestmark = pytest.mark.gpu


def test_cuda_nccl_cluster_equals_generate(ray_session):
    gpu = {"num_gpus": 0.25}
    config = cluster_config(model={"device": "cuda"}, encoder=gpu, prefill=gpu, decode=gpu, transport={"embeddings": "nccl", "kv": "nccl"})
    app = deploy(config)
    requests = varied_requests()
    refs = [reference_generate(str(config.model.checkpoint_path), m, MAX_TOKENS, device="cuda") for m in requests]
    got = asyncio.run(_send_all(app, requests, copies=3))
    for i, response in enumerate(got):
        ids, text, finish = refs[i % len(refs)]
        assert response["choices"][0]["message"]["content"] == text
        assert response["usage"]["completion_tokens"] == len(ids)
