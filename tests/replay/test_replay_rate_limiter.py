"""The rate limiter: its band, its config checks, and its invariant under concurrent inserters
and samplers on a real (SQLite-backed) store."""

import math
import random
import threading
import time

import pytest
from pydantic import ValidationError

from temper.replay.rate_limiter import RateLimiter
from temper.replay.store import ReplayStore
from temper.replay.tables import TableConfig
from temper.runtime.errors import DeadlineExceeded, InvalidArgument
from tests.builders import scored_group


def test_min_size_only():
    lim = RateLimiter.from_config(0, min_size_to_sample=3, error_buffer=0)
    assert lim.can_insert(1000)
    lim.inserts = 2
    assert not lim.can_sample(1)
    lim.inserts = 3
    assert lim.can_sample(1) and lim.can_sample(10**9) and lim.max_batch() == math.inf


def test_band_blocks_the_side_that_would_leave_it():
    # spi 2, min size 4, buffer 3: band [8 - 3, 8 + 3] on diff = 2 * inserts - samples
    lim = RateLimiter.from_config(2.0, min_size_to_sample=4, error_buffer=3.0)
    assert (lim.min_diff, lim.max_diff) == (5.0, 11.0)
    lim.inserts = 4
    assert lim.can_insert(1)  # diff would be 10
    assert not lim.can_insert(2)  # 12 > 11
    assert lim.insertable(5) == 1
    assert lim.can_sample(3) and not lim.can_sample(4)  # 8 - 3 = 5 ok, 8 - 4 = 4 < 5
    lim.samples = 3
    assert lim.can_insert(3) and not lim.can_insert(4)  # (4 + 3) * 2 - 3 = 11 <= 11 < (4 + 4) * 2 - 3
    lim.deletes = 4  # the table emptied: inserts up to the min size are free again
    assert lim.can_insert(4) and lim.size == 0 and not lim.can_sample(1)
    assert lim.max_batch() == 11 - 2 - 5


@pytest.mark.parametrize("config,message", [
    (dict(samples_per_insert=4, error_buffer=3), "narrower"),
    (dict(samples_per_insert=1, error_buffer=(20.0, 30.0)), "never start"),
    (dict(samples_per_insert=2, error_buffer=10, max_times_sampled=1), "max_times_sampled"),
    (dict(min_size_to_sample=10, max_size=5), "max_size"),
    (dict(domain_quotas={"math": 0}), "domain_quotas"),
    (dict(sampler="random"), "sampler"),
])
def test_configs_that_would_deadlock_are_refused(config, message):
    with pytest.raises(ValidationError, match=message):
        TableConfig(**config)


def test_invariant_holds_under_concurrent_inserters_and_samplers(tmp_path):
    """3 inserter and 2 sampler threads on one table with samples_per_insert = 2: after every
    insert ``I*spi - S <= max_diff`` (or the table is at most min size) and after every sample
    ``I*spi - S >= min_diff``. Inserters run fast for the first half, samplers for the second,
    so each side in turn is held back by the ratio. At the end the samplers have taken exactly
    what the band allows: ``S = I*spi - min_diff``."""
    spi, min_size, buffer = 2.0, 4, 6.0
    config = TableConfig(sampler="uniform", max_times_sampled=0, samples_per_insert=spi,
                         min_size_to_sample=min_size, error_buffer=buffer, seed=1)
    lim = config.rate_limiter()
    store = ReplayStore(tmp_path / "r.sqlite", {"t": config})
    per_inserter, n_inserters = 40, 3
    total = per_inserter * n_inserters
    snapshots: list[tuple[str, tuple[int, int, int]]] = []
    sampled: list[str] = []
    blocked = {"insert": 0, "sample": 0}
    errors: list[BaseException] = []
    lock = threading.Lock()
    inserted_all = threading.Event()
    second_half = threading.Event()  # from then on inserters are the slow side

    def inserter(w: int):
        rnd = random.Random(w)
        try:
            for k in range(per_inserter):
                if k == per_inserter // 2:
                    second_half.set()
                g = scored_group(f"w{w}/{k}")
                while True:
                    try:
                        r = store.insert("t", [g], timeout=0.002)
                        break
                    except DeadlineExceeded as e:
                        assert "rate limiter" in str(e)
                        with lock:
                            blocked["insert"] += 1
                with lock:
                    snapshots.append(("insert", r.limiter))
                if second_half.is_set():
                    time.sleep(rnd.random() * 0.01)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def sampler(w: int):
        rnd = random.Random(100 + w)
        try:
            while True:
                finished = inserted_all.is_set()  # then nothing can unblock a sample any more
                if not second_half.is_set():
                    time.sleep(rnd.random() * 0.01)
                try:
                    r = store.sample("t", 1 if finished else rnd.randint(1, 3), timeout=0.002, max_batch=64)
                except DeadlineExceeded as e:
                    if finished:
                        return
                    with lock:
                        blocked["sample"] += "rate limiter" in str(e)  # not just below min size
                    continue
                with lock:
                    snapshots.append(("sample", r.limiter))
                    sampled.extend(d.group_id for d in r.draws)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    inserters = [threading.Thread(target=inserter, args=(w,)) for w in range(n_inserters)]
    samplers = [threading.Thread(target=sampler, args=(w,)) for w in range(2)]
    for th in inserters + samplers:
        th.start()
    for th in inserters:
        th.join(120)
    inserted_all.set()
    for th in samplers:
        th.join(120)
    assert not errors, errors
    assert not any(th.is_alive() for th in inserters + samplers)
    assert len(snapshots) > total
    for side, (inserts, samples, deletes) in snapshots:
        diff = inserts * spi - samples
        if side == "sample":
            assert diff >= lim.min_diff, (side, inserts, samples)
        else:
            assert diff <= lim.max_diff or inserts - deletes <= min_size, (side, inserts, samples, deletes)
    assert blocked["insert"] > 0 and blocked["sample"] > 0  # the band really held both sides back
    s = store.stats("t")
    assert (s.inserts, s.size, s.samples, len(sampled)) == (total, total, total * spi - lim.min_diff, s.samples)
    assert set(sampled) <= {f"w{w}/{k}" for w in range(n_inserters) for k in range(per_inserter)}


def test_concurrent_samplers_never_share_a_sample_once_group(tmp_path):
    store = ReplayStore(tmp_path / "r.sqlite", {"t": TableConfig(sampler="uniform", max_times_sampled=1, seed=3)})
    store.insert("t", [scored_group(f"g{i}") for i in range(200)])
    got: list[str] = []
    lock = threading.Lock()

    def sampler(seed: int):
        rnd = random.Random(seed)
        while True:
            try:
                draws = store.sample("t", rnd.randint(1, 7), timeout=0, max_batch=64).draws
            except DeadlineExceeded:
                if store.stats("t").size == 0:
                    return
                continue  # fewer left than asked: ask again (maybe fewer)
            with lock:
                got.extend(d.group_id for d in draws)

    threads = [threading.Thread(target=sampler, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert sorted(got) == sorted(f"g{i}" for i in range(200))  # each exactly once


def test_batches_larger_than_the_band_allows_are_refused(tmp_path):
    store = ReplayStore(tmp_path / "r.sqlite", {"t": TableConfig(samples_per_insert=1, error_buffer=4,
                                                                  min_size_to_sample=2, max_times_sampled=0)})
    with pytest.raises(InvalidArgument) as e:
        store.sample("t", 8, timeout=0, max_batch=100)  # band width 8 - spi 1 = 7 at most
    assert e.value.field == "batch_size"
    store.insert("t", [scored_group(f"g{i}") for i in range(3)])
    with pytest.raises(DeadlineExceeded) as e:  # blocked by the ratio, not refused
        store.sample("t", 7, timeout=0.05, max_batch=100)
    assert "rate limiter" in str(e.value)
