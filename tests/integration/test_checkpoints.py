"""Checkpoints as users have them, served over HTTP on a real local Ray + Serve and token-exact
against the model's own `generate`: Qwen2.5-Omni in the published layout (thinker served,
talker ignored), a Hub repo id resolved offline from a Hugging Face cache filled here, and
bfloat16 on CPU (`generate` in bfloat16, single requests)."""
from __future__ import annotations

import pytest
import torch
from huggingface_hub import constants

from cluster.cli import ensure_model
from tests.hf_cache import fill_hf_cache
from tests.integration.conftest import cluster_config, deploy
from tests.integration.reference import reference_generate
from tests.integration.test_modalities import OMNI_REQUESTS, app_config, check_token_exact
from tests.integration.test_token_exact import varied_requests

MAX_TOKENS = 12
REPO_ID = "epd-test/tiny-llava"


def test_published_omni_layout_serves_its_thinker_token_exact(ray_session):
    app = deploy(app_config("qwen2_5_omni"))
    check_token_exact(app, OMNI_REQUESTS, copies=2)
    workers = app.http.get("/health", params={"verbose": 1}).json()["workers"]["encoder"]
    assert all(w["num_batches"] > 0 for w in workers), workers


def _answers(app, requests, **params) -> list[tuple[str, int, str]]:
    out = []
    for messages in requests:  # one at a time: single requests
        response = app.chat(messages, temperature=0, max_tokens=MAX_TOKENS, **params)
        assert response.status_code == 200, response.text
        body = response.json()
        out.append((body["choices"][0]["message"]["content"], body["usage"]["completion_tokens"], body["choices"][0]["finish_reason"]))
    return out


def _check(app, requests, dtype=torch.float32) -> None:
    checkpoint = str(app.config.model.checkpoint_path)
    want = [reference_generate(checkpoint, m, MAX_TOKENS, dtype=dtype) for m in requests]
    assert len({text for _, text, _ in want}) > 1
    assert _answers(app, requests) == [(text, len(ids), finish) for ids, text, finish in want]


def test_hub_repo_id_served_offline_from_a_filled_cache(ray_session, tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # this process; the workers read a pinned commit from the cache
    snapshot = fill_hf_cache(tmp_path / "hub", REPO_ID, cluster_config().model.checkpoint_path)
    config = ensure_model(cluster_config(model={"checkpoint": REPO_ID, "hub_cache_dir": str(tmp_path / "hub"), "builtin": None,
                                                "served_name": REPO_ID, "dtype": "auto"}))
    assert config.model.revision == snapshot.name
    app = deploy(config)
    assert app.http.get("/v1/models").json()["data"][0]["root"] == str(snapshot)
    _check(app, varied_requests()[:5])


def test_bfloat16_on_cpu_equals_generate_in_bfloat16(ray_session):
    app = deploy(cluster_config(model={"dtype": "bfloat16"}))
    requests = varied_requests()
    _check(app, [requests[0], requests[2], requests[4], requests[10]], dtype=torch.bfloat16)
