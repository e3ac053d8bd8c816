"""A decode step's attention mask: the 4D boolean mask handed to SDPA as is attends exactly as
the 2D padding mask transformers expands, and is used only where one mask serves every layer."""

from __future__ import annotations

import copy

import torch
from transformers import DynamicCache, LlamaConfig, LlamaModel, MistralConfig, Qwen2Config

from actors.models.adapter import ModelAdapter, _full_window_sdpa


class _LanguageModelOnly(ModelAdapter):
    """The adapter's language-model side over a bare decoder stack (no towers)."""

    def __init__(self, lm):
        self._lm = lm

    def layout(self, item):
        raise NotImplementedError

    def encode(self, items):
        raise NotImplementedError


def _config(cls, **kw):
    config = cls(**kw)
    config._attn_implementation = kw.get("attn_implementation", "sdpa")
    return config


def test_only_sdpa_over_full_windows_takes_the_4d_mask():
    assert _full_window_sdpa(_config(LlamaConfig))
    assert _full_window_sdpa(_config(Qwen2Config))  # sliding_window set, but no layer uses it
    assert not _full_window_sdpa(_config(LlamaConfig, attn_implementation="eager"))
    assert not _full_window_sdpa(_config(MistralConfig, sliding_window=64))
    layers = ["full_attention", "sliding_attention"]
    sliding = _config(Qwen2Config, num_hidden_layers=2, layer_types=layers)
    assert not _full_window_sdpa(sliding)


def test_the_4d_mask_attends_as_the_2d_one():
    """One decode step over padded rows (the first and last start late): the adapter's mask
    gives the hidden states transformers' expansion of the 2D mask gives."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="sdpa",
    )
    model = LlamaModel(config).eval()
    adapter = _LanguageModelOnly(model)
    valid = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1]])
    ids = torch.randint(0, 64, (3, 6))
    positions = (valid.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        cache = DynamicCache()
        model(
            ids[:, :5],
            attention_mask=valid[:, :5],
            position_ids=positions[:, :5],
            past_key_values=cache,
            use_cache=True,
        )
        step = (
            lambda mask: (
                model(  # noqa: E731
                    ids[:, 5:],
                    attention_mask=mask,
                    position_ids=positions[:, 5:],
                    past_key_values=copy.deepcopy(cache),
                    use_cache=True,
                ).last_hidden_state
            )
        )
        given = adapter.step_mask(valid)
        assert given.shape == (3, 1, 1, 6) and given.dtype == torch.bool
        assert torch.allclose(step(valid), step(given), atol=1e-6)
        assert not torch.allclose(step(valid), step(torch.ones_like(given)), atol=1e-3)
