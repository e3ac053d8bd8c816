"""The router's index of which workers hold which keys (cached media items, prefix blocks)."""

from __future__ import annotations

from router.holder_index import HolderIndex, bits


def test_bits_lists_set_bits_lowest_first():
    assert list(bits(0b101001)) == [0, 3, 5] and list(bits(0)) == []


def test_published_sets_are_trusted_while_fresh_then_dropped():
    index = HolderIndex(num_workers=3, ttl_s=5.0)
    index.publish(0, frozenset({"a", "b"}), now_s=0.0)
    index.publish(2, frozenset({"b"}), now_s=3.0)
    index.check_integrity()
    assert index.holders("b") == 0b101 and index.holders("a") == 0b001
    index.refresh(
        now_s=6.0
    )  # worker 0's set is older than ttl: no longer trusted, worker 2's still is
    assert index.holders("b") == 0b100 and index.holders("a") == 0
    index.publish(0, frozenset({"c"}), now_s=7.0)  # a new set replaces the old one in the index
    index.check_integrity()
    assert index.holders("c") == 0b001 and index.holders("a") == 0


def test_own_dispatches_count_until_two_generations_pass():
    index = HolderIndex(num_workers=2, ttl_s=4.0)
    index.refresh(now_s=0.0)
    index.add(1, ("x", "y"))
    assert index.holders("x") == 0b10
    index.refresh(now_s=2.0)  # one generation older: still assumed held
    assert index.holders("y") == 0b10
    index.refresh(now_s=4.0)  # two: forgotten
    assert index.holders("x") == 0


def test_longest_runs_counts_leading_keys_held():
    index = HolderIndex(num_workers=3, ttl_s=10.0)
    index.publish(0, frozenset({"h1", "h2", "h3"}), now_s=0.0)
    index.publish(1, frozenset({"h1"}), now_s=0.0)
    index.publish(2, frozenset({"h2", "h3"}), now_s=0.0)  # not the first block: no run
    assert index.longest_runs(("h1", "h2", "h3", "h4"), among=0b111) == {0: 3, 1: 1}
    assert index.longest_runs(("h1", "h2"), among=0b010) == {1: 1}
