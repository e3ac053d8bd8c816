"""KV caches between stages and inside the decode batch.

A request's cache travels as ONE contiguous tensor [layers, 2, kv_heads, tokens, head_dim]
so each transport moves a single buffer. Inside a decode worker the running batch keeps
one left-padded [batch, kv_heads, tokens, head_dim] buffer per layer and key/value, with
spare rows and columns, plus a [batch, tokens] validity mask; requests join and leave in
place between steps (`Slab`).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from actors.engine.prompt_kv import PromptKV

SPARE_SLOTS = 64  # decode steps the batch's buffers absorb before they must grow (and copy)


class Slab:
    """The decode batch's K and V buffers, one [rows, kv_heads, columns, head_dim] pair per
    layer, with room to spare in rows and columns. The batch occupies rows [0, n) and
    columns [start, end); every row ends at `end` (left padding), so a step writes one column
    for all rows in place, a row that joins is written into a spare row, and a row that
    leaves is replaced by the last one. Nothing is copied whole except when the buffers grow."""

    def __init__(
        self, like: list[tuple[torch.Tensor, torch.Tensor]], rows: int, columns: int, end: int
    ):
        k0 = like[0][0]
        shape = lambda t: (rows, t.shape[1], columns, t.shape[-1])
        self.k = [k.new_zeros(shape(k)) for k, _ in like]
        self.v = [v.new_zeros(shape(v)) for _, v in like]
        self.valid = torch.zeros(rows, columns, dtype=torch.long, device=k0.device)  # 1: a token
        self.length = torch.zeros(rows, dtype=torch.long, device=k0.device)  # tokens a row holds
        self.row_lengths: list[int] = []  # the same, on the host (no device read to trim)
        self.device, self.dtype = k0.device, k0.dtype
        self.n, self.start, self.end = 0, end, end

    @property
    def rows(self) -> int:
        return self.k[0].shape[0]

    @property
    def columns(self) -> int:
        return self.k[0].shape[2]

    def views(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [self.view(i) for i in range(len(self.k))]

    def view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        cols = slice(self.start, self.end)
        return self.k[layer][: self.n, :, cols], self.v[layer][: self.n, :, cols]

    def regrown(self, rows: int, left: int, right: int) -> Slab:
        """A copy with room for `rows` rows, `left` columns before the window, `right` after."""
        width = self.end - self.start
        out = Slab(list(zip(self.k, self.v)), max(rows, self.n), left + width + right, left + width)
        out.n, out.start, out.row_lengths = self.n, left, self.row_lengths
        for dst, src in zip(out.k + out.v, self.k + self.v):
            dst[: self.n, :, left : left + width] = src[: self.n, :, self.start : self.end]
        out.valid[: self.n, left : left + width] = self.valid[: self.n, self.start : self.end]
        out.length[: self.n] = self.length[: self.n]
        return out

    def slide(self, start: int) -> None:
        """Move the window to begin at column `start`, in these buffers: no new memory, which
        a fresh slab's would be (each page faulted in; tens of ms on the CPU host)."""
        width, n = self.end - self.start, self.n
        src, dst = slice(self.start, self.end), slice(start, start + width)
        overlap = abs(start - self.start) < width  # then the window is read before it is written
        for buf in self.k + self.v:  # [rows, kv_heads, columns, head_dim]
            window = buf[:n, :, src]
            buf[:n, :, dst] = window.clone() if overlap else window
        window = self.valid[:n, src]  # [rows, columns]
        self.valid[:n, dst] = window.clone() if overlap else window
        self.start, self.end = start, start + width

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.k, *self.v])


class SlabLayer(DynamicLayer):
    """One layer of the batch's cache as HF's attention sees it: the occupied window of the
    slab, and an update that writes the step's column in place (the stock layer would
    concatenate, i.e. copy the whole cache, every step)."""

    def __init__(self, slab: Slab, index: int):
        super().__init__()
        self.slab, self.index = slab, index
        self.dtype, self.device, self.is_initialized = slab.dtype, slab.device, True
        self.keys, self.values = slab.view(index)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        s, i = self.slab, self.index
        assert key_states.shape[-2] == 1, (
            "a decode step feeds one token a row (BatchedKV.absorb adds one column)"
        )
        s.k[i][: s.n, :, s.end : s.end + 1] = key_states
        s.v[i][: s.n, :, s.end : s.end + 1] = value_states
        return s.k[i][: s.n, :, s.start : s.end + 1], s.v[i][: s.n, :, s.start : s.end + 1]

    def get_seq_length(self) -> int:
        return self.slab.end - self.slab.start


def bytes_per_token(text_config, dtype_bytes: int) -> int:
    """KV bytes one token takes in every layer: layers x (key + value) x kv heads x head dim x
    dtype size, from the language model's config (what `pack` gives per token)."""
    head_dim = (
        getattr(text_config, "head_dim", None)
        or text_config.hidden_size // text_config.num_attention_heads
    )
    kv_heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
    return text_config.num_hidden_layers * 2 * kv_heads * head_dim * dtype_bytes


def packed_bytes_per_token(packed: torch.Tensor) -> int:
    """The same figure read off a packed cache [layers, 2, kv_heads, tokens, head_dim]."""
    return packed.numel() * packed.element_size() // max(packed.shape[-2], 1)


def sequence_bytes(
    per_token: int, num_prompt_tokens: int, max_tokens: int, max_model_len: int
) -> int:
    """The most KV a sequence can come to hold: its prompt plus every token it may generate."""
    return per_token * min(num_prompt_tokens + max_tokens, max_model_len)


def pack(cache: DynamicCache) -> torch.Tensor:
    """One request's cache (batch 1) as a single contiguous tensor."""
    if isinstance(cache, PromptKV):
        return cache.packed()
    layers = [torch.stack((layer.keys[0], layer.values[0])) for layer in cache.layers]
    return torch.stack(layers).contiguous()


def unpack(packed: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (key, value), each [1, kv_heads, tokens, head_dim]."""
    return [(layer[0].unsqueeze(0), layer[1].unsqueeze(0)) for layer in packed]


class BatchedKV:
    """The decode batch's cache: rows are requests, columns are token slots (left-padded),
    in a `Slab` that rows join and leave in place. Row i belongs to the caller's i-th
    sequence; `remove` moves the last rows into the holes (the caller reorders its sequences
    the same way). A step reads the slab's mask and lengths as views and grows them in
    place: no per-step copy, no device read. Its tensors are inference tensors: a decode
    step runs in inference mode, and so does every method that changes them in place."""

    def __init__(
        self,
        spare_slots: int = SPARE_SLOTS,
        keep_when_empty: bool = False,
        max_kept_bytes: int | None = None,
        max_columns: int | None = None,
    ) -> None:
        self._slab: Slab | None = None
        self.spare_slots = spare_slots  # columns the slab grows by at least
        self.max_columns = max_columns  # a row's longest window (max_model_len): growth stops there
        # An empty batch keeps its buffers, so the next burst reuses them rather than faulting
        # new ones in (and step_graphs.py's graphs captured on them stay valid); unless they
        # are bigger than `max_kept_bytes` (the worker's KV budget), which a long prompt's
        # window across every row can make them.
        self.keep_when_empty, self.max_kept_bytes = keep_when_empty, max_kept_bytes
        self.num_regrowths = self.num_slides = 0

    @property
    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self._slab.views() if self._slab is not None else []

    @property
    def mask(self) -> torch.Tensor:
        """[rows, slots] 1 where a row holds a token, 0 for its left padding."""
        s = self._slab
        if s is None:
            return torch.zeros(0, 0, dtype=torch.long)
        return s.valid[: s.n, s.start : s.end]

    @property
    def num_rows(self) -> int:
        return self._slab.n if self._slab is not None else 0

    @property
    def nbytes(self) -> int:
        """Bytes of K and V buffers held, rows and columns to spare included."""
        return self._slab.nbytes if self._slab is not None else 0

    @property
    def num_slots(self) -> int:
        return self._slab.end - self._slab.start if self._slab is not None else 0

    @torch.inference_mode()
    def join(self, packed: torch.Tensor) -> None:
        """Append one request's cache as a new last row, right-aligned with the others."""
        new, length = unpack(packed), packed.shape[-2]
        if self._slab is None:
            columns = length + self._spare_after(0, length, self.spare_slots)
            self._slab = Slab(new, rows=1, columns=columns, end=length)
        self._make_room(rows=self.num_rows + 1, before=length)
        s = self._slab
        start = min(s.start, s.end - length)
        for buf, (k, v) in zip(zip(s.k, s.v), new):
            for dst, src in zip(buf, (k, v)):
                dst[: s.n, :, start : s.start] = 0  # columns the other rows now pad
                dst[s.n, :, start : s.end - length] = 0
                dst[s.n, :, s.end - length : s.end] = src[0]
        s.valid[: s.n, start : s.start] = 0  # old data of rows gone
        s.valid[s.n, start : s.end] = 0
        s.valid[s.n, s.end - length : s.end] = 1
        s.length[s.n] = length
        s.row_lengths = [*s.row_lengths, length]
        s.n, s.start = s.n + 1, start

    def _make_room(self, rows: int, before: int = 0, after: int = 0) -> None:
        """Make room for `rows` rows, `before` columns before `end` and `after` after it: the
        window slides within the buffers when that frees `spare_slots` columns or more after
        it (any, once they are `max_columns` wide); else the buffers grow (rows doubling;
        columns by a quarter of the window at least, up to `max_columns`), so a long batch
        seldom copies and, once grown, allocates nothing."""
        s = self._slab
        if s is None:
            return
        if rows <= s.rows and before <= s.end and s.end + after <= s.columns:
            return
        width = s.end - s.start
        left = max(before - width, 0)  # columns needed before the window
        room = s.columns - (left + width + after)  # free after the window once it slid
        at_most = self.max_columns is not None and s.columns >= self.max_columns
        if rows <= s.rows and room >= 0 and (room >= self.spare_slots or at_most):
            s.slide(left)
            self.num_slides += 1
            return
        new_rows = s.rows if rows <= s.rows else max(rows, 2 * s.rows)
        right = self._spare_after(left, width, after + max(self.spare_slots, width // 4), after)
        self._slab = s.regrown(new_rows, left, right)
        self.num_regrowths += 1

    def _spare_after(self, left: int, width: int, wanted: int, needed: int = 0) -> int:
        """Columns after a window of `width` behind `left`: `wanted`, but none past
        `max_columns` (no window outgrows it), and never fewer than `needed`."""
        if self.max_columns is None:
            return wanted
        return max(needed, min(wanted, self.max_columns - left - width))

    @torch.inference_mode()
    def remove(self, rows: list[int]) -> list[int]:
        """Drop these rows, moving the last rows into their places; returns the old row
        index of each row that remains, in its new order (the caller's new order)."""
        order = list(range(self.num_rows))
        if self._slab is None:
            return order
        for row in sorted(set(rows), reverse=True):
            last = len(order) - 1
            if row != last:
                self._move(last, row)
                order[row] = order[last]
            order.pop()
        s = self._slab
        s.n, s.row_lengths = len(order), [s.row_lengths[i] for i in order]
        self._trim()
        return order

    def _move(self, src: int, dst: int) -> None:
        s = self._slab
        for buf in s.k + s.v:
            buf[dst, :, s.start : s.end] = buf[src, :, s.start : s.end]
        s.valid[dst, s.start : s.end] = s.valid[src, s.start : s.end]
        s.length[dst] = s.length[src]

    def _trim(self) -> None:
        """Drop leading columns no row uses (known on the host: the longest row's length)."""
        s = self._slab
        if s.n == 0 and not self._keeps(s):
            self._slab = None
            return
        s.start = max(s.start, s.end - max(s.row_lengths, default=0))

    def _keeps(self, slab: Slab) -> bool:
        limit = self.max_kept_bytes
        return self.keep_when_empty and (limit is None or slab.nbytes <= limit)

    @torch.inference_mode()
    def as_cache(self) -> DynamicCache:
        """The batch's cache for one step: its layers write the step's column in place."""
        s = self._open_column()
        cache = DynamicCache()
        cache.layers = [SlabLayer(s, i) for i in range(len(s.k))]
        return cache

    @torch.inference_mode()
    def absorb(self) -> None:
        """Take in the column a step (on `as_cache()` or `open_fixed_step`) wrote to every row."""
        s = self._slab
        s.end += 1
        s.length[: s.n] += 1
        s.row_lengths = [n + 1 for n in s.row_lengths]

    @torch.inference_mode()
    def step_mask(self) -> torch.Tensor:
        """Attention mask for a step: existing slots plus the token being fed."""
        s = self._open_column()
        return s.valid[: s.n, s.start : s.end + 1]

    @torch.inference_mode()
    def open_fixed_step(self, rows: int) -> Slab:
        """The slab for a step over fixed buffers (step_graphs.py) of `rows` rows, at least
        the batch's: room for them and for the step's column, marked valid as `as_cache` does."""
        return self._open_column(rows)

    def _open_column(self, rows: int = 0) -> Slab:
        """Room for the step's column (and `rows` rows), marked valid for every row
        (idempotent)."""
        self._make_room(rows=max(rows, self.num_rows), after=1)
        s = self._slab
        s.valid[: s.n, s.end] = 1
        return s

    def lengths(self) -> torch.Tensor:
        s = self._slab
        return s.length[: s.n] if s is not None else torch.zeros(0, dtype=torch.long)


def cache_of(packed: torch.Tensor) -> DynamicCache:
    """A batch-1 cache holding `packed` (e.g. a cached prefix a prefill continues from)."""
    cache = DynamicCache()
    for i, (k, v) in enumerate(unpack(packed)):
        cache.update(k, v, i)
    return cache
