"""The learner loop with replay leases (``sample_lease_seconds``), against the real replay service: a step that
outlasts its lease keeps its batch (the loop renews it), the batch is acknowledged after the step, and a learner
that never acknowledges (killed mid-step) loses nothing: replay gives the batch to the next caller."""

from __future__ import annotations

import time

import grpc
import pytest

from temper.client.sdk import ReplayClient
from temper.learner import loop as learner_loop
from temper.learner.loop import LearnerLoop
from temper.learner.trainer import Trainer, TrainerConfig
from temper.models.tiny import build_tiny_model
from temper.runtime.launcher import pid_alive
from tests.builders import tiny_model_group
from tests.conftest import holds_for, wait_until
from tests.replay.util import start_replay

pytestmark = pytest.mark.slow  # starts a broker and the replay service

CONFIG = """
[replay]
[replay.tables.default]
max_times_sampled = 1
"""


@pytest.fixture(scope="module")
def replay(tmp_path_factory):
    base = tmp_path_factory.mktemp("learner-leases")
    launcher, pids = start_replay(base, base / "unused-model", CONFIG)
    client = ReplayClient(launcher.load().services["replay"].address, timeout=30)
    yield client
    client.close()
    launcher.down()
    assert not [p for p in pids if pid_alive(p)], "processes left behind"


def test_a_step_longer_than_its_lease_keeps_its_batch_and_acknowledges_it(replay, tmp_path):
    trainer = Trainer(build_tiny_model(tmp_path / "m", seed=0), TrainerConfig())
    step = trainer.step

    def slow_step(batch):  # 4 lease lengths: without renewals replay would give the batch back mid-step
        time.sleep(2.4)
        return step(batch)

    trainer.step = slow_step
    lost = learner_loop.LEASES_LOST._value.get()
    loop = LearnerLoop(trainer, replay, [], None, groups_per_step=2, sample_timeout_ms=500, sample_lease_s=0.6)
    loop.start()
    try:
        replay.insert([tiny_model_group("a"), tiny_model_group("b")])
        wait_until(lambda: loop.state.step >= 1, 60, what="a learner step")
        holds_for(lambda: loop.state.step == 1, 2.0, what="the batch trained once, not drawn again")
    finally:
        loop.stop()
    stats = replay.stats()
    assert stats.size == 0 and stats.removed["sampled_out"] == 2  # acknowledged: final
    assert learner_loop.LEASES_LOST._value.get() == lost


def test_a_batch_never_acknowledged_goes_to_the_next_caller(replay):
    replay.insert([tiny_model_group("c"), tiny_model_group("d")])
    dead = replay.sample_batch(2, timeout_ms=0, lease_ms=500)  # a learner killed before it acknowledged
    assert [g.group_id for g in dead.groups] == ["c", "d"]
    again = replay.sample_batch(2, timeout_ms=10_000)  # waits until the lease runs out
    assert [g.group_id for g in again.groups] == ["c", "d"]
    with pytest.raises(grpc.RpcError) as e:
        replay.ack_sample(dead.lease_id)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "lease_id" in e.value.details()


def test_a_learner_gives_back_at_once_the_batch_its_killed_predecessor_held(replay, tmp_path):
    """A learner killed after its step but before its checkpoint and ack left its lease id in the checkpoint
    folder; its successor requeues that batch before it samples, so it trains it now, not after the lease."""
    replay.insert([tiny_model_group("e"), tiny_model_group("f")])
    dead = replay.sample_batch(2, timeout_ms=0, lease_ms=600_000)  # held for 10 minutes by a learner now dead
    assert [g.group_id for g in dead.groups] == ["e", "f"]
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    (checkpoints / "lease-in-hand").write_text(dead.lease_id)
    trainer = Trainer(build_tiny_model(tmp_path / "m", seed=0), TrainerConfig())
    loop = LearnerLoop(trainer, replay, [], None, groups_per_step=2, sample_timeout_ms=500, sample_lease_s=60,
                       checkpoint_dir=checkpoints, checkpoint_every=1)
    loop.start()
    try:
        wait_until(lambda: loop.state.step >= 1, 30, what="the predecessor's batch trained")
    finally:
        loop.stop()
    assert sorted(loop.state.last.group_ids) == ["e", "f"]
    assert not (checkpoints / "lease-in-hand").exists()  # settled: nothing left for a successor
    assert replay.stats().size == 0
