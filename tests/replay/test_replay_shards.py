"""Replay shards: real replay processes, each owning partitions of `scored` on a real broker, and the reader
that samples them as one table (temper.client.shards).

- Ingest: 4 partitions, 2 shards (``--shard 0/2``, ``1/2``): each shard stores exactly the groups of its
  partitions; together every group once, also across a kill -9 and restart of a shard. A shard count that
  does not divide the partitions stops the shard at start-up naming ``shard``.
- Prioritized table over 2 shards: the importance weights the reader returns are one table's
  (``(w_min / w)^β`` over every shard's groups, checked against a third replay holding all of them), and
  2,000 draws follow the groups' priorities across shards.
- Leases: a batch drawn across shards is leased on each; requeue gives every group back, ack settles all.
"""

from __future__ import annotations

import collections

import pytest

from temper.client.sdk import ReplayClient
from temper.client.shards import ShardedReplay
from temper.runtime import kafka
from tests.builders import scored_group
from tests.conftest import spawn_service, wait_until

pytestmark = pytest.mark.slow

PRIORITIZED = """
[replay]
ingest_tables = []

[replay.tables.p]
sampler = "prioritized"
remover = "fifo"
max_times_sampled = 0
priority_exponent = 1.0
importance_sampling_exponent = 0.5
"""


def test_shards_ingest_their_own_partitions_and_the_reader_gets_each_group_once(tmp_path, broker):
    kafka.ensure_topics(broker, partitions=4)
    shards = [spawn_service("replay", tmp_path / f"s{i}", "--kafka-bootstrap", broker, "--shard", f"{i}/2")
              for i in range(2)]
    try:
        ids = [f"g{i:02d}" for i in range(40)]
        _publish(broker, ids)
        clients = [s.client(ReplayClient) for s in shards]
        wait_until(lambda: sum(c.stats().size for c in clients) == 40, 60, what="40 groups in the two shards")
        sizes = [c.stats().size for c in clients]
        assert all(n > 0 for n in sizes), sizes          # both shards own partitions that got groups
        # kill -9 of shard 1, 20 more groups, shard 1 back on its data: it takes up its own partitions where
        # its committed offsets left them -- nothing acknowledged lost, nothing stored twice, shard 0 untouched
        shards[1].kill()
        more = [f"h{i:02d}" for i in range(20)]
        _publish(broker, more)
        shards[1] = spawn_service("replay", tmp_path / "s1", "--kafka-bootstrap", broker, "--shard", "1/2")  # same data
        clients[1] = shards[1].client(ReplayClient)
        wait_until(lambda: sum(c.stats().size for c in clients) == 60, 60, what="60 groups in the two shards")
        assert sum(c.stats().duplicates for c in clients) == 0
        reader = ShardedReplay(clients)
        batch = reader.sample_batch(60, timeout_ms=10_000, lease_ms=60_000)
        got = [g.group_id for g in batch.groups]
        assert sorted(got) == ids + more                  # each group once, from whichever shard holds it
        assert batch.lease_id.count("=") == 2             # one lease per shard
        assert reader.ack_sample(batch.lease_id).groups == 60
        assert sum(c.stats().size for c in clients) == 0
        # a batch larger than the shards hold: the reader waits, then DEADLINE_EXCEEDED as one replay would
        import grpc
        with pytest.raises(grpc.RpcError) as e:
            reader.sample_batch(1, timeout_ms=300)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        for s in shards:
            s.stop()

    # 3 shards cannot own equal shares of 4 partitions: refused at start-up, the field named
    with pytest.raises(RuntimeError, match="shard: 0/3: 3 shards do not divide the 4 partitions"):
        spawn_service("replay", tmp_path / "bad", "--kafka-bootstrap", broker, "--shard", "0/3", timeout=60)


def test_prioritized_sampling_across_shards_is_one_tables(tmp_path):
    config = tmp_path / "replay.toml"
    config.write_text(PRIORITIZED)
    procs = [spawn_service("replay", tmp_path / name, "--config", str(config)) for name in ("a", "b", "whole")]
    try:
        a, b, whole = (p.client(ReplayClient) for p in procs)
        priorities = {f"g{i}": float(i + 1) for i in range(8)}   # 1 .. 8; the smallest (g0) in shard a
        for gid, p in priorities.items():
            shard = a if int(gid[1:]) % 2 == 0 else b
            for c in (shard, whole):
                c.insert([scored_group(gid)], table="p", priorities=[p])
        reader = ShardedReplay([a, b], seed=0)
        stats = reader.stats("p")
        assert [s.total_weight for s in stats] == [1 + 3 + 5 + 7, 2 + 4 + 6 + 8] and stats[1].min_weight == 2
        one = {i.group_id: i.importance_weight for i in whole.sample_batch(200, "p").info}
        counts = collections.Counter()
        for _ in range(20):
            r = reader.sample_batch(100, "p")
            for info in r.info:
                counts[info.group_id] += 1
                assert info.importance_weight == pytest.approx(one[info.group_id])   # (1 / p)^0.5
                assert info.table_size == 8
        total = sum(priorities.values())
        for gid, p in priorities.items():   # 2,000 draws: each group's share within 4 standard errors
            expected = p / total
            assert abs(counts[gid] / 2000 - expected) < 4 * (expected * (1 - expected) / 2000) ** 0.5, (gid, counts)
        update = reader.update_priorities({"g1": 10.0, "g2": 10.0, "nope": 1.0}, "p")
        assert update.updated == 2 and list(update.unknown_group_ids) == ["nope"]
    finally:
        for p in procs:
            p.stop()


def test_a_leased_batch_across_shards_goes_back_whole_on_requeue(tmp_path):
    procs = [spawn_service("replay", tmp_path / n, "--config", str(_fifo(tmp_path))) for n in ("a", "b")]
    try:
        a, b = (p.client(ReplayClient) for p in procs)
        a.insert([scored_group(f"a{i}") for i in range(3)])
        b.insert([scored_group(f"b{i}") for i in range(5)])
        reader = ShardedReplay([a, b])
        r = reader.sample_batch(8, timeout_ms=5_000, lease_ms=60_000)
        assert sorted(g.group_id for g in r.groups) == [f"a{i}" for i in range(3)] + [f"b{i}" for i in range(5)]
        assert (a.stats().leased, b.stats().leased) == (3, 5)
        assert reader.ack_sample(r.lease_id, "requeue").groups == 8
        assert (a.stats().size, b.stats().size) == (3, 5)
        with pytest.raises(ValueError, match="lease_id"):
            reader.ack_sample("7=x")
    finally:
        for p in procs:
            p.stop()


def _publish(broker: str, group_ids: list[str]) -> None:
    """Each group id as a scored group on `scored`, keyed by its id (as reward publishes them)."""
    producer = kafka.ProtoProducer(broker, client_id="test")
    for gid in group_ids:
        producer.send(kafka.SCORED, gid, scored_group(gid))
    producer.flush()
    producer.close()


def _fifo(tmp_path):
    path = tmp_path / "fifo.toml"
    path.write_text("[replay]\ningest_tables = []\n")
    return path
