"""A message redelivered by Kafka after a consumer restart is not counted twice."""

import pytest
from kafka import KafkaConsumer
from kafka.structs import OffsetAndMetadata, TopicPartition

from temper.client.sdk import MonitorClient, ReplayClient
from temper.runtime import kafka
from temper.runtime.launcher import Launcher
from temper.v1 import common_pb2
from tests.builders import scored_group
from tests.conftest import wait_until

pytestmark = pytest.mark.slow  # starts a broker, replay and monitor


def redelivered(i: int) -> common_pb2.RolloutGroup:
    g = scored_group(f"redeliver/s0/p{i}", n=1, rewards=[float(i % 2)])
    g.job_id = "redeliver"  # the monitor dead-letters a group without its job
    return g


def _rewind(bootstrap: str, group_id: str) -> None:
    """Move a consumer group's committed offset back to 0, as a crash before commit would leave it.

    Done as a member of the group (join, seek, commit, leave), the standard way.
    """
    c = KafkaConsumer(kafka.SCORED, bootstrap_servers=bootstrap, group_id=group_id, enable_auto_commit=False,
                      session_timeout_ms=6000, heartbeat_interval_ms=2000)
    tp = TopicPartition(kafka.SCORED, 0)
    try:
        wait_until(lambda: c.poll(timeout_ms=200) is not None and c.assignment(), 60, interval=0.1,
                   what=f"joining {group_id}")
        c.seek(tp, 0)
        c.commit({tp: OffsetAndMetadata(0, "", -1)})
    finally:
        c.close()


def test_redelivery_after_restart_is_not_double_counted(tmp_path):
    launcher = Launcher(home=tmp_path)
    state = launcher.up(["replay", "monitor"])
    try:
        producer = kafka.ProtoProducer(state.kafka_bootstrap, "test")
        for i in range(6):
            producer.send(kafka.SCORED, redelivered(i).group_id, redelivered(i)).get(10)
        replay = ReplayClient(state.services["replay"].address)
        wait_until(lambda: replay.stats().inserts == 6, 60, what="6 inserts")
        monitor = MonitorClient(state.services["monitor"].address)
        wait_until(lambda: sum(p.samples for p in monitor.reward_curve()) == 6, 30, what="monitor")
        # the consumers stop and their committed offsets go back to 0, as after a crash between a
        # durable insert and the offset commit: on restart Kafka hands them everything again
        for svc in ("replay", "monitor"):
            launcher.stop_service(svc, kill=True)
        _rewind(state.kafka_bootstrap, "temper-replay")
        _rewind(state.kafka_bootstrap, "temper-monitor")
        for svc in ("replay", "monitor"):
            launcher.start_service(svc)
        sentinel = redelivered(99)
        producer.send(kafka.SCORED, sentinel.group_id, sentinel).get(10)
        wait_until(lambda: replay.stats().inserts == 7, 60, what="sentinel insert")
        s = replay.stats()
        assert (s.inserts, s.size, s.duplicates) == (7, 7, 6)  # the 6 came again and were recognised
        # the monitor keeps its curve in memory: after a restart it rebuilds it from the redelivered
        # groups, each counted once
        wait_until(lambda: sum(p.samples for p in monitor.reward_curve()) == 7, 30, what="monitor")
        producer.close()
    finally:
        launcher.down()
