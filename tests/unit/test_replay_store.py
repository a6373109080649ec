import threading

import pytest

from temper.replay.store import ReplayStore
from temper.runtime.errors import DeadlineExceeded, InvalidArgument
from temper.v1 import common_pb2


def group(gid: str, n: int = 2, domain: str = "toy.copy") -> common_pb2.RolloutGroup:
    return common_pb2.RolloutGroup(group_id=gid, task=common_pb2.Task(domain=domain), trajectories=[
        common_pb2.Trajectory(trajectory_id=f"{gid}/{k}", completion_token_ids=[1, 2], completion_logprobs=[-0.1, -0.2],
                              reward=common_pb2.Reward(total=1.0, status=common_pb2.REWARD_STATUS_OK))
        for k in range(n)])


def test_fifo_dedup_and_durability(tmp_path):
    path = tmp_path / "r.sqlite"
    store = ReplayStore(path, ["default"])
    r = store.insert("default", [group("a"), group("b")])
    assert (r.inserted, r.duplicates) == (2, 0)
    r = store.insert("default", [group("a")])
    assert (r.inserted, r.duplicates) == (0, 1)
    store.close()
    store = ReplayStore(path, ["default"])  # reopen: everything acknowledged is still there
    got = [common_pb2.RolloutGroup.FromString(d.payload) for d in store.sample("default", 1, timeout=0, max_batch=10).draws]
    assert [g.group_id for g in got] == ["a"]
    assert len(got[0].trajectories) == 2  # groups whole
    # a sampled (removed) group is still known: redelivery does not re-admit it
    r = store.insert("default", [group("a")])
    assert (r.inserted, r.duplicates) == (0, 1)
    s = store.stats("default")
    assert (s.size, s.inserts, s.samples, s.duplicates) == (1, 2, 1, 2)
    assert s.domain_counts == {"toy.copy": 1}


def test_sample_waits_then_times_out(tmp_path):
    store = ReplayStore(tmp_path / "r.sqlite", ["default"])
    threading.Timer(0.2, lambda: store.insert("default", [group("late")])).start()
    assert [d.group_id for d in store.sample("default", 1, timeout=5, max_batch=10).draws] == ["late"]
    with pytest.raises(DeadlineExceeded):
        store.sample("default", 1, timeout=0.1, max_batch=10)


@pytest.mark.parametrize("mutate,field", [
    (lambda g: g.trajectories[0].completion_logprobs.append(-1.0), "group.trajectories[0].completion_logprobs"),
    (lambda g: g.ClearField("group_id"), "group.group_id"),
    (lambda g: g.ClearField("trajectories"), "group.trajectories"),
    (lambda g: setattr(g.trajectories[1].reward, "total", float("nan")), "group.trajectories[1].reward.total"),
    (lambda g: setattr(g.trajectories[0].reward, "status", common_pb2.REWARD_STATUS_ERROR),
     "group.trajectories[0].reward.status"),
])
def test_malformed_groups_are_refused_and_nothing_is_harmed(tmp_path, mutate, field):
    store = ReplayStore(tmp_path / "r.sqlite", ["default"])
    store.insert("default", [group("ok")])
    bad = group("bad")
    mutate(bad)
    with pytest.raises(InvalidArgument) as e:
        store.insert("default", [bad])
    assert e.value.field == field
    assert store.stats("default").size == 1


def test_unknown_table_and_batch_bounds(tmp_path):
    store = ReplayStore(tmp_path / "r.sqlite", ["default"])
    with pytest.raises(InvalidArgument) as e:
        store.sample("nope", 1, 0, 10)
    assert e.value.field == "table"
    for bad in (0, -1, 11):
        with pytest.raises(InvalidArgument) as e:
            store.sample("default", bad, 0, 10)
        assert e.value.field == "batch_size"
