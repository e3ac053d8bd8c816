"""Checkpoints as users have them, served over HTTP on a real local Ray + Serve and token-exact
against the model's own `generate`: a Hub repo id resolved offline from a Hugging Face cache
filled here, served in bfloat16 on CPU (against `generate` in bfloat16, single requests).
Qwen2.5-Omni in the published layout is test_modalities.py's all-modality app."""

from __future__ import annotations

import torch
from huggingface_hub import constants

from cluster.prepare import ensure_model
from tests.hf_cache import fill_hf_cache
from tests.integration.conftest import cluster_config, deploy
from tests.integration.reference import reference_generate
from tests.integration.test_token_exact import varied_requests

MAX_TOKENS = 12
REPO_ID = "epd-test/tiny-llava"


def _answers(app, requests) -> list[tuple[str, int, str]]:
    out = []
    for messages in requests:  # one at a time: single requests
        response = app.chat(messages, temperature=0, max_tokens=MAX_TOKENS)
        assert response.status_code == 200, response.text
        body = response.json()
        out.append(
            (
                body["choices"][0]["message"]["content"],
                body["usage"]["completion_tokens"],
                body["choices"][0]["finish_reason"],
            )
        )
    return out


def _check(app, requests, dtype=torch.float32) -> None:
    checkpoint = str(app.config.model.checkpoint_path)
    want = [reference_generate(checkpoint, m, MAX_TOKENS, dtype=dtype) for m in requests]
    assert len({text for _, text, _ in want}) > 1
    assert _answers(app, requests) == [(text, len(ids), finish) for ids, text, finish in want]


def test_hub_repo_id_served_offline_from_a_filled_cache_in_bfloat16(
    ray_session, tmp_path, monkeypatch
):
    """One deploy for two things: the repo id path, and bfloat16 on CPU against `generate` in
    bfloat16 (single requests)."""
    monkeypatch.setattr(
        constants, "HF_HUB_OFFLINE", True
    )  # this process; the workers read a pinned commit from the cache
    snapshot = fill_hf_cache(tmp_path / "hub", REPO_ID, cluster_config().model.checkpoint_path)
    config = ensure_model(
        cluster_config(
            model={
                "checkpoint": REPO_ID,
                "hub_cache_dir": str(tmp_path / "hub"),
                "builtin": None,
                "served_name": REPO_ID,
                "dtype": "bfloat16",
            },
            encoder={"num_workers": 1},  # single requests: one encoder is a worker less to start
        )
    )
    assert config.model.revision == snapshot.name
    app = deploy(config)
    assert app.http.get("/v1/models").json()["data"][0]["root"] == str(snapshot)
    requests = [varied_requests()[i] for i in (0, 4)]  # text only; two images
    in_float32 = [reference_generate(str(snapshot), m, MAX_TOKENS)[0] for m in requests]
    in_bfloat16 = [
        reference_generate(str(snapshot), m, MAX_TOKENS, dtype=torch.bfloat16)[0] for m in requests
    ]
    assert in_float32 != in_bfloat16  # else float32 workers would pass too
    _check(app, requests, dtype=torch.bfloat16)
