"""The durable store: groups whole, policy lag, priorities, checkpoint/restore, reopening, schema
migration, and bad input that harms nothing stored."""

import math
import sqlite3
import threading

import pytest

from temper.replay.payloads import PayloadLog
from temper.replay.store import ReplayStore
from temper.replay.tables import TableConfig
from temper.runtime.errors import Cancelled, DeadlineExceeded, InvalidArgument, NotFound
from temper.v1 import common_pb2
from tests.builders import scored_group
from tests.conftest import wait_until
from tests.replay.util import schema1_bytes

SAMPLERS = ["fifo", "lifo", "uniform", "prioritized"]


def open_store(path, **tables):
    return ReplayStore(path / "r.sqlite", {name: TableConfig(**cfg) for name, cfg in tables.items()})


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_groups_are_sampled_whole_and_unchanged(tmp_path, sampler):
    store = open_store(tmp_path, t=dict(sampler=sampler, max_times_sampled=1, seed=2))
    groups = [scored_group(f"g{i}", n=1 + i % 5, tokens=3 + 7 * i, seed=i) for i in range(12)]
    store.insert("t", groups, priorities=[1.0 + i for i in range(12)])
    want = {g.group_id: g.SerializeToString() for g in groups}
    got = []
    while store.stats("t").size:
        for d in store.sample("t", 5 if store.stats("t").size >= 5 else 1, timeout=0, max_batch=10).draws:
            g = common_pb2.RolloutGroup.FromString(d.payload)
            assert len(g.trajectories) == 1 + int(g.group_id[1:]) % 5  # never split
            assert {t.group_id for t in g.trajectories} == {g.group_id}
            assert d.payload == want[g.group_id]  # byte for byte what was inserted
            got.append(g.group_id)
    assert sorted(got) == sorted(want)  # each exactly once (max_times_sampled = 1)


def test_dedup_survives_reopening_and_sampling(tmp_path):
    store = open_store(tmp_path, t=dict(sampler="fifo", max_times_sampled=1))
    r = store.insert("t", [scored_group("a"), scored_group("b")])
    assert (r.inserted, r.duplicates) == (2, 0)
    r = store.insert("t", [scored_group("a")])
    assert (r.inserted, r.duplicates) == (0, 1)
    store.close()
    store = open_store(tmp_path, t=dict(sampler="fifo", max_times_sampled=1))  # everything acknowledged is there
    got = [common_pb2.RolloutGroup.FromString(d.payload) for d in store.sample("t", 1, timeout=0, max_batch=10).draws]
    assert [g.group_id for g in got] == ["a"] and len(got[0].trajectories) == 2  # FIFO, groups whole
    r = store.insert("t", [scored_group("a")])  # sampled out, still known: a redelivery is not re-admitted
    assert (r.inserted, r.duplicates) == (0, 1)
    s = store.stats("t")
    assert (s.size, s.inserts, s.samples, s.duplicates) == (1, 2, 1, 2)
    assert s.domain_counts == {"toy.copy": 1}


def test_sample_waits_for_an_insert_then_times_out(tmp_path):
    store = open_store(tmp_path, t=dict(max_times_sampled=1))
    def insert_once_a_sample_waits():
        wait_until(lambda: store.stats("t").waiting_samples >= 1, 10, what="a waiting sample")
        store.insert("t", [scored_group("late")])

    late = threading.Thread(target=insert_once_a_sample_waits)
    late.start()
    assert [d.group_id for d in store.sample("t", 1, timeout=10, max_batch=10).draws] == ["late"]
    late.join(10)
    with pytest.raises(DeadlineExceeded):
        store.sample("t", 1, timeout=0.1, max_batch=10)


def test_a_sample_whose_caller_went_away_takes_nothing(tmp_path):
    """A learner killed while its Sample waited: the insert that wakes the dead call must not hand it
    (and, with max_times_sampled = 1, remove) the groups; the next live caller gets them."""
    store = open_store(tmp_path, t=dict(max_times_sampled=1))
    caller_alive = threading.Event()
    caller_alive.set()
    outcome: list[BaseException | object] = []

    def dead_caller():
        try:
            outcome.append(store.sample("t", 2, timeout=30, max_batch=10, alive=caller_alive.is_set))
        except Cancelled as e:
            outcome.append(e)

    waiter = threading.Thread(target=dead_caller)
    waiter.start()
    wait_until(lambda: store.stats("t").waiting_samples >= 1, 10, what="a waiting sample")
    caller_alive.clear()  # the client died; its call is still registered
    store.insert("t", [scored_group("a"), scored_group("b")])
    waiter.join(10)
    assert len(outcome) == 1 and isinstance(outcome[0], Cancelled), outcome
    assert store.stats("t").size == 2
    assert sorted(d.group_id for d in store.sample("t", 2, timeout=0, max_batch=10).draws) == ["a", "b"]
    # a caller that went away before anything was there is refused within a second, not after its timeout
    with pytest.raises(Cancelled):
        store.sample("t", 1, timeout=30, max_batch=10, alive=lambda: False)


def test_policy_lag_is_respected_and_survives_restart(tmp_path):
    store = open_store(tmp_path, t=dict(sampler="uniform", max_times_sampled=0, max_policy_lag=1, seed=0))
    store.insert("t", [scored_group(f"v{v}", version=v) for v in range(3)])  # newest seen: 2, so v0 is stale
    assert store.stats("t").policy_version_counts == {1: 1, 2: 1}
    r = store.sample("t", 50, timeout=0, max_batch=100, current_policy_version=3)  # the learner is at 3
    assert {d.group_id for d in r.draws} == {"v2"} and r.policy_version == 3
    late = store.insert("t", [scored_group("late-v1", version=1)])  # arrives too stale: acknowledged only
    assert (late.inserted, late.stale) == (0, 1)
    store.close()
    store = open_store(tmp_path, t=dict(sampler="uniform", max_times_sampled=0, max_policy_lag=1, seed=0))
    s = store.stats("t")
    assert s.policy_version == 3 and s.size == 1
    assert s.removed["stale"] == 2 and s.removed["stale_on_insert"] == 1
    again = store.insert("t", [scored_group("late-v1", version=1), scored_group("v0", version=0)])
    assert again.duplicates == 2  # never re-admitted
    # a group spanning versions counts as its oldest trajectory's
    mixed = scored_group("mixed", version=3)
    mixed.trajectories[0].policy_version = 1
    assert store.insert("t", [mixed]).stale == 1


def test_max_size_evicts_with_the_remover_and_reports_it(tmp_path):
    store = open_store(tmp_path, t=dict(max_size=3, remover="fifo", max_times_sampled=0))
    r = store.insert("t", [scored_group(f"g{i}") for i in range(5)])
    assert (r.inserted, r.evicted) == (5, 2)
    assert [d.group_id for d in store.sample("t", 1, timeout=0, max_batch=5).draws] == ["g2"]
    assert store.stats("t").removed["evicted"] == 2


def test_priorities_update_durably_and_bad_ones_change_nothing(tmp_path):
    cfg = dict(sampler="prioritized", max_times_sampled=0, remover="lowest_priority", seed=0)
    store = open_store(tmp_path, t=cfg)
    store.insert("t", [scored_group("a"), scored_group("b")], priorities=[1.0, 1.0])
    assert store.update_priorities("t", {"a": 0.0, "gone": 3.0}) == (1, ["gone"])
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(InvalidArgument) as e:
            store.update_priorities("t", {"b": 5.0, "a": bad})
        assert e.value.field == "priorities['a']"
    store.close()
    store = open_store(tmp_path, t=cfg)
    assert {d.group_id for d in store.sample("t", 100, timeout=0, max_batch=100).draws} == {"b"}  # a has priority 0
    assert store.tables["t"].items.priority.tolist()[:2] == [0.0, 1.0]  # b's 5.0 never applied


def test_checkpoint_and_restore(tmp_path):
    store = open_store(tmp_path, t=dict(max_times_sampled=1))
    store.insert("t", [scored_group("a"), scored_group("b")])
    ckpt, size, sizes = store.checkpoint()
    assert size > 0 and sizes == {"t": 2}
    store.sample("t", 2, timeout=0, max_batch=10)
    store.insert("t", [scored_group("c")])
    assert store.restore(ckpt) == {"t": 2}
    assert [d.group_id for d in store.sample("t", 2, timeout=0, max_batch=10).draws] == ["a", "b"]
    assert store.insert("t", [scored_group("c")]).inserted == 1  # "c" came after the checkpoint
    s = store.stats("t")
    assert (s.inserts, s.samples) == (3, 2)
    store.close()
    store = open_store(tmp_path, t=dict(max_times_sampled=1))  # the restored state is the durable one
    assert [d.group_id for d in store.sample("t", 1, timeout=0, max_batch=10).draws] == ["c"]
    with pytest.raises(NotFound):
        store.restore("replay-nope")
    with pytest.raises(InvalidArgument) as e:
        store.restore("../../etc/passwd")
    assert e.value.field == "checkpoint_id"


def test_a_failed_transaction_leaves_memory_and_disk_as_they_were(tmp_path, monkeypatch):
    store = open_store(tmp_path, t=dict(max_size=2, max_times_sampled=1))
    store.insert("t", [scored_group("a"), scored_group("b")])

    def broken(table, removed):  # fails once the table in memory has evicted "a" and added "c"
        if removed:
            assert "c" in table.items.by_group and "a" not in table.items.by_group
            raise sqlite3.OperationalError("disk I/O error (injected)")

    monkeypatch.setattr(store, "_persist", broken)
    with pytest.raises(sqlite3.OperationalError):
        store.insert("t", [scored_group("c")])
    monkeypatch.undo()
    s = store.stats("t")
    assert (s.size, s.inserts, s.removed["evicted"]) == (2, 2, 0)
    assert [d.group_id for d in store.sample("t", 2, timeout=0, max_batch=10).draws] == ["a", "b"]


def test_a_changed_config_is_applied_on_reopen(tmp_path):
    store = open_store(tmp_path, t=dict(max_size=10, max_times_sampled=0))
    store.insert("t", [scored_group(f"g{i}", domain="math" if i < 6 else "code") for i in range(8)])
    store.close()
    store = open_store(tmp_path, t=dict(max_size=5, max_times_sampled=0, domain_quotas={"math": 2}))
    s = store.stats("t")
    assert s.size == 4 and s.domain_counts == {"math": 2, "code": 2}
    assert s.removed["quota"] == 4 and s.removed["evicted"] == 0


def test_opens_the_skeleton_schema(tmp_path):
    """A store written by the walking skeleton (payloads inline, no priorities) opens and keeps its groups."""
    db = sqlite3.connect(tmp_path / "r.sqlite", isolation_level=None)
    db.executescript("""
        CREATE TABLE items (seq INTEGER PRIMARY KEY AUTOINCREMENT, tbl TEXT NOT NULL, group_id TEXT NOT NULL,
            domain TEXT NOT NULL, policy_version INTEGER NOT NULL, data BLOB, removed INTEGER NOT NULL DEFAULT 0,
            UNIQUE (tbl, group_id));
        CREATE TABLE counters (tbl TEXT, name TEXT, value INTEGER, PRIMARY KEY (tbl, name));""")
    db.execute("INSERT INTO items (tbl, group_id, domain, policy_version, data, removed) VALUES "
               "('default', 'old', 'toy.copy', 0, NULL, 1), ('default', 'live', 'toy.copy', 0, ?, 0)",
               (schema1_bytes(scored_group("live", tokens=300)),))
    db.execute("INSERT INTO counters VALUES ('default', 'inserts', 2), ('default', 'samples', 1)")
    db.close()
    store = ReplayStore(tmp_path / "r.sqlite", ["default"])
    assert store.insert("default", [scored_group("old")]).duplicates == 1
    [draw] = store.sample("default", 1, timeout=0, max_batch=10).draws
    assert draw.payload == scored_group("live", tokens=300).SerializeToString()  # token ids upgraded too
    assert (store.stats("default").inserts, store.stats("default").samples) == (2, 2)


def test_opens_a_schema1_store_and_upgrades_its_token_ids(tmp_path):
    """Schema 1 stored token ids as varints: opening it re-encodes every live group (the same
    message), once; old segments are collected."""
    groups = {f"g{i}": scored_group(f"g{i}", n=2, tokens=40 + i, seed=i) for i in range(6)}
    store = open_store(tmp_path, t=dict(sampler="fifo", max_times_sampled=1))
    store.insert("t", list(groups.values()))
    store.close()
    log = PayloadLog(tmp_path / "r-payloads")  # rewrite the rows as schema 1 left them
    db = sqlite3.connect(tmp_path / "r.sqlite", isolation_level=None)
    for seq, gid in db.execute("SELECT seq, group_id FROM items WHERE removed=0").fetchall():
        data = schema1_bytes(groups[gid])
        seg, off = log.append(data)
        db.execute("UPDATE items SET seg=?, off=?, len=? WHERE seq=?", (seg, off, len(data), seq))
    log.sync()
    log.close()
    db.execute("PRAGMA user_version=1")
    db.close()
    for _ in range(2):  # migrated once; reopening reads the migrated store as it is
        store = open_store(tmp_path, t=dict(sampler="fifo", max_times_sampled=1))
        assert store.stats("t").size == 6
        assert len(list((tmp_path / "r-payloads").glob("seg-*"))) == 1  # the schema 1 segments collected
        store.close()
    store = open_store(tmp_path, t=dict(sampler="fifo", max_times_sampled=1))
    draws = store.sample("t", 6, timeout=0, max_batch=10).draws
    assert {d.group_id: d.payload for d in draws} == {gid: g.SerializeToString() for gid, g in groups.items()}


def test_a_group_whose_reward_is_an_error_is_stored_for_the_learner_to_drop_and_count(tmp_path):
    store = open_store(tmp_path, t=dict(max_times_sampled=1))
    failed = scored_group("failed")
    failed.trajectories[0].reward.status = common_pb2.REWARD_STATUS_ERROR
    assert store.insert("t", [failed]).inserted == 1
    [draw] = store.sample("t", 1, timeout=0, max_batch=10).draws
    assert draw.group_id == "failed"


@pytest.mark.parametrize("mutate,field", [
    (lambda g: g.trajectories[0].completion_logprobs.append(-1.0), "groups[1].trajectories[0].completion_logprobs"),
    (lambda g: g.trajectories[1].ClearField("completion_token_ids"), "groups[1].trajectories[1].completion_logprobs"),
    (lambda g: setattr(g.trajectories[1], "group_id", "other"), "groups[1].trajectories[1].group_id"),
    (lambda g: setattr(g.trajectories[0], "policy_version", -2), "groups[1].trajectories[0].policy_version"),
    (lambda g: g.trajectories[0].ClearField("reward"), "groups[1].trajectories[0].reward"),
    (lambda g: g.ClearField("group_id"), "groups[1].group_id"),
    (lambda g: g.ClearField("trajectories"), "groups[1].trajectories"),
    (lambda g: setattr(g.trajectories[1].reward, "total", float("nan")), "groups[1].trajectories[1].reward.total"),
    (lambda g: setattr(g.trajectories[0].reward, "status", common_pb2.REWARD_STATUS_UNSPECIFIED),
     "groups[1].trajectories[0].reward.status"),
])
def test_a_batch_with_one_malformed_group_stores_nothing(tmp_path, mutate, field):
    store = open_store(tmp_path, t=dict(max_times_sampled=1))
    store.insert("t", [scored_group("kept")])
    bad = scored_group("bad")
    mutate(bad)
    with pytest.raises(InvalidArgument) as e:
        store.insert("t", [scored_group("fine"), bad])
    assert e.value.field == field
    s = store.stats("t")
    assert (s.size, s.inserts) == (1, 1)
    assert [d.group_id for d in store.sample("t", 1, timeout=0, max_batch=10).draws] == ["kept"]
    with pytest.raises(DeadlineExceeded):
        store.sample("t", 1, timeout=0, max_batch=10)
    assert store.insert("t", [scored_group("fine")]).inserted == 1  # "fine" was not half-stored


def test_bad_sample_arguments(tmp_path):
    store = open_store(tmp_path, t=dict(max_size=4, max_times_sampled=2))
    for kwargs, field in [(dict(batch_size=0), "batch_size"), (dict(batch_size=-1), "batch_size"),
                          (dict(batch_size=11), "batch_size"), (dict(batch_size=9), "batch_size"),  # > 4 * 2
                          (dict(batch_size=1, timeout=-1), "timeout_ms"),
                          (dict(batch_size=1, current_policy_version=-1), "current_policy_version"),
                          (dict(batch_size=1, importance_sampling_exponent=math.nan), "importance_sampling_exponent"),
                          (dict(batch_size=1, table="nope"), "table")]:
        args = dict(table="t", timeout=0, max_batch=10) | kwargs
        with pytest.raises(InvalidArgument) as e:
            store.sample(**args)
        assert e.value.field == field, kwargs


def test_payload_segments_are_compacted_and_collected(tmp_path):
    store = open_store(tmp_path, t=dict(sampler="uniform", max_times_sampled=1, seed=5))
    store.log.segment_bytes = 4000  # tiny segments: a few groups each
    groups = [scored_group(f"g{i}", tokens=60, seed=i) for i in range(60)]
    store.insert("t", groups)
    segments = lambda: sorted(p.name for p in store.log.dir.iterdir())  # noqa: E731
    many = segments()
    assert len(many) > 10
    taken = {d.group_id for d in store.sample("t", 45, timeout=0, max_batch=100).draws}  # random removals
    assert len(taken) == 45 and len(segments()) <= len(many)  # fully emptied segments are gone at once
    moved = store.compact(min_fill=0.6)
    assert moved > 0 and len(segments()) < len(many) / 2
    (store.log.dir / "seg-00000000000000000001-deadbeef").write_bytes(b"left by a crash")
    store.close()
    store = open_store(tmp_path, t=dict(sampler="uniform", max_times_sampled=1, seed=5))
    assert "seg-00000000000000000001-deadbeef" not in segments()  # unreferenced: collected at start-up
    want = {g.group_id: g.SerializeToString() for g in groups if g.group_id not in taken}
    got = {d.group_id: d.payload for d in store.sample("t", 15, timeout=0, max_batch=100).draws}
    assert got == want  # every remaining group intact after compaction and a restart


def test_without_fsync_the_store_is_the_same(tmp_path):
    store = ReplayStore(tmp_path / "r.sqlite", {"t": TableConfig()}, fsync=False)
    store.insert("t", [scored_group("a"), scored_group("b")])
    store.sample("t", 1, timeout=0, max_batch=10)
    store._db.close()  # no clean close: what a killed process leaves  # noqa: SLF001
    store = ReplayStore(tmp_path / "r.sqlite", {"t": TableConfig()}, fsync=False)
    assert [d.group_id for d in store.sample("t", 1, timeout=0, max_batch=10).draws] == ["b"]
    assert store.insert("t", [scored_group("a")]).duplicates == 1
