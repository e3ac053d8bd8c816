"""Block hashing and the refcounted LRU block pool, in plain Python (no torch)."""

from __future__ import annotations

import random

import pytest

from actors.engine.prefix_cache import BlockPool, MediaKey, block_hashes


def test_hashes_chain_full_blocks_only():
    h = block_hashes(tuple(range(10)), 4)
    assert len(h) == 2 and len(set(h)) == 2
    assert block_hashes(tuple(range(8)) + (99, 98), 4) == h, "a partial last block is not hashed"
    assert block_hashes((0, 1, 2, 3, 9, 5, 6, 7), 4)[1] != h[1], "block 2 depends on its own tokens"
    assert block_hashes((1, 1, 2, 3, 4, 5, 6, 7), 4)[1] != h[1], "block 2 depends on its parent"


def test_media_identifier_and_offset_enter_only_the_blocks_they_overlap():
    tokens = tuple([5] * 16)
    plain = block_hashes(tokens, 4)
    a = block_hashes(tokens, 4, (MediaKey(5, 6, "img-a"),))
    b = block_hashes(tokens, 4, (MediaKey(5, 6, "img-b"),))
    shifted = block_hashes(tokens, 4, (MediaKey(6, 6, "img-a"),))
    assert a[0] == b[0] == plain[0], "the block before the item is plain text"
    assert a[1] != b[1] and a[2] != b[2], "different images, different blocks"
    assert a[3] != b[3], "after the item the chain still differs (parent hash)"
    assert a[1] != shifted[1], "where the item starts is part of the key"


def test_unknown_media_stops_hashing():
    assert len(block_hashes(tuple(range(16)), 4, (MediaKey(6, 2, None),))) == 1


def pool_with(capacity_blocks: int, hashes: list[str]) -> BlockPool:
    pool = BlockPool(capacity_blocks * 10)
    for h in hashes:
        pool.insert(h, h.upper(), 10)
    return pool


def test_referenced_blocks_survive_eviction_and_lru_keeps_parents():
    pool = pool_with(3, ["a", "b", "c"])
    pool.touch(["a", "b", "c"])  # one prompt's chain: the parent must outlive its children
    assert pool.acquire(["a", "b", "x"]) == ["A", "B"]
    assert (pool.stats.hit_blocks, pool.stats.miss_blocks) == (2, 1)
    assert pool.insert("d", "D", 10)  # evicts c, the only unreferenced block
    assert pool.held() == {"a", "b", "d"} and pool.stats.evictions == 1
    assert not pool.insert("e", "E", 30), "nothing unreferenced is big enough to make room"
    pool.check_integrity()
    pool.release(["a", "b"])
    assert pool.num_referenced() == 0
    pool.insert("f", "F", 10)  # d is now the least recent: a and b were just released
    assert pool.held() == {"a", "b", "f"}
    pool.check_integrity()


def test_random_operations_keep_integrity():
    rnd, pool, held = random.Random(0), BlockPool(100), []
    for _ in range(2000):
        op = rnd.random()
        if op < 0.5:
            pool.insert(str(rnd.randrange(40)), None, rnd.randint(1, 30))
        elif op < 0.75:
            chain = [str(rnd.randrange(40)) for _ in range(3)]
            n = pool.match(chain)
            pool.acquire(chain)
            held.append(chain[:n])
        elif held:
            pool.release(held.pop(rnd.randrange(len(held))))
        pool.check_integrity()
    for chain in held:
        pool.release(chain)
    pool.check_integrity()
    assert pool.num_referenced() == 0


def test_integrity_check_catches_a_drift():
    pool = pool_with(2, ["a"])
    pool.num_bytes += 1
    with pytest.raises(AssertionError, match="byte count"):
        pool.check_integrity()


def test_router_profile_carries_the_hashes_the_workers_file_blocks_under():
    import numpy as np

    from actors.types import MediaItem, PlaceholderRange
    from cluster.prompt_plan import PromptPlan
    from cluster.routing import LiveRouting
    from router.types import Modality

    item = MediaItem(Modality.IMAGE, "img-a", data=np.zeros((2, 2, 3), np.uint8))
    plan = PromptPlan(tuple(range(40)), (PlaceholderRange(5, 10),), (10,), (item,))
    profile = LiveRouting(None, None, 4, prefix_block_tokens=8).profile(plan, plan.token_ids, 16)
    assert profile.prefix_hashes == tuple(
        block_hashes(plan.token_ids, 8, (MediaKey(5, 10, "img-a"),))
    )
    assert profile.block_size == 8 and profile.num_prompt_tokens == 40
    assert LiveRouting(None, None, 4).profile(plan, plan.token_ids, 16).prefix_hashes == (), (
        "no prefix cache: no hashes"
    )
