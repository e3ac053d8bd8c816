"""Unit tests for actors.engine.kv: packing one request's cache and the left-padded decode batch."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
from transformers.cache_utils import DynamicCache  # noqa: E402

from actors.engine import kv  # noqa: E402

LAYERS, HEADS, DIM = 3, 2, 4


def make_cache(num_tokens: int, seed: int) -> DynamicCache:
    """A batch-1 DynamicCache with distinct random values per layer/key/value."""
    gen = torch.Generator().manual_seed(seed)
    cache = DynamicCache()
    for layer in range(LAYERS):
        k = torch.randn(1, HEADS, num_tokens, DIM, generator=gen)
        v = torch.randn(1, HEADS, num_tokens, DIM, generator=gen)
        cache.update(k, v, layer)
    return cache


def packed_of(num_tokens: int, seed: int) -> torch.Tensor:
    return kv.pack(make_cache(num_tokens, seed))


def check_integrity(batch: kv.BatchedKV, expected: list[torch.Tensor] | None = None) -> None:
    """Invariants of a BatchedKV; with `expected` (one packed cache per row, in row order,
    grown by any absorbed slots) also that every row's valid data is right-aligned and intact."""
    rows, slots = batch.num_rows, batch.num_slots
    assert batch.mask.shape == (rows, slots)
    assert batch.mask.dtype == torch.long
    assert len(batch.layers) == LAYERS if rows else len(batch.layers) in (0, LAYERS)
    for k, v in batch.layers:
        assert k.shape == (rows, HEADS, slots, DIM)
        assert v.shape == (rows, HEADS, slots, DIM)
    lengths = batch.lengths()
    assert torch.equal(lengths, batch.mask.sum(1))
    for r in range(rows):
        n = int(lengths[r])
        assert n >= 1, "a row with no valid slot"
        want = torch.cat(
            (torch.zeros(slots - n, dtype=torch.long), torch.ones(n, dtype=torch.long))
        )
        assert torch.equal(batch.mask[r], want), (
            f"row {r} mask is not left-padded: {batch.mask[r].tolist()}"
        )
        for k, v in batch.layers:  # padding slots hold zeros
            assert not k[r, :, : slots - n].any() and not v[r, :, : slots - n].any()
    if rows:
        assert batch.mask[:, 0].any(), "a leading all-padding column was kept"
    if expected is not None:
        assert len(expected) == rows
        for r, packed in enumerate(expected):
            n = packed.shape[3]
            assert int(lengths[r]) == n
            for layer, (k, v) in enumerate(batch.layers):
                assert torch.equal(k[r, :, slots - n :], packed[layer, 0])
                assert torch.equal(v[r, :, slots - n :], packed[layer, 1])


def test_pack_layout_and_unpack_round_trip():
    cache = make_cache(5, seed=1)
    packed = kv.pack(cache)
    assert packed.shape == (LAYERS, 2, HEADS, 5, DIM)
    assert packed.is_contiguous()
    layers = kv.unpack(packed)
    assert len(layers) == LAYERS
    for (k, v), layer in zip(layers, cache.layers):
        assert k.shape == (1, HEADS, 5, DIM)
        assert torch.equal(k, layer.keys) and torch.equal(v, layer.values)
    # and back again
    again = DynamicCache(ddp_cache_data=layers)
    assert torch.equal(kv.pack(again), packed)


def test_join_single_row():
    batch = kv.BatchedKV()
    assert batch.num_rows == 0 and batch.num_slots == 0
    p = packed_of(4, 0)
    batch.join(p)
    assert batch.mask.tolist() == [[1, 1, 1, 1]]
    check_integrity(batch, [p])


def test_join_different_lengths_right_aligns_rows():
    batch = kv.BatchedKV()
    p3, p6, p2 = packed_of(3, 1), packed_of(6, 2), packed_of(2, 3)
    batch.join(p3)
    batch.join(p6)  # longer: the existing row is re-padded on the left
    batch.join(p2)  # shorter: the new row is padded
    assert batch.mask.tolist() == [
        [0, 0, 0, 1, 1, 1],
        [1, 1, 1, 1, 1, 1],
        [0, 0, 0, 0, 1, 1],
    ]
    assert batch.lengths().tolist() == [3, 6, 2]
    check_integrity(batch, [p3, p6, p2])


def test_remove_trims_leading_padding_down_to_an_empty_batch():
    batch = kv.BatchedKV()
    ps = [packed_of(n, i) for i, n in enumerate((2, 7, 4, 3))]
    for p in ps:
        batch.join(p)
    assert batch.num_slots == 7
    assert batch.remove([1]) == [0, 3, 2], (
        "the only 7-long row leaves; the last row takes its place"
    )
    assert batch.num_slots == 4, "columns no remaining row uses must go"
    assert batch.mask.tolist() == [[0, 0, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1]]
    check_integrity(batch, [ps[0], ps[3], ps[2]])
    assert batch.remove([1, 2]) == [0]
    assert batch.num_slots == 2
    check_integrity(batch, [ps[0]])
    assert batch.remove([0]) == []
    assert batch.num_rows == 0 and batch.num_slots == 0
    check_integrity(batch)
    # an emptied batch takes new rows again
    batch.join(ps[1])
    check_integrity(batch, [ps[1]])


@torch.inference_mode()  # as LMRunner.decode_step
def _step(batch: kv.BatchedKV, seed: int) -> list[torch.Tensor]:
    """What a decode step does to the cache: one new slot per row, then absorb."""
    gen = torch.Generator().manual_seed(seed)
    cache = batch.as_cache()
    new = []
    for layer in range(LAYERS):
        k = torch.randn(batch.num_rows, HEADS, 1, DIM, generator=gen)
        v = torch.randn(batch.num_rows, HEADS, 1, DIM, generator=gen)
        cache.update(k, v, layer)
        new.append((k, v))
    batch.absorb()
    # per-row packed [layers, 2, heads, 1, dim] for the new slot
    return [torch.stack([torch.stack((k[r], v[r])) for k, v in new]) for r in range(batch.num_rows)]


def test_remove_moves_the_last_rows_into_the_holes_and_says_the_new_order():
    batch = kv.BatchedKV()
    ps = [packed_of(n, i) for i, n in enumerate((2, 7, 4, 3, 5))]
    for p in ps:
        batch.join(p)
    slab_k = batch.layers[0][0].untyped_storage().data_ptr()
    assert batch.remove([1, 4]) == [0, 3, 2], "row 4 leaves, row 3 fills the hole of row 1"
    assert batch.num_slots == 4, "the 7-long row is gone: its columns too"
    check_integrity(batch, [ps[0], ps[3], ps[2]])
    assert batch.layers[0][0].untyped_storage().data_ptr() == slab_k, (
        "in place: the buffers were not reallocated"
    )
    assert batch.remove([0, 1, 2]) == [] and batch.num_rows == 0
    check_integrity(batch)


def test_joins_and_steps_reuse_the_buffers_until_they_must_grow():
    batch = kv.BatchedKV()
    batch.join(packed_of(6, 0))
    batch.join(packed_of(3, 1))
    storage = lambda: batch.layers[0][0].untyped_storage().data_ptr()
    first = storage()
    for seed in range(kv.SPARE_SLOTS - 1):
        _step(batch, seed)
    assert storage() == first, "steps write their column in place"
    batch.remove([1])
    batch.join(packed_of(5, 2))  # into the freed row, right-aligned
    assert storage() == first
    batch.join(packed_of(200, 3))  # longer than the window: the buffers grow once
    assert storage() != first
    check_integrity(batch)


def test_step_mask_and_absorb_grow_by_one_slot():
    batch = kv.BatchedKV()
    p2, p5 = packed_of(2, 1), packed_of(5, 2)
    batch.join(p2)
    batch.join(p5)
    step_mask = batch.step_mask()
    assert step_mask.tolist() == [[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]]
    assert batch.num_slots == 5, "step_mask must not change the batch"
    added = _step(batch, seed=9)
    assert batch.num_slots == 6
    assert torch.equal(batch.mask, step_mask)
    assert batch.lengths().tolist() == [3, 6]
    expected = [torch.cat((p, a), dim=3) for p, a in zip((p2, p5), added)]
    check_integrity(batch, expected)


def test_as_cache_shares_the_batch_tensors():
    batch = kv.BatchedKV()
    batch.join(packed_of(3, 0))
    batch.join(packed_of(5, 1))
    cache = batch.as_cache()
    assert cache.get_seq_length() == batch.num_slots
    for (k, v), layer in zip(batch.layers, cache.layers):
        assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)


@pytest.mark.parametrize(
    "seed,make",
    [(seed, kv.BatchedKV) for seed in range(5)]
    + [(seed, lambda: kv.BatchedKV(spare_slots=2, keep_when_empty=True)) for seed in range(5)],
)
def test_random_join_remove_absorb_sequences_keep_invariants(seed, make):
    """Also with few spare columns and a kept slab: windows slide and slabs grow often."""
    rnd = random.Random(seed)
    batch = make()
    rows: list[torch.Tensor] = []  # the expected per-row packed caches
    for op_index in range(60):
        op = rnd.choice(("join", "join", "remove", "absorb", "absorb"))
        if op == "join" or not rows:
            p = packed_of(rnd.randint(1, 9), seed * 1000 + op_index)
            batch.join(p)
            rows.append(p)
        elif op == "remove":
            order = batch.remove(rnd.sample(range(len(rows)), rnd.randint(0, len(rows))))
            rows = [rows[i] for i in order]
        else:
            added = _step(batch, seed * 1000 + op_index)
            rows = [torch.cat((p, a), dim=3) for p, a in zip(rows, added)]
        check_integrity(batch, rows)
        if rows:
            assert batch.num_slots == max(p.shape[3] for p in rows)


def _storage(batch: kv.BatchedKV) -> int:
    return batch._slab.k[0].untyped_storage().data_ptr()


def test_an_emptied_batch_keeps_its_buffers_within_the_budget():
    batch = kv.BatchedKV(keep_when_empty=True)
    batch.join(packed_of(5, 0))
    batch.join(packed_of(3, 1))
    first, regrowths = _storage(batch), batch.num_regrowths
    assert batch.remove([0, 1]) == [] and batch.num_rows == 0
    check_integrity(batch)
    batch.join(packed_of(4, 2))  # the next burst: the same buffers, nothing allocated
    assert _storage(batch) == first and batch.num_regrowths == regrowths
    check_integrity(batch, [packed_of(4, 2)])

    small = kv.BatchedKV(keep_when_empty=True, max_kept_bytes=1)
    small.join(packed_of(5, 0))
    small.remove([0])
    assert small._slab is None, "buffers above the KV budget go when the batch empties"


def test_steps_past_the_spare_columns_slide_the_window_or_grow_geometrically():
    batch = kv.BatchedKV(spare_slots=4, keep_when_empty=True)
    rows = [packed_of(150, 0), packed_of(2, 1)]
    for p in rows:
        batch.join(p)

    def steps(seeds: range) -> None:
        nonlocal rows
        for seed in seeds:
            added = _step(batch, seed)
            rows = [torch.cat((p, a), dim=3) for p, a in zip(rows, added)]

    steps(range(200))
    check_integrity(batch, rows)
    assert batch.num_regrowths <= 6, "columns grow by a quarter of the window, not 4 at a time"
    # the long row leaves: its columns free up on the left, so later steps slide in place
    rows = [rows[i] for i in batch.remove([0])]
    storage, regrowths = _storage(batch), batch.num_regrowths
    for seed in range(200, 600):  # until the window reaches the buffers' end
        steps(range(seed, seed + 1))
        if batch.num_slides:
            break
    check_integrity(batch, rows)
    assert batch.num_slides == 1 and batch.num_regrowths == regrowths
    assert _storage(batch) == storage, "slid within the same buffers"


def test_columns_stop_growing_at_the_longest_window():
    """Past `max_columns` no window can grow (max_model_len): the buffers stop there, and a
    window at that width slides back even when that frees less than `spare_slots`."""
    batch = kv.BatchedKV(spare_slots=64, keep_when_empty=True, max_columns=40)
    rows = [packed_of(30, 0), packed_of(3, 1)]
    batch.join(rows[0])
    assert batch._slab.columns == 40, "the first row's buffers are no wider either"
    batch.join(rows[1])
    for seed in range(9):  # the long row reaches 39 tokens
        added = _step(batch, seed)
        rows = [torch.cat((p, a), dim=3) for p, a in zip(rows, added)]
    assert batch._slab.columns == 40, batch._slab.columns
    rows = [rows[i] for i in batch.remove([0])]  # its 27 leading columns free up
    slides = batch.num_slides
    for seed in range(9, 30):
        added = _step(batch, seed)
        rows = [torch.cat((p, a), dim=3) for p, a in zip(rows, added)]
    check_integrity(batch, rows)
    assert batch._slab.columns == 40 and batch.num_slides > slides
