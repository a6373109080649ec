"""kill -9 of the replay process in the middle of ingest (Kafka and gRPC at once), then restart:
every acknowledged group is present exactly once, and none that was handed out is re-admitted."""

import threading
import time
from collections import Counter

import grpc
import pytest

from temper.client.sdk import ReplayClient
from temper.runtime import kafka
from temper.runtime.launcher import pid_alive
from tests.conftest import wait_until
from tests.builders import scored_group
from tests.replay.util import start_replay

pytestmark = pytest.mark.slow  # starts a broker and the replay service

CONFIG = """
[replay]
ingest_tables = ["default"]

[replay.tables.default]
sampler = "fifo"
max_times_sampled = 1
"""
N_KAFKA = 240


def test_kill_9_during_ingest_loses_nothing_and_readmits_nothing(tmp_path, replay_model_dir):
    launcher, pids = start_replay(tmp_path, replay_model_dir, CONFIG)
    state = launcher.load()
    address = state.services["replay"].address
    stop = threading.Event()
    acked_grpc: list[str] = []  # gRPC inserts the service answered OK: durable by contract
    failed_grpc: list[str] = []  # answered with an error (e.g. the process died): stored at most once
    errors: list[BaseException] = []

    def produce():  # a steady stream into `scored`; the broker acknowledges each (acks=all)
        try:
            producer = kafka.ProtoProducer(state.kafka_bootstrap, "crash-test")
            for i in range(N_KAFKA):
                g = scored_group(f"k{i}", n=4, tokens=64, seed=i)
                producer.send(kafka.SCORED, g.group_id, g).get(30)
                time.sleep(0.01)
            producer.close()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def insert_over_grpc():
        client = ReplayClient(address, timeout=5)
        i = 0
        while not stop.is_set():
            gid = f"r{i}"
            try:
                client.insert([scored_group(gid, n=4, tokens=64, seed=10_000 + i)])
                acked_grpc.append(gid)
            except grpc.RpcError:
                failed_grpc.append(gid)
                time.sleep(0.05)
            i += 1
        client.close()

    try:
        replay = ReplayClient(address, timeout=10)
        threads = [threading.Thread(target=produce), threading.Thread(target=insert_over_grpc)]
        for th in threads:
            th.start()
        wait_until(lambda: replay.stats().inserts >= 60, 60, what="ingest under way")
        handed_out = [g.group_id for g in replay.sample(20, timeout_ms=5000)]  # consumed before the crash
        launcher.stop_service("replay", kill=True)  # SIGKILL mid-ingest
        assert not pid_alive(pids[1])
        wait_until(lambda: failed_grpc, 30, what="a gRPC insert refused while replay is down")
        launcher.start_service("replay")
        acked_at_restart = len(acked_grpc)
        threads[0].join(120)  # the producer kept going through the crash; Kafka holds the backlog
        wait_until(lambda: len(acked_grpc) > acked_at_restart, 60, what="a gRPC insert acknowledged after the restart")
        stop.set()
        threads[1].join(60)
        assert not errors, errors
        assert failed_grpc, "no gRPC insert was in flight across the kill"

        # drain the table: FIFO, sample-once, so every stored group comes out exactly once
        drained: list[str] = []
        expected = {f"k{i}" for i in range(N_KAFKA)} | set(acked_grpc)

        def drain():
            size = replay.stats().size
            if size:
                drained.extend(g.group_id for g in replay.sample(size, timeout_ms=0))
            return expected <= set(drained) | set(handed_out)

        wait_until(drain, 120, interval=0.2, what="every acknowledged group back after the restart")
        everything = Counter(handed_out + drained)
        assert not [g for g, n in everything.items() if n > 1], "a group came out twice"
        assert not set(handed_out) & set(drained), "a consumed group was re-admitted"
        assert expected <= set(everything)  # nothing acknowledged was lost
        assert set(everything) - expected <= set(failed_grpc)  # the rest: unacknowledged, stored once or never
        s = replay.stats()
        print(f"\nacked gRPC {len(acked_grpc)}, failed gRPC {len(failed_grpc)}, handed out {len(handed_out)}, "
              f"redelivered duplicates {s.duplicates}")
        assert s.size == 0 and s.inserts == len(everything) and s.samples == len(everything)
    finally:
        stop.set()
        launcher.down()
    assert not pid_alive(pids[0])
