"""The embedded broker supervised, with real processes. ``[broker] storage = "s3"``: kill -9 of the broker, then
of its object store, each time the supervisor starts them again on the same address and nothing is lost or
stored twice (a producer made before the kills keeps sending: its id survived; replay's consumer group goes
on from its committed offsets). Memory storage: a killed broker is not restarted (its topics died with it)
and the stack is failed with that reason, as ``temper run`` then reports."""

from __future__ import annotations

import os
import signal

import pytest

from temper.client.sdk import ReplayClient
from temper.runtime import kafka
from temper.runtime.launcher import Launcher, pid_alive
from tests.builders import scored_group
from tests.conftest import wait_until

pytestmark = pytest.mark.slow


def _launcher(tmp_path, storage: str) -> Launcher:
    config = tmp_path / "job.toml"
    config.write_text(f'[broker]\nstorage = "{storage}"\n\n[launcher]\nbackoff_seconds = 0.2\n')
    return Launcher(home=tmp_path / "home", config=config)


def test_a_durable_broker_killed_and_its_store_killed_come_back_losing_nothing(tmp_path):
    launcher = _launcher(tmp_path, "s3")
    state = launcher.up(["replay"])
    pids = []
    try:
        broker, store = state.broker, state.broker_storage
        assert store is not None and store.address.startswith("http://127.0.0.1:")
        pids += [broker.pid, store.pid, state.services["replay"].pid]
        producer = kafka.ProtoProducer(state.kafka_bootstrap, client_id="test-publisher")
        replay = ReplayClient(state.services["replay"].address)

        def publish(first: int, n: int) -> None:
            for i in range(first, first + n):
                producer.send(kafka.SCORED, f"g{i}", scored_group(f"durable/{i}")).get(timeout=60)

        publish(0, 5)
        wait_until(lambda: replay.stats().inserts == 5, 60, what="5 groups in replay")
        for victim in ("broker", "broker_storage"):
            before = launcher.load()
            os.kill(getattr(before, victim).pid, signal.SIGKILL)
            after = wait_until(lambda old=before.broker.pid: (s := launcher.load()).broker.pid != old and s, 120,
                               interval=0.2, what=f"the broker restarted after its {victim} was killed")
            assert after.broker.address == broker.address  # the same address: nothing else is told
            assert after.broker.restarts == before.broker.restarts + 1
            pids += [after.broker.pid, after.broker_storage.pid]
            if victim == "broker_storage":
                assert after.broker_storage.pid != before.broker_storage.pid
                assert after.broker.last_exit.startswith("its object store ")
        publish(5, 5)  # the same producer: its id and sequence numbers were kept through both restarts
        wait_until(lambda: replay.stats().inserts == 10, 120, what="10 groups in replay after the restarts")
        stats = replay.stats()
        assert stats.size == 10 and stats.duplicates == 0, stats
        assert kafka.messages_in(state.kafka_bootstrap, kafka.SCORED) == 10
        rows = {r["name"]: r for r in launcher.status()}
        assert rows["broker"]["restarts"] == 2 and rows["broker"]["health"] == "RUNNING"
        assert rows["broker-storage"]["restarts"] == 1
        producer.close()
    finally:
        launcher.down()
    assert not [p for p in pids if pid_alive(p)], "processes left behind"


def test_a_memory_broker_killed_fails_the_stack_naming_why(tmp_path):
    launcher = _launcher(tmp_path, "memory")
    state = launcher.up(["replay"])
    try:
        assert state.broker_storage is None
        os.kill(state.broker.pid, signal.SIGKILL)
        wait_until(lambda: launcher.load().broker.failed, 60, interval=0.2, what="the broker marked failed")
        with pytest.raises(RuntimeError, match=r"broker killed by SIGKILL; its storage is memory: .* not restarted"):
            launcher.raise_if_failed()
        assert {r["name"]: r for r in launcher.status()}["broker"]["health"] == "FAILED"
    finally:
        launcher.down()


def test_a_bad_broker_table_is_named(tmp_path):
    config = tmp_path / "job.toml"
    config.write_text('[broker]\nstorage = "disk"\n')
    with pytest.raises(ValueError, match=r"\[broker\] broker.storage: Input should be 'memory' or 's3'"):
        Launcher(home=tmp_path / "home", config=config).up(["replay"])
