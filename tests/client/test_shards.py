"""The split of a batch over replay shards and the shard addresses of a replay target (no server)."""

from __future__ import annotations

import random

import pytest

from temper.client.shards import ShardedReplay, shard_addresses, split_counts


def test_shard_addresses():
    assert shard_addresses("ipv4:127.0.0.1:1,127.0.0.1:2") == ["127.0.0.1:1", "127.0.0.1:2"]
    assert shard_addresses("a:1, b:2") == ["a:1", "b:2"]
    assert shard_addresses("dns:///replay:50054") == ["dns:///replay:50054"]
    assert shard_addresses("127.0.0.1:5") == ["127.0.0.1:5"]


def test_proportional_split_by_largest_remainder():
    assert split_counts(10, [3, 7], [3, 7], None) == [3, 7]
    assert split_counts(5, [1, 1, 2], [9, 9, 9], None) == [1, 1, 3]   # shares 1.25, 1.25, 2.5: the .5 rounds up
    assert split_counts(8, [1, 1], [2, 100], None) == [2, 6]        # a shard gives no more than it holds
    assert split_counts(8, [1, 1], [2, 5], None) is None            # together they hold 7 < 8


def test_random_split_follows_the_weights_and_the_caps():
    rng = random.Random(0)
    totals = [0, 0]
    for _ in range(500):
        c = split_counts(10, [1.0, 3.0], [float("inf"), float("inf")], rng)
        totals = [t + x for t, x in zip(totals, c)]
    assert totals[1] / sum(totals) == pytest.approx(0.75, abs=0.02)
    assert split_counts(4, [1.0, 100.0], [3, 1], rng) == [3, 1]
    assert sum(split_counts(4, [0.0, 0.0], [9, 9], rng)) == 4        # every weight 0: uniform


def test_one_shard_is_refused():
    with pytest.raises(ValueError, match="shards"):
        ShardedReplay([object()])
