"""The tokenizer's calls on the request path, made straight to its Rust backend where
transformers adds nothing to them.

Two costs of transformers' own calls there: its Python around a token's decode, and, for
encoding, `encode_batch`, which releases the GIL: with the ingress's event loop busy
streaming tokens, taking it back waits for the loop's switch interval (5 ms), so a short
prompt's tokenization took about a millisecond under load instead of 50 us (a profile of
the ingress at 32 streams). A single `encode` keeps the GIL; it is used for texts short
enough that keeping it stalls the loop less than that wait would (LONG_TEXT_CHARS).
"""

from __future__ import annotations

from collections.abc import Callable

LONG_TEXT_CHARS = 2048  # about 0.5 ms of encoding on a slow core: longer texts let go the GIL


def plain_decode(tokenizer) -> Callable:
    """`tokenizer.decode`, or the Rust tokenizer's own where transformers' adds nothing to it
    (no clean-up of spaces, no family's own `_decode`): a token then costs no list
    conversion and dispatch in Python."""
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    kind = type(tokenizer)
    plain = (
        isinstance(tokenizer, TokenizersBackend)
        and kind.decode is PreTrainedTokenizerBase.decode
        and kind._decode is TokenizersBackend._decode
        and not tokenizer.clean_up_tokenization_spaces
    )
    return tokenizer._tokenizer.decode if plain else tokenizer.decode


def text_ids(tokenizer) -> Callable[[str], list[int]]:
    """`text` -> its token ids without special tokens added, as
    `tokenizer(text, add_special_tokens=False)["input_ids"]` gives them."""
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    kind = type(tokenizer)
    plain = (
        isinstance(tokenizer, TokenizersBackend)
        and kind.__call__ is PreTrainedTokenizerBase.__call__
        and kind._encode_plus is TokenizersBackend._encode_plus
    )

    def by_transformers(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    if not plain:
        return by_transformers
    backend = tokenizer._tokenizer

    def ids(text: str) -> list[int]:
        # transformers' call resets truncation and padding on the backend; where either is set
        # (by another caller), its own call keeps the results the same
        if len(text) > LONG_TEXT_CHARS or backend.truncation or backend.padding:
            return by_transformers(text)
        return backend.encode(text, add_special_tokens=False).ids

    return ids
