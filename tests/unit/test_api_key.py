"""The API key middleware on a plain FastAPI app: /v1, /tokenize and /detokenize want the
bearer key, other paths stay open, and a streamed response passes through whole."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient

from cluster.api_key import ApiKeyMiddleware


def _client(key: str | None) -> TestClient:
    app = FastAPI()
    app.add_middleware(ApiKeyMiddleware)
    app.state.api_key = key

    @app.get("/v1/stream")
    async def stream():
        async def parts():
            for i in range(3):
                yield f"data: {i}\n\n"

        return StreamingResponse(parts(), media_type="text/event-stream")

    @app.get("/health")
    async def health():
        return {"ok": True}

    @app.post("/tokenize")
    @app.post("/detokenize")
    async def tokens():
        return {"tokens": []}

    return TestClient(app)


def test_v1_wants_the_key_and_says_so():
    client = _client("sekrit")
    refused = client.get("/v1/stream")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert refused.headers["www-authenticate"] == "Bearer"
    wrong = client.get("/v1/stream", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    ok = client.get("/v1/stream", headers={"Authorization": "Bearer sekrit"})
    assert ok.status_code == 200 and ok.text == "data: 0\n\ndata: 1\n\ndata: 2\n\n"


def test_probes_stay_open_and_no_key_means_open():
    assert _client("sekrit").get("/health").status_code == 200
    assert _client(None).get("/v1/stream").status_code == 200


def test_tokenize_and_detokenize_want_the_key_too():
    """vLLM leaves them open; here they show the chat template and spend the ingress's CPU."""
    client = _client("sekrit")
    for path in ("/tokenize", "/detokenize"):
        assert client.post(path).status_code == 401
        ok = client.post(path, headers={"Authorization": "Bearer sekrit"})
        assert ok.status_code == 200 and ok.json() == {"tokens": []}
    assert _client(None).post("/tokenize").status_code == 200
