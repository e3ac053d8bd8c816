"""Constrained decoding with xgrammar: a request's GrammarSpec compiled against the model's
tokenizer (cached), its per-request matcher, and the token bitmask the sampler applies.

Whitespace: JSON_SCHEMA compiles with `any_whitespace=False`, and JSON_OBJECT is the schema
{"type": "object"} compiled the same way, so output uses fixed separators (", " and ": ").
Free whitespace lets a model (a weak or random one above all) pad with spaces and newlines
until max_tokens, which is why vLLM grew `disable_any_whitespace`; fixed separators keep
the output as short as its content.

A matcher's stop tokens are its request's own (`SamplingParams.stop_token_ids`): once the
grammar is complete they are all the mask allows, and they never count as text inside it.
A matcher that has accepted a stop token is terminated: its row is masked entirely, and
the decode engine ends such a sequence (see `decode_state.finish_reason`).

Nothing here runs for a batch with no constrained row: the sampler calls in only for those.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch
import xgrammar as xgr

from actors.types import GrammarKind, GrammarSpec, SamplingParams

_OBJECT_SCHEMA = '{"type":"object"}'
# xgrammar's C++ errors start with "[time] file.cc:line: " and may add "Check failed: ...:".
_CPP_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*(Check failed:.*? is false:\s*)?")


class GrammarError(ValueError):
    """A grammar that cannot compile; the message names the problem (an HTTP 400)."""


def _message(exc: Exception) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _CPP_PREFIX.sub("", text)


def grammar_of(spec: GrammarSpec) -> xgr.Grammar:
    """The spec's grammar (no tokenizer needed); GrammarError naming what is wrong with it.
    The ingress validates a request with this; the workers compile what it returns."""
    if spec.kind == GrammarKind.JSON_OBJECT:
        schema = _OBJECT_SCHEMA
    elif spec.kind == GrammarKind.JSON_SCHEMA:
        schema = spec.schema
    else:
        raise GrammarError(f"unknown grammar kind {spec.kind!r}")
    try:
        return xgr.Grammar.from_json_schema(schema, any_whitespace=False)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise GrammarError(f"invalid JSON schema: {_message(exc)}") from exc


class Grammars:
    """Compiled grammars for one model (LRU by `GrammarSpec.key`) and matchers over them.

    `vocab_size` is the width of the model's logits (it may exceed the tokenizer's: the
    extra ids are always masked); `stop_token_ids` end a request whose own list is empty
    (None: xgrammar finds them in the tokenizer)."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        stop_token_ids: Sequence[int] | None,
        *,
        cache_size: int = 64,
    ):
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids or []) or None
        )
        self.stop_token_ids = list(info.stop_token_ids)  # None above: xgrammar detects them
        # Our LRU bounds the count; xgrammar's own cache would only hold a second copy.
        self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self._cache: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()  # the ingress may compile from several threads
        self.hits = self.misses = 0

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        with self._lock:
            compiled = self._cache.get(spec.key)
            if compiled is not None:
                self._cache.move_to_end(spec.key)
                self.hits += 1
                return compiled
            self.misses += 1
        try:
            compiled = self._compiler.compile_grammar(grammar_of(spec))
        except RuntimeError as exc:  # a grammar xgrammar built but cannot compile
            raise GrammarError(f"grammar does not compile: {_message(exc)}") from exc
        with self._lock:
            self._cache[spec.key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def matcher(
        self,
        spec: GrammarSpec,
        generated_ids: Sequence[int] = (),
        stop_token_ids: Sequence[int] = (),
    ) -> xgr.GrammarMatcher:
        """A matcher that has accepted `generated_ids` (what the request produced so far, on
        another worker or before this one); GrammarError if they do not match the grammar."""
        stops = list(stop_token_ids) or self.stop_token_ids
        matcher = xgr.GrammarMatcher(self.compile(spec), override_stop_tokens=stops)
        for i, token in enumerate(generated_ids):
            if not matcher.accept_token(token):
                raise GrammarError(f"generated token {token} (at {i}) does not match the grammar")
        return matcher


class ModelGrammars:
    """A worker's `Grammars`, built at its first constrained request from the adapter's
    checkpoint (its tokenizer) and logits width: a worker that never sees one pays nothing."""

    def __init__(self, adapter):
        self._adapter = adapter
        self._grammars: Grammars | None = None

    def matcher(self, sampling: SamplingParams, generated_ids: Sequence[int]):
        """The request's matcher, past `generated_ids`; GrammarError if it cannot be built."""
        assert sampling.grammar is not None
        if self._grammars is None:
            self._grammars = self._load()
        return self._grammars.matcher(sampling.grammar, generated_ids, sampling.stop_token_ids)

    @torch.inference_mode()
    def _load(self) -> Grammars:
        from transformers import AutoTokenizer  # once per worker, off the unconstrained path

        tokenizer = AutoTokenizer.from_pretrained(self._adapter.checkpoint)
        # The logits' width through the adapter's own calls: families keep the head privately.
        probe = torch.zeros(1, 1, dtype=torch.long, device=self._adapter.device)
        vocab_size = self._adapter.logits(self._adapter.embed_tokens(probe)).shape[-1]
        eos = tokenizer.eos_token_id  # the ingress's stop tokens (PromptPlanner.eos_token_ids)
        return Grammars(tokenizer, vocab_size, [eos] if eos is not None else None)


class _Buffers(threading.local):
    """A host bitmask per thread, grown as needed and reused across steps."""

    bitmask: torch.Tensor | None = None


_buffers = _Buffers()


def row_bitmask(
    matchers: Sequence[xgr.GrammarMatcher | None], vocab_size: int
) -> tuple[list[int], torch.Tensor] | None:
    """The constrained rows (matcher not None) and their host bitmask [len(rows), words]
    int32 (row j: what the j-th one allows next; a terminated matcher allows nothing), or
    None when no row is constrained or none restricts anything."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return None
    words = xgr.get_bitmask_shape(1, vocab_size)[1]
    buffer = _buffers.bitmask
    if buffer is None or buffer.shape[0] < len(rows) or buffer.shape[1] != words:
        with torch.inference_mode(False):  # a normal tensor: writable in and out of the mode
            buffer = xgr.allocate_token_bitmask(max(len(rows), 8), vocab_size)
        _buffers.bitmask = buffer
    bitmask, restricts = buffer[: len(rows)], False
    for j, i in enumerate(rows):
        if matchers[i].is_terminated():  # xgrammar refuses to fill it: nothing may follow
            bitmask[j].zero_()
            restricts = True
        else:
            restricts |= matchers[i].fill_next_token_bitmask(bitmask, j)
    return (rows, bitmask) if restricts else None


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Masked tokens of every row of `logits` [rows, vocab] to -inf, in place; `bitmask`
    [rows, words] on the logits' device."""
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1])


def advance(
    matchers: Sequence[xgr.GrammarMatcher | None], tokens: Sequence[int | None]
) -> list[int]:
    """Each constrained row's matcher takes its row's token; the rows whose matcher refused
    it (or that have no token)."""
    return [
        i
        for i, (m, t) in enumerate(zip(matchers, tokens, strict=True))
        if m is not None and (t is None or not m.accept_token(t))
    ]
