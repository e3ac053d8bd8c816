"""How many bytes a request's KV takes: from the language model's config, and per sequence."""

from __future__ import annotations

from types import SimpleNamespace

from actors.engine import kv


def test_bytes_per_token_counts_keys_and_values_of_every_layer():
    config = SimpleNamespace(
        num_hidden_layers=28,
        num_key_value_heads=4,
        num_attention_heads=28,
        hidden_size=3584,
        head_dim=128,
    )
    assert (
        kv.bytes_per_token(config, dtype_bytes=2) == 28 * 2 * 4 * 128 * 2
    )  # Qwen2.5-7B in bf16: 57,344


def test_head_dim_and_kv_heads_default_as_in_transformers():
    config = SimpleNamespace(
        num_hidden_layers=2, num_attention_heads=4, hidden_size=64, head_dim=None
    )
    assert (
        kv.bytes_per_token(config, dtype_bytes=4) == 2 * 2 * 4 * 16 * 4
    )  # no GQA: kv heads = heads


def test_sequence_bytes_is_prompt_plus_max_tokens_capped_by_the_context():
    assert (
        kv.sequence_bytes(512, num_prompt_tokens=100, max_tokens=28, max_model_len=2048)
        == 512 * 128
    )
    assert (
        kv.sequence_bytes(512, num_prompt_tokens=2000, max_tokens=500, max_model_len=2048)
        == 512 * 2048
    )
