"""Prefix caching for prefill workers: block hashes and the refcounted, LRU block pool.
Plain Python, no torch: a block's KV is an opaque payload with a size in bytes.

A prompt is cut into fixed-size blocks; block i's hash covers its tokens, block i-1's
hash (so equal hashes mean equal prefixes) and, for a block that overlaps a media item's
placeholder span, (the item's identifier, where the item starts relative to the block):
placeholder token ids are the same for every picture, the identifier is what tells two
pictures apart. The router computes the same hashes (cluster/routing.py) to find the
worker holding the longest prefix.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from blake3 import blake3

_ROOT = b"epd-prefix-v1"


@dataclass(frozen=True)
class MediaKey:
    """A media item's placeholder span and its content identifier (None: unknown, and the
    blocks from this span on are never cached)."""

    offset: int
    length: int
    identifier: str | None


def block_hashes(
    token_ids: tuple[int, ...], block_size: int, media: tuple[MediaKey, ...] = ()
) -> list[str]:
    """Hashes of the prompt's full blocks, in order; stops before the first block that
    overlaps a media item without an identifier."""
    hashes: list[str] = []
    parent = _ROOT
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        end = start + block_size
        extra = [m for m in media if m.offset < end and m.offset + m.length > start]
        if any(m.identifier is None for m in extra):
            break
        hasher = blake3(parent)
        hasher.update(b"".join(t.to_bytes(4, "little", signed=True) for t in token_ids[start:end]))
        for m in extra:  # the item's start relative to the block pins which embedding sits where
            hasher.update(
                b"|" + m.identifier.encode("ascii") + b"@" + str(m.offset - start).encode("ascii")
            )
        digest = hasher.hexdigest()
        hashes.append(digest)
        parent = digest.encode("ascii")
    return hashes


@dataclass
class Block:
    block_hash: str
    payload: Any
    num_bytes: int
    refs: int = 0


@dataclass
class PoolStats:
    hit_blocks: int = 0
    miss_blocks: int = 0
    evictions: int = 0


@dataclass
class BlockPool:
    """Blocks by hash. Referenced blocks (a prefill in flight reads them) are never evicted;
    unreferenced ones stay, least recently used first out, while they fit `capacity_bytes`."""

    capacity_bytes: int
    blocks: dict[str, Block] = field(default_factory=dict)
    free_lru: OrderedDict[str, None] = field(default_factory=OrderedDict)  # refs == 0, oldest first
    num_bytes: int = 0
    stats: PoolStats = field(default_factory=PoolStats)
    version: int = 0  # bumped when the set of held blocks changes

    def match(self, hashes: list[str]) -> int:
        """How many leading blocks of `hashes` are held."""
        n = 0
        while n < len(hashes) and hashes[n] in self.blocks:
            n += 1
        return n

    def acquire(self, hashes: list[str]) -> list[Any]:
        """Reference the leading held blocks (hits; the rest count as misses); their payloads."""
        n = self.match(hashes)
        self.stats.hit_blocks += n
        self.stats.miss_blocks += len(hashes) - n
        payloads = []
        for h in hashes[:n]:
            block = self.blocks[h]
            block.refs += 1
            self.free_lru.pop(h, None)
            payloads.append(block.payload)
        return payloads

    def release(self, hashes: list[str]) -> None:
        for h in hashes:
            self.blocks[h].refs -= 1
        self.touch(hashes)

    def touch(self, hashes: list[str]) -> None:
        """Mark unreferenced blocks of one prompt most recently used, its first block last:
        a parent then always outlives its children (a child without its parent is unreachable)."""
        for h in reversed(hashes):
            if h in self.free_lru:
                self.free_lru.move_to_end(h)
            elif h in self.blocks and self.blocks[h].refs == 0:
                self.free_lru[h] = None

    def insert(self, block_hash: str, payload: Any, num_bytes: int) -> bool:
        """Keep a new unreferenced block if room can be made; False if it cannot (or is held)."""
        if block_hash in self.blocks:
            return False
        while self.num_bytes + num_bytes > self.capacity_bytes and self.free_lru:
            self._evict(next(iter(self.free_lru)))
        if self.num_bytes + num_bytes > self.capacity_bytes:
            return False
        self.blocks[block_hash] = Block(block_hash, payload, num_bytes)
        self.free_lru[block_hash] = None
        self.num_bytes += num_bytes
        self.version += 1
        return True

    def _evict(self, block_hash: str) -> None:
        block = self.blocks.pop(block_hash)
        del self.free_lru[block_hash]
        self.num_bytes -= block.num_bytes
        self.stats.evictions += 1
        self.version += 1

    def held(self) -> frozenset[str]:
        return frozenset(self.blocks)

    def num_referenced(self) -> int:
        return sum(1 for b in self.blocks.values() if b.refs)

    def check_integrity(self) -> None:
        """Invariants: sizes add up, within capacity, free list == unreferenced, no refs < 0."""
        assert self.num_bytes == sum(b.num_bytes for b in self.blocks.values()), (
            "byte count drifted"
        )
        assert self.num_bytes <= self.capacity_bytes, "over capacity"
        assert all(b.refs >= 0 for b in self.blocks.values()), "negative refcount"
        assert set(self.free_lru) == {h for h, b in self.blocks.items() if b.refs == 0}, (
            "free list != unreferenced blocks"
        )
        assert all(h == b.block_hash for h, b in self.blocks.items()), (
            "block filed under another hash"
        )
