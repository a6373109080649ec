"""Tracing overhead (`make bench`): the same real work with tracing off and on, measured in one run.

Service row: three replay services (``python -m temper.replay``, started by ``spawn_service``) that
differ only in the common config's tracing keys:

- off: the default (no ``trace_file``, no ``otlp_endpoint``): the SDK provider still records each
  span, then drops it;
- ``trace_file``: spans appended as JSON lines, batched (BatchSpanProcessor) to a writer thread;
- ``otlp_endpoint``: spans batched (BatchSpanProcessor) to an OTLP/gRPC receiver in this process on
  127.0.0.1 port 0 (``TraceServiceServicer``, counting what it gets).

One untraced client (the SDK's ``ReplayClient``) calls Sample(4) of tiny groups from a uniform table,
one call at a time. Rounds alternate the modes (the order rotates each round: the machine is shared
and its load comes and goes); a mode's figures are medians over rounds (calls/s, p50, p99) and its
ratio is the median of the per-round ratios against off. Sample is one of the cheapest real RPCs
(no disk write), so the ratio bounds what tracing adds to a heavier call. Each call makes one span,
the grpc instrumentation's server span; the services' own spans (``scheduler.step``,
``learner.step``, ``consume``) come once per step or message, not per RPC.

Span row: the in-process cost of one span (``start_as_current_span`` with 4 attributes, ended) on a
no-op tracer and on the providers a service builds (``tracing.build_provider``) for each mode.

Run with ``make bench`` (or ``pytest -q -s -m bench tests/bench/test_tracing_bench.py``);
``TEMPER_TRACE_BENCH_ROUNDS`` / ``TEMPER_TRACE_BENCH_CALLS`` change the rounds and calls per round.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from collections import Counter
from concurrent import futures

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from temper.client.sdk import ReplayClient
from temper.runtime.tracing import build_provider
from tests.builders import scored_group
from tests.conftest import spawn_service, wait_until

pytestmark = pytest.mark.bench

ROUNDS = int(os.environ.get("TEMPER_TRACE_BENCH_ROUNDS", "5"))
CALLS = int(os.environ.get("TEMPER_TRACE_BENCH_CALLS", "400"))
WARMUP, BATCH, SAMPLE_SPAN = 100, 4, "/temper.v1.ReplayService/Sample"
CONFIG = """
[replay]
ingest_tables = []
fsync = false

[replay.tables.uniform]
sampler = "uniform"
max_times_sampled = 0
seed = 0
"""


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector that counts the spans it receives, by name."""

    def __init__(self):
        self.spans: Counter[str] = Counter()
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(2, thread_name_prefix="otlp-receiver"))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def Export(self, request, context):  # noqa: N802 - the generated servicer's name
        names = [s.name for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans]
        with self._lock:
            self.spans.update(names)
        return trace_service_pb2.ExportTraceServiceResponse()

    def count(self, name: str) -> int:
        with self._lock:
            return self.spans[name]

    def stop(self) -> None:
        self.server.stop(0).wait()


def span_names(path) -> Counter[str]:
    with open(path) as f:
        return Counter(json.loads(line)["name"] for line in f if line.strip())


def sample_round(client: ReplayClient, calls: int) -> tuple[float, float, float]:
    """``calls`` Sample(BATCH) calls one after another: (calls/s, p50 s, p99 s)."""
    latencies = []
    t_start = time.perf_counter()
    for _ in range(calls):
        t0 = time.perf_counter()
        groups = client.sample(BATCH, table="uniform", timeout_ms=5_000)
        latencies.append(time.perf_counter() - t0)
        assert len(groups) == BATCH
    elapsed = time.perf_counter() - t_start
    latencies.sort()
    return calls / elapsed, latencies[len(latencies) // 2], latencies[int(0.99 * (len(latencies) - 1))]


def test_tracing_overhead_on_a_real_rpc(tmp_path):
    cfg = tmp_path / "temper.toml"
    cfg.write_text(CONFIG)
    trace_file = tmp_path / "replay.spans.jsonl"
    receiver = Receiver()
    modes = {"off": (), "trace_file": ("--trace-file", str(trace_file)),
             "otlp": ("--otlp-endpoint", receiver.address)}
    services, clients = {}, {}
    try:
        for mode, args in modes.items():
            services[mode] = spawn_service("replay", tmp_path / mode, "--config", str(cfg), *args)
            clients[mode] = ReplayClient(services[mode].address)
            clients[mode].insert([scored_group(f"g{i}", n=2, tokens=16, seed=i) for i in range(64)], table="uniform")
            sample_round(clients[mode], WARMUP)
        names = list(modes)
        rounds: dict[str, list[tuple[float, float, float]]] = {m: [] for m in names}
        for r in range(ROUNDS):
            for mode in names[r % len(names):] + names[:r % len(names)]:
                rounds[mode].append(sample_round(clients[mode], CALLS))
        # every Sample call made exactly one server span, and each traced mode exported all of them
        expected = WARMUP + ROUNDS * CALLS
        wait_until(lambda: receiver.count(SAMPLE_SPAN) >= expected, timeout=30, what="the OTLP batch export")
        assert receiver.count(SAMPLE_SPAN) == expected
        wait_until(lambda: span_names(trace_file)[SAMPLE_SPAN] >= expected, timeout=30, what="the trace file")
        assert span_names(trace_file)[SAMPLE_SPAN] == expected
    finally:
        for client in clients.values():
            client.close()
        for handle in services.values():
            handle.stop()
        receiver.stop()
    print(f"\ntracing overhead, replay Sample({BATCH}) of tiny groups over loopback, one call at a time: "
          f"{ROUNDS} rounds x {CALLS} calls per mode, order rotating; medians over rounds")
    for mode in names:
        rate = statistics.median(x[0] for x in rounds[mode])
        p50 = statistics.median(x[1] for x in rounds[mode])
        p99 = statistics.median(x[2] for x in rounds[mode])
        ratio = statistics.median(a[0] / b[0] for a, b in zip(rounds[mode], rounds["off"]))
        print(f"  {mode:<10} {rate:7.0f} calls/s  p50 {p50 * 1e3:6.2f} ms  p99 {p99 * 1e3:6.2f} ms  "
              f"calls/s vs off {ratio:.2f} (rounds: {', '.join(f'{x[0]:.0f}' for x in rounds[mode])})")


def test_cost_of_one_span(tmp_path):
    receiver = Receiver()
    n = 5_000
    providers = {"sdk, no export": build_provider("bench"),
                 "sdk + trace_file": build_provider("bench", trace_file=str(tmp_path / "spans.jsonl")),
                 "sdk + otlp": build_provider("bench", otlp_endpoint=receiver.address)}
    tracers = {"no-op tracer": trace.NoOpTracer(), **{m: p.get_tracer("bench") for m, p in providers.items()}}
    attributes = {"temper.job_id": "bench", "temper.step": 7, "temper.group_id": "g0", "rpc.system": "grpc"}

    def spans(tracer) -> tuple[float, float]:
        """(CPU s, wall s) per span of the calling thread: on a busy machine the wall time also counts
        the time the thread waited for a core; the OTLP export thread's CPU is not counted."""
        c0, t0 = time.thread_time(), time.perf_counter()
        for _ in range(n):
            with tracer.start_as_current_span("bench.span", attributes=attributes):
                pass
        return (time.thread_time() - c0) / n, (time.perf_counter() - t0) / n

    try:
        names = list(tracers)
        per_span: dict[str, list[tuple[float, float]]] = {m: [] for m in names}
        for r in range(ROUNDS + 1):  # round 0 warms up
            for mode in names[r % len(names):] + names[:r % len(names)]:
                cost = spans(tracers[mode])
                if r:
                    per_span[mode].append(cost)
        for p in providers.values():
            p.force_flush()
        written = span_names(tmp_path / "spans.jsonl")["bench.span"]
        exported = receiver.count("bench.span")
    finally:
        for p in providers.values():
            p.shutdown()
        receiver.stop()
    made = (ROUNDS + 1) * n
    assert 0 < written <= made  # both batch: a burst beyond the queue is dropped (the SDK warns)
    assert 0 < exported <= made
    base = statistics.median(c for c, _ in per_span["no-op tracer"])
    print(f"\ncost of one span (start + 4 attributes + end, in-process), {ROUNDS} interleaved rounds x {n} spans, "
          f"medians; CPU of the calling thread (wall)")
    for mode in names:
        cpu = statistics.median(c for c, _ in per_span[mode])
        wall = statistics.median(w for _, w in per_span[mode])
        print(f"  {mode:<17} {cpu * 1e6:6.2f} us/span CPU ({wall * 1e6:6.2f} wall)  {cpu / base:5.1f}x the no-op tracer")
    print(f"  trace_file wrote {written} of {made} spans; otlp exported {exported} of {made} "
          f"(a full batch queue drops spans: {made - written} / {made - exported} dropped)")
