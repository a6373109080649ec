"""Leased samples: draws held for the caller until it acknowledges them, given back otherwise (at least once)."""

from __future__ import annotations

import threading
import time

import pytest

from temper.replay.store import ReplayStore
from temper.replay.tables import TableConfig
from temper.runtime.errors import InvalidArgument, NotFound
from tests.builders import scored_group


def open_store(path, **cfg):
    return ReplayStore(path / "r.sqlite", {"t": TableConfig(**cfg)})


def ids(result):
    return [d.group_id for d in result.draws]


@pytest.mark.parametrize("sampler", ["fifo", "lifo", "uniform", "prioritized"])
def test_an_acknowledged_lease_is_final_and_durable(tmp_path, sampler):
    store = open_store(tmp_path, sampler=sampler, max_times_sampled=1, seed=0)
    store.insert("t", [scored_group(g) for g in "abcd"])
    r = store.sample("t", 2, timeout=0, max_batch=10, lease_s=60)
    assert r.lease_id and store.leased("t") == 2 and store.stats("t").size == 2
    held = store.stats("t")
    assert (held.leases, held.leased, held.lease_outcomes) == (1, 2, {})
    assert store.ack(r.lease_id) == 2 and store.leased("t") == 0
    assert store.stats("t").lease_outcomes == {"acked": 1}
    with pytest.raises(NotFound) as e:  # settled once
        store.ack(r.lease_id)
    assert e.value.field == "lease_id"
    store.close()
    store = open_store(tmp_path, sampler=sampler, max_times_sampled=1, seed=0)  # the used-up groups stay gone
    assert store.stats("t").size == 2 and sorted(ids(store.sample("t", 2, timeout=0, max_batch=10))) == \
        sorted(set("abcd") - set(ids(r)))


def test_a_requeued_lease_gives_the_groups_back_in_order_as_if_never_drawn(tmp_path):
    store = open_store(tmp_path, max_times_sampled=1)
    store.insert("t", [scored_group(g) for g in "abc"])
    before = store.stats("t")
    r = store.sample("t", 2, timeout=0, max_batch=10, lease_s=60)
    assert ids(r) == ["a", "b"]
    assert store.ack(r.lease_id, "requeue") == 2
    after = store.stats("t")
    assert (after.size, after.samples, after.deletes, after.removed) == \
        (before.size, before.samples, before.deletes, before.removed)
    assert ids(store.sample("t", 3, timeout=0, max_batch=10)) == ["a", "b", "c"]  # fifo order kept


def test_a_lease_that_runs_out_hands_its_groups_to_the_next_caller(tmp_path):
    store = open_store(tmp_path, max_times_sampled=1)
    store.insert("t", [scored_group("a"), scored_group("b")])
    dead = store.sample("t", 2, timeout=0, max_batch=10, lease_s=0.3)  # a learner that dies mid-step
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(store.sample("t", 2, timeout=10, max_batch=10)))
    t0 = time.monotonic()
    waiter.start()  # waits: nothing is left until the lease runs out
    waiter.join(10)
    assert got and sorted(ids(got[0])) == ["a", "b"] and time.monotonic() - t0 < 5
    with pytest.raises(NotFound):  # too late: the groups went to someone else
        store.ack(dead.lease_id)
    stats = store.stats("t")
    assert (stats.leases, stats.leased, stats.lease_outcomes) == (0, 0, {"expired": 1})


def test_an_extended_lease_outlives_its_first_deadline(tmp_path):
    store = open_store(tmp_path, max_times_sampled=1)
    store.insert("t", [scored_group("a")])
    r = store.sample("t", 1, timeout=0, max_batch=10, lease_s=0.3)
    for _ in range(4):
        time.sleep(0.15)
        assert store.ack(r.lease_id, "extend", 0.3) == 1
    assert store.stats("t").size == 0 and store.ack(r.lease_id) == 1


def test_a_lease_outstanding_when_the_store_stops_is_back_after_the_restart(tmp_path):
    store = open_store(tmp_path, max_times_sampled=1)
    store.insert("t", [scored_group("a"), scored_group("b")])
    store.sample("t", 2, timeout=0, max_batch=10, lease_s=60)
    store.insert("t", [scored_group("c")])  # another transaction meanwhile writes counters, not the lease
    store.close()
    store = open_store(tmp_path, max_times_sampled=1)
    assert ids(store.sample("t", 3, timeout=0, max_batch=10)) == ["a", "b", "c"]


def test_a_lease_of_unlimited_draws_and_one_whose_group_went_stale(tmp_path):
    store = open_store(tmp_path, max_times_sampled=0, max_policy_lag=0)
    store.insert("t", [scored_group("a", version=0)])
    r = store.sample("t", 3, timeout=0, max_batch=10, lease_s=60)  # one group drawn three times, still live
    assert ids(r) == ["a"] * 3 and store.stats("t").samples == 3
    assert store.ack(r.lease_id, "requeue") == 3 and store.stats("t").samples == 0
    store = open_store(tmp_path / "b", max_times_sampled=1, max_policy_lag=0)
    store.insert("t", [scored_group("a", version=0)])
    r = store.sample("t", 1, timeout=0, max_batch=10, lease_s=60)
    store.insert("t", [scored_group("b", version=1)])  # "a" is now too stale to come back
    store.ack(r.lease_id, "requeue")
    assert ids(store.sample("t", 1, timeout=0, max_batch=10)) == ["b"] and store.stats("t").size == 0


@pytest.mark.parametrize("call, field", [
    (lambda s: s.sample("t", 1, timeout=0, max_batch=10, lease_s=-1), "lease_ms"),
    (lambda s: s.sample("t", 1, timeout=0, max_batch=10, lease_s=float("nan")), "lease_ms"),
    (lambda s: s.ack(""), "lease_id"),
    (lambda s: s.ack("x", "drop"), "action"),
    (lambda s: s.ack("x", "extend", 0), "extend_ms"),
])
def test_bad_lease_arguments_name_the_field_and_change_nothing(tmp_path, call, field):
    store = open_store(tmp_path, max_times_sampled=1)
    store.insert("t", [scored_group("a")])
    with pytest.raises(InvalidArgument) as e:
        call(store)
    assert e.value.field == field and store.stats("t").size == 1
