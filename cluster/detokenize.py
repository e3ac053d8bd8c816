"""Incremental detokenization with stop strings, for streamed and whole responses.

Each push decodes a small window of ids, not all of a request's ids, so a token costs the
same at any output length (as vLLM's and TGI's detokenizers): the window is the ids not yet
settled into text after a few settled ones as context, and its new text is what the window
decodes to past what the context alone decodes to. The context keeps decoding the way the
whole does at the seam: a SentencePiece decoder strips the leading space of the first token
it decodes, and a byte-level one turns a character split across tokens into "\ufffd" until
its last byte arrives (ids settle only into text that does not end in "\ufffd", where a
character may still be arriving). Stop strings are searched for only in text not searched
before, and in the last characters, which the settled text keeps in one short string.
Special tokens are left out of the text or kept in it (vLLM's `skip_special_tokens`), and a
matched stop string ends the text or stays at its end (`include_stop_str_in_output`).

The text is the one decoding all ids gives, at every push, for a decoder that decodes a
sequence as its pieces cut where a character ends (byte-level BPE, SentencePiece); a
byte-fallback run that turns out invalid UTF-8 is the exception (tests/unit/test_detokenize.py).
"""

from __future__ import annotations

from cluster.tokenizer_calls import plain_decode

_KEEP = 256  # settled characters kept in one string behind its end; older ones go to _parts
# Settled ids stay as context until the window is longer than this: a push then decodes the
# window once, not also the newly settled ids alone to make them the next context.
_WINDOW = 8


class IncrementalText:
    """Feed token ids as they come; get back the text that is safe to show so far.

    Text is held back while it ends in an incomplete UTF-8 sequence or in a prefix of a
    stop string, so a client never sees text that a later token retracts. `include_stop`:
    the text ends after the first stop string to complete, not before the earliest to begin
    (and no prefix is held back: text up to a stop's end is shown either way).
    """

    def __init__(
        self,
        tokenizer,
        stop: tuple[str, ...] = (),
        hidden_ids: tuple[int, ...] = (),
        *,
        skip_special_tokens: bool = True,
        include_stop: bool = False,
    ):
        self._decode_ids = plain_decode(tokenizer)
        self._stop = stop
        self._skip_special = skip_special_tokens
        self._include_stop = include_stop
        self._hidden = set(hidden_ids)
        # The window: the ids not settled into text, after `_num_context` settled ones that
        # decode (alone) to `_context_text`.
        self._window: list[int] = []
        self._num_context = 0
        self._context_text = ""
        # The text so far is "".join(_parts) + _text + _tail: _parts and _text are settled
        # (_base characters in _parts), _tail is what the unsettled ids add to it.
        self._parts: list[str] = []
        self._base = 0
        self._text = ""
        self._tail = ""
        self._max_stop = max(map(len, stop), default=0)
        self._keep = max(_KEEP, 2 * self._max_stop)
        # Per stop string: where a match may begin (from _stop_after), the first match in
        # the settled text from there (-1: none yet), and where no match in it begins below.
        self._match_from = [0] * len(stop)
        self._match = [-1] * len(stop)
        self._looked = [0] * len(stop)
        self._emitted = 0
        self._stop_after = 0  # a stop string must end past this character (min_tokens)
        self.stopped = False

    def push(
        self, token_ids: tuple[int, ...] | list[int], final: bool = False, protect: bool = False
    ) -> str:
        """`protect`: no stop string may end in the text so far (vLLM checks none before
        min_tokens); one may still begin in it and end in later text."""
        ids = [t for t in token_ids if t not in self._hidden]
        if ids:
            self._window.extend(ids)
            self._decode()
        settled = self._base + len(self._text)
        size = settled + len(self._tail)
        if protect:
            self._stop_after = size
        safe = size
        for i, stop in enumerate(self._stop):
            at = self._find(i, stop, settled, size)
            if at != -1:
                end = at + len(stop) if self._include_stop else at
                safe, self.stopped = min(safe, end), True
        if not self.stopped and not final:
            safe = min(safe, self._held_back(settled))
        delta = self._slice(self._emitted, safe) if safe > self._emitted else ""
        self._emitted = max(self._emitted, safe)
        if len(self._text) > 2 * self._keep:  # only the tail is searched: set the rest aside
            cut = len(self._text) - self._keep
            self._parts.append(self._text[:cut])
            self._base += cut
            self._text = self._text[cut:]
        return delta

    def _decode(self) -> None:
        """Decode the window; settle its new text unless it may still change (it ends in
        "\ufffd"). The window's ids are then all context, or, past _WINDOW ids, only those
        that have just settled (decoded again, alone, for the context's own text)."""
        text = self._decode_ids(self._window, skip_special_tokens=self._skip_special)
        if len(text) > len(self._context_text) and not text.endswith("\ufffd"):
            self._text += text[len(self._context_text) :]
            self._tail = ""
            if len(self._window) > _WINDOW and self._num_context:  # keep only the new ids
                del self._window[: self._num_context]
                text = self._decode_ids(self._window, skip_special_tokens=self._skip_special)
            self._num_context, self._context_text = len(self._window), text
        else:
            self._tail = text[len(self._context_text) :]

    def _find(self, i: int, stop: str, settled: int, size: int) -> int:
        """Where `stop` first occurs in the text so that it ends past _stop_after; -1 if
        nowhere. A match within the settled text is kept; the settled text is searched only
        past where it was searched before, and a match reaching into the unsettled tail is
        looked for again at every push (the tail may change)."""
        start = max(0, self._stop_after - len(stop) + 1)
        if start != self._match_from[i]:
            if not (start > self._match_from[i] and self._match[i] >= start):
                self._match[i], self._looked[i] = -1, start
            self._match_from[i] = start
        if self._match[i] != -1:
            return self._match[i]
        looked = self._looked[i]
        if looked >= self._base:
            at = self._text.find(stop, looked - self._base, settled - self._base)
            at = at + self._base if at != -1 else -1
        else:  # only where the text shrank under _stop_after (a decoder that merges bytes)
            at = self._slice(0, settled).find(stop, looked)
        if at != -1:
            self._match[i] = at
            return at
        self._looked[i] = looked = max(looked, settled - len(stop) + 1)
        if not self._tail or looked > size:
            return -1
        at = self._slice(looked, size).find(stop)
        return looked + at if at != -1 else -1

    def _held_back(self, settled: int) -> int:
        """Length of the prefix of the text that is safe to show: all but a trailing
        incomplete character and the longest tail that could still grow into any one stop
        string. (The settled text never ends in "\ufffd".)"""
        end = len(self._tail)
        while end and self._tail[end - 1] == "\ufffd":  # a multi-byte character still arriving
            end -= 1
        if not self._stop or self._include_stop:
            return settled + end
        body = self._text[max(0, len(self._text) - self._max_stop + 1) :] + self._tail[:end]
        hold = 0
        for stop in self._stop:  # each stop is matched against the same tail, independently
            for k in range(min(len(stop) - 1, len(body)), 0, -1):
                if body.endswith(stop[:k]):
                    hold = max(hold, k)
                    break
        return settled + end - hold

    def _slice(self, a: int, b: int) -> str:
        """The text's characters a to b."""
        if a < self._base:  # text set aside: only a delta after a stop string or an odd decoder
            return ("".join(self._parts) + self._text + self._tail)[a:b]
        a, b, n = a - self._base, b - self._base, len(self._text)
        return self._text[a:b] + self._tail[max(0, a - n) : max(0, b - n)]
