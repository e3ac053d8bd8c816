"""The request path's tokenizer calls (cluster/tokenizer_calls.py): the same ids as
transformers' own call, by the backend's GIL-keeping `encode` only where that is safe."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from actors.checkpoints.llava import RECIPES, build_tokenizer  # noqa: E402
from actors.checkpoints.qwen import QWEN_RECIPES  # noqa: E402
from actors.checkpoints.qwen import build_tokenizer as build_qwen_tokenizer  # noqa: E402
from cluster.tokenizer_calls import LONG_TEXT_CHARS, text_ids  # noqa: E402
from tests.unit.test_detokenize import sentencepiece_like  # noqa: E402

TEXTS = (
    "Describe this picture.",
    "<|im_start|>user\n<image><image> What is here? é 漢字 🙂<|im_end|>\n<|im_start|>assistant\n",
    "  leading spaces, a tab\tand\nnew lines  ",
    "",
)


@pytest.fixture(
    scope="module",
    params=["llava-bpe", "qwen2-bpe", "llama-sp"],
)
def tok(request):
    if request.param == "llava-bpe":
        return build_tokenizer(RECIPES["tiny-llava"])
    if request.param == "qwen2-bpe":
        return build_qwen_tokenizer(QWEN_RECIPES["tiny-qwen2-audio"])
    return sentencepiece_like()


def _counting(tok, monkeypatch) -> list[str]:
    """Texts that went through transformers' own call."""
    seen, own = [], tok._encode_plus

    def counted(text, *args, **kwargs):
        seen.append(text)
        return own(text, *args, **kwargs)

    monkeypatch.setattr(tok, "_encode_plus", counted)
    return seen


@pytest.mark.parametrize("text", TEXTS + ("A long prompt. " * 400,))
def test_the_ids_are_transformers_own(tok, text):
    assert text_ids(tok)(text) == tok(text, add_special_tokens=False)["input_ids"]


def test_short_texts_go_straight_to_the_backend_long_ones_through_transformers(tok, monkeypatch):
    ids = text_ids(tok)
    seen = _counting(tok, monkeypatch)
    ids(TEXTS[1])
    assert seen == []  # the backend's encode: the GIL kept, no wait to take it back
    long_text = "x " * LONG_TEXT_CHARS
    assert ids(long_text) == tok(long_text, add_special_tokens=False)["input_ids"]
    assert seen[0] == long_text  # long enough to let the event loop run meanwhile


def test_a_backend_left_truncating_is_not_trusted(tok, monkeypatch):
    ids, text = text_ids(tok), "one two three four five six seven eight"
    want = tok(text, add_special_tokens=False)["input_ids"]
    tok._tokenizer.enable_truncation(max_length=3)
    seen = _counting(tok, monkeypatch)
    try:
        assert ids(text) == want  # transformers' call resets the truncation for its call
        assert seen == [text]
    finally:
        tok._tokenizer.no_truncation()


def test_a_tokenizer_with_its_own_call_keeps_it():
    tok = build_tokenizer(RECIPES["tiny-llava"])

    class Own(type(tok)):
        def __call__(self, text, **kwargs):
            return {"input_ids": [7]}

    tok.__class__ = Own
    assert text_ids(tok)("anything") == [7]
