"""Backpressure of every service (``max_concurrent_rpcs``), on a real replay service: calls past the limit
are refused at once with RESOURCE_EXHAUSTED and retry advice, probes are answered however busy it is,
and the SDK's channels come back after the advised delay."""

from __future__ import annotations

import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from temper.client.sdk import ReplayClient
from temper.runtime.rpc import check_health
from temper.v1 import replay_pb2
from tests.conftest import spawn_service, wait_until

pytestmark = pytest.mark.slow  # starts a service


@pytest.fixture
def replay(broker, tmp_path):
    handle = spawn_service("replay", tmp_path, "--max-concurrent-rpcs", "2", "--kafka-bootstrap", broker)
    yield handle
    handle.stop()


def plain(address: str) -> ReplayClient:
    """A client without the SDK's retry policy: it sees each refusal."""
    return ReplayClient(address, channel=grpc.insecure_channel(address))


def long_poll(address: str, wait_ms: int) -> str:
    """A Sample of an empty table: holds a call slot for ``wait_ms``; returns the status it ended with."""
    with plain(address) as c:
        try:
            c.stub.Sample(replay_pb2.SampleRequest(table="default", batch_size=1, timeout_ms=wait_ms), timeout=30)
            return "OK"
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                advice = dict(e.trailing_metadata() or ()).get("grpc-retry-pushback-ms")
                return f"RESOURCE_EXHAUSTED {e.details().split(':')[0]} {250 <= int(advice) < 500}"
            return e.code().name


def test_calls_past_the_limit_are_refused_with_retry_advice_and_probes_still_answered(replay):
    with ThreadPoolExecutor(6) as pool:
        holds = [pool.submit(long_poll, replay.address, 3000) for _ in range(2)]
        wait_until(lambda: in_flight(replay) == 2, what="both slots held")
        refused = list(pool.map(lambda _: long_poll(replay.address, 3000), range(4)))
        # a probe needs no slot: answered at once while every slot is taken
        t0 = time.monotonic()
        assert check_health(replay.address, timeout=2.0) == "SERVING"
        probe_seconds = time.monotonic() - t0
        assert not any(h.done() for h in holds), "the held calls ended before the check: it proved nothing"
        held = [h.result() for h in holds]
    assert refused == ["RESOURCE_EXHAUSTED max_concurrent_rpcs True"] * 4, refused
    assert held == ["DEADLINE_EXCEEDED"] * 2, held  # an empty table's long-poll: it ran to its end
    assert probe_seconds < 1.0, probe_seconds
    # every slot is given back: calls are admitted again
    with plain(replay.address) as c:
        assert c.stats().table == "default"


def test_the_sdk_retries_a_refused_call_after_the_advised_delay(replay):
    """Both slots held for 0.4 s; the SDK's call is refused, waits the pushback (250-500 ms, up to four times)
    and gets through once a slot is free."""
    with ThreadPoolExecutor(2) as pool:
        holds = [pool.submit(long_poll, replay.address, 400) for _ in range(2)]
        wait_until(lambda: in_flight(replay) == 2 or all(h.done() for h in holds), what="both slots held")
        assert not all(h.done() for h in holds), "the holds ended before the SDK's call"
        with ReplayClient(replay.address) as c:
            stats = c.stats()
        assert stats.table == "default" and [h.result() for h in holds] == ["DEADLINE_EXCEEDED"] * 2
    shed = scrape(replay.metrics_port, 'temper_rpc_shed_total{method="/temper.v1.ReplayService/Stats"}')
    assert shed >= 1, "the SDK's call was never refused: the test did not exercise the retry"


def in_flight(service) -> float:
    return scrape(service.metrics_port, "temper_rpc_in_flight")


def scrape(port: int, series: str) -> float:
    """One series' value from the service's Prometheus endpoint (0 when absent)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return 0.0
