"""Which KV goes prefill -> ingress -> decode inside link calls (RequestPath._kv_inline):
plain logic on the config and the prompt's length, no Ray."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cluster.config import load_config
from cluster.request_path import RequestPath

BYTES_PER_TOKEN = 768  # the default model's


def inline(num_prompt_tokens: int, **transport) -> bool:
    config = load_config().replace(transport=transport) if transport else load_config()
    path = SimpleNamespace(
        config=config,
        planner=SimpleNamespace(spec=SimpleNamespace(kv_bytes_per_token=BYTES_PER_TOKEN)),
    )
    return RequestPath._kv_inline(path, SimpleNamespace(num_prompt_tokens=num_prompt_tokens))


def test_a_kv_up_to_inline_max_bytes_goes_inside_the_links():
    limit = load_config().transport.inline_max_bytes
    assert inline(limit // BYTES_PER_TOKEN)
    assert not inline(limit // BYTES_PER_TOKEN + 1)


@pytest.mark.parametrize(
    "transport", [{"direct_links": False}, {"kv": "gloo"}, {"inline_max_bytes": 0}]
)
def test_no_links_another_transport_or_no_inlining_keeps_the_ray_calls(transport):
    assert not inline(8, **transport)


def test_the_bound_applies_to_kv_alone_when_embeddings_move_over_gloo():
    assert inline(4096 // BYTES_PER_TOKEN, embeddings="gloo", inline_max_bytes=4096)
    assert not inline(4096 // BYTES_PER_TOKEN + 1, embeddings="gloo", inline_max_bytes=4096)
