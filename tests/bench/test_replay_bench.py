"""Replay throughput and latency, against a raw gRPC echo of the same payloads in the same run.

Items are GRPO groups of 4 trajectories of 2,048 completion tokens (~56 KB serialized). Both
servers run as separate processes; the client is the same for both and sends pre-serialized
requests and keeps responses as bytes, so the ratio isolates what the replay server adds
(validation, SQLite commit with fsync, sampling bookkeeping) over moving the bytes through gRPC:

- insert: client-streamed Insert calls of 32 groups; replay answers after the commit;
- sample: Sample of 16 groups from a uniform table (draws persisted per call) and from the
  learner's FIFO sample-once table (groups removed durably per call); the echo returns a
  pre-encoded SampleResponse of 16 such groups;
- p99 Sample latency while another client inserts at a steady rate.

Run with ``make bench`` (or ``pytest -q -s -m bench tests/bench/test_replay_bench.py``).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from temper.runtime.broker import free_port, wait_for_port
from temper.v1 import replay_pb2

TOKENS, TRAJECTORIES, BATCH, INSERT_CALL = 2048, 4, 16, 32
SERVICE = "/temper.v1.ReplayService/"
OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
CONFIG = """
[replay]
ingest_tables = []
max_concurrent_rpcs = 8

[replay.tables.uniform]
sampler = "uniform"
max_times_sampled = 0
seed = 0

[replay.tables.fifo]
sampler = "fifo"
max_times_sampled = 1

[replay.tables.steady]
sampler = "uniform"
max_times_sampled = 0
max_size = 4096
"""


def group_bytes(gid: str, seed: int) -> bytes:
    import numpy as np

    from temper.v1 import common_pb2

    rng = np.random.default_rng(seed)
    g = common_pb2.RolloutGroup(group_id=gid, job_id="bench", task=common_pb2.Task(domain="math", prompt="p" * 256))
    for k in range(TRAJECTORIES):
        t = g.trajectories.add(trajectory_id=f"{gid}/{k}", group_id=gid, policy_version=1,
                               prompt_token_ids=rng.integers(0, 50_000, 128).tolist(),
                               completion_token_ids=rng.integers(0, 50_000, TOKENS).tolist(),
                               completion_logprobs=(-rng.random(TOKENS)).tolist(), finish_reason="length")
        t.reward.total, t.reward.status = 1.0, common_pb2.REWARD_STATUS_OK
    return g.SerializeToString()


def insert_requests(table: str, prefix: str, n: int) -> list[bytes]:
    """Serialized InsertRequests (table + group)."""
    from temper.v1 import common_pb2

    return [replay_pb2.InsertRequest(table=table, group=common_pb2.RolloutGroup.FromString(
        group_bytes(f"{prefix}{i}", i % 8))).SerializeToString() for i in range(n)]


# -- the raw echo server (run as a separate process: python this_file.py echo PORT) ------------------
def serve_echo(port: int) -> None:
    from temper.v1 import common_pb2

    sample_response = replay_pb2.SampleResponse(groups=[
        common_pb2.RolloutGroup.FromString(group_bytes(f"echo{i}", i % 8)) for i in range(BATCH)]).SerializeToString()

    def insert(request_iterator, context):
        n = sum(1 for _ in request_iterator)
        return replay_pb2.InsertResponse(inserted=n).SerializeToString()

    def sample(request, context):
        return sample_response

    ident = bytes
    handlers = {"Insert": grpc.stream_unary_rpc_method_handler(insert, request_deserializer=ident,
                                                                response_serializer=ident),
                "Sample": grpc.unary_unary_rpc_method_handler(sample, request_deserializer=ident,
                                                              response_serializer=ident)}
    server = grpc.server(futures.ThreadPoolExecutor(8), options=OPTIONS)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("temper.v1.ReplayService", handlers),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


# -- measurement ----------------------------------------------------------------------------------
class Raw:
    """The same raw client for both servers: pre-serialized requests, responses kept as bytes."""

    def __init__(self, address: str):
        self.channel = grpc.insecure_channel(address, options=OPTIONS)
        ident = bytes
        self.insert = self.channel.stream_unary(SERVICE + "Insert", request_serializer=ident, response_deserializer=ident)
        self.sample = self.channel.unary_unary(SERVICE + "Sample", request_serializer=ident, response_deserializer=ident)


def measure_inserts(client: Raw, requests: list[bytes]) -> tuple[float, float]:
    t0 = time.perf_counter()
    for k in range(0, len(requests), INSERT_CALL):
        client.insert(iter(requests[k:k + INSERT_CALL]), timeout=120)
    dt = time.perf_counter() - t0
    return len(requests) / dt, sum(map(len, requests)) / dt / 1e6


def measure_samples(client: Raw, table: str, calls: int) -> tuple[float, float]:
    req = replay_pb2.SampleRequest(table=table, batch_size=BATCH, timeout_ms=10_000).SerializeToString()
    nbytes = 0
    t0 = time.perf_counter()
    for _ in range(calls):
        nbytes += len(client.sample(req, timeout=60))
    dt = time.perf_counter() - t0
    return calls * BATCH / dt, nbytes / dt / 1e6


def start(args: list[str], port: int, log: Path, env: dict | None = None) -> subprocess.Popen:
    with open(log, "ab") as f:
        proc = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env={**os.environ, **(env or {})})
    wait_for_port("127.0.0.1", port, 60)
    return proc


def interleaved(replay_run, echo_run, repeats: int = 3):
    """Alternate replay and echo runs (the machine is shared: load comes and goes) and keep the
    best of each; returns (replay (items/s, MB/s), echo (items/s, MB/s), median of paired ratios)."""
    pairs = [(replay_run(), echo_run()) for _ in range(repeats)]
    r = max((p[0] for p in pairs), key=lambda x: x[0])
    e = max((p[1] for p in pairs), key=lambda x: x[0])
    return r, e, statistics.median(p[0][0] / p[1][0] for p in pairs)


def throughput(r: Raw, e: Raw) -> list[tuple]:
    n = 8 * INSERT_CALL
    lines = []
    # insert: new groups each run; the first run fills the uniform table, the others the FIFO one
    tables = iter(["uniform", "fifo", "fifo"])
    lines.append(("insert", *interleaved(
        lambda: measure_inserts(r, insert_requests(table := next(tables), f"{table}{time.monotonic_ns()}-", n)),
        lambda: measure_inserts(e, insert_requests("fifo", "e", n)))))
    # sample with replacement from the uniform table (256 groups): draws kept in memory, written lazily
    lines.append(("sample uniform", *interleaved(lambda: measure_samples(r, "uniform", 40),
                                                 lambda: measure_samples(e, "uniform", 40))))
    # the learner's path: FIFO sample-once, each call removes its groups durably (3 runs drain 3 * n)
    measure_inserts(r, insert_requests("fifo", f"more{time.monotonic_ns()}-", n))
    lines.append(("sample fifo-once", *interleaved(lambda: measure_samples(r, "fifo", n // BATCH),
                                                   lambda: measure_samples(e, "fifo", n // BATCH))))
    return lines


def latency_under_inserts(address: str, seconds: float = 6.0, rate: float = 50.0) -> tuple[float, float, float, int]:
    """Sample(16) latencies while another client inserts one group per call at ``rate`` groups/s;
    returns (p50 s, p99 s, achieved insert rate, calls)."""
    r = Raw(address)
    r.insert(iter(insert_requests("steady", f"pre{time.monotonic_ns()}-", 64)), timeout=60)
    steady = insert_requests("steady", f"s{time.monotonic_ns()}-", int(seconds * rate) + 50)
    stop, inserted = threading.Event(), [0]

    def steady_inserter():
        client, t0 = Raw(address), time.perf_counter()
        for k, req in enumerate(steady):
            if stop.is_set():
                return
            client.insert(iter([req]), timeout=60)
            inserted[0] += 1
            time.sleep(max(0.0, t0 + (k + 1) / rate - time.perf_counter()))

    th = threading.Thread(target=steady_inserter)
    th.start()
    req = replay_pb2.SampleRequest(table="steady", batch_size=BATCH, timeout_ms=10_000).SerializeToString()
    latencies, t_start = [], time.perf_counter()
    while time.perf_counter() < t_start + seconds:
        t0 = time.perf_counter()
        r.sample(req, timeout=60)
        latencies.append(time.perf_counter() - t0)
        time.sleep(0.01)
    elapsed = time.perf_counter() - t_start
    stop.set()
    th.join(30)
    latencies.sort()
    return statistics.median(latencies), latencies[int(0.99 * (len(latencies) - 1))], inserted[0] / elapsed, len(latencies)


@pytest.mark.bench
def test_replay_throughput_and_latency_vs_raw_grpc(tmp_path):
    cfg = tmp_path / "temper.toml"
    cfg.write_text(CONFIG)
    procs = []
    try:
        ports = {}
        for mode, fsync in (("fsync", "true"), ("no fsync", "false")):
            ports[mode] = free_port()
            procs.append(start([sys.executable, "-m", "temper.replay", "--config", str(cfg), "--port", str(ports[mode]),
                                "--metrics-port", "-1", "--data-dir", str(tmp_path / f"data-{fsync}")], ports[mode],
                               tmp_path / f"replay-{fsync}.log", env={"TEMPER_REPLAY_FSYNC": fsync}))
        eport = free_port()
        procs.append(start([sys.executable, __file__, "echo", str(eport)], eport, tmp_path / "echo.log"))
        time.sleep(1.0)  # every server finished importing
        e = Raw(f"127.0.0.1:{eport}")
        print(f"\nreplay vs raw gRPC echo, groups of {TRAJECTORIES} x {TOKENS} tokens "
              f"({len(group_bytes('x', 0)) / 1e3:.0f} KB), best of 3 interleaved runs")
        for mode, port in ports.items():
            lines = throughput(Raw(f"127.0.0.1:{port}"), e)
            p50, p99, rate, calls = latency_under_inserts(f"127.0.0.1:{port}")
            print(f" durability: {mode} ({'survives power loss' if mode == 'fsync' else 'survives kill -9 only'})")
            for name, (items, mb), (e_items, e_mb), paired in lines:
                print(f"  {name:<17} replay {items:7.0f} groups/s {mb:6.1f} MB/s | echo {e_items:7.0f} groups/s "
                      f"{e_mb:6.1f} MB/s | ratio {items / e_items:.2f} (median paired {paired:.2f})")
            print(f"  Sample({BATCH}) latency with {rate:.0f} inserts/s running: p50 {p50 * 1e3:.1f} ms, "
                  f"p99 {p99 * 1e3:.1f} ms over {calls} calls")
            assert all(items > 0 for _, (items, _), _, _ in lines)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


if __name__ == "__main__" and sys.argv[1:2] == ["echo"]:
    serve_echo(int(sys.argv[2]))
