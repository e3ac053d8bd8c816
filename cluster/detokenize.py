"""Incremental detokenization with stop strings, for streamed and whole responses."""

from __future__ import annotations


class IncrementalText:
    """Feed token ids as they come; get back the text that is safe to show so far.

    Text is held back while it ends in an incomplete UTF-8 sequence or in a prefix of a
    stop string, so a client never sees text that a later token retracts.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), hidden_ids: tuple[int, ...] = ()):
        self._tokenizer = tokenizer
        self._stop = stop
        self._hidden = set(hidden_ids)
        self._ids: list[int] = []
        self._emitted = 0
        self._stop_after = 0  # a stop string must end past this character (min_tokens)
        self.stopped = False

    def push(
        self, token_ids: tuple[int, ...] | list[int], final: bool = False, protect: bool = False
    ) -> str:
        """`protect`: no stop string may end in the text so far (vLLM checks none before
        min_tokens); one may still begin in it and end in later text."""
        self._ids.extend(t for t in token_ids if t not in self._hidden)
        text = self._tokenizer.decode(self._ids, skip_special_tokens=True)
        if protect:
            self._stop_after = len(text)
        safe = len(text)
        for stop in self._stop:
            at = text.find(stop, max(0, self._stop_after - len(stop) + 1))
            if at != -1 and at < safe:
                safe, self.stopped = at, True
        if not self.stopped and not final:
            safe = min(safe, self._held_back(text))
        delta = text[self._emitted : safe] if safe > self._emitted else ""
        self._emitted = max(self._emitted, safe)
        return delta

    def _held_back(self, text: str) -> int:
        """Length of the prefix of `text` that is safe to show: all but a trailing incomplete
        character and the longest tail that could still grow into any one stop string."""
        end = len(text)
        while end and text[end - 1] == "\ufffd":  # a multi-byte character still arriving
            end -= 1
        body, hold = text[:end], 0
        for stop in self._stop:  # each stop is matched against the same tail, independently
            for k in range(min(len(stop) - 1, end), 0, -1):
                if body.endswith(stop[:k]):
                    hold = max(hold, k)
                    break
        return end - hold
