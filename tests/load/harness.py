"""Sustained load of concurrent SDK clients against one running service.

``run_load`` first measures one client alone (the baseline, the same calls, same run), then ``clients``
threads, each with its own SDK client (the shipped retry policy: a refusal comes back after the advised
delay), call as fast as they can for ``seconds``. Meanwhile a prober checks health every 0.25 s and the
service's RSS is read from /proc every 0.25 s. Outcomes per call: ``ok``, ``shed`` (RESOURCE_EXHAUSTED that
outlived the SDK's retries: the service said "busy" and the caller gave up) or an error (any other
status: never expected).
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import grpc

from temper.runtime.rpc import check_health


@dataclass
class LoadResult:
    service: str
    clients: int
    seconds: float
    calls: int = 0
    ok: int = 0
    shed: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    error_examples: dict[str, str] = field(default_factory=dict)  # the details of the first error of each code
    calls_per_s: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    single_calls_per_s: float = 0.0  # one client alone, before the load
    single_p50_ms: float = 0.0
    probes: int = 0
    probes_not_serving: int = 0
    probe_max_ms: float = 0.0
    rss_mib_first_quarter: float = 0.0  # peak RSS over the first quarter of the load
    rss_mib_peak: float = 0.0
    rss_mib_last_quarter: float = 0.0  # peak RSS over the last quarter
    shed_by_server: int = 0  # refusals the service counted (temper_rpc_shed_total), retried ones included

    @property
    def error_rate(self) -> float:
        return sum(self.errors.values()) / max(self.calls, 1)

    @property
    def shed_rate(self) -> float:
        return self.shed / max(self.calls, 1)

    def row(self) -> str:
        return (f"{self.service}: {self.clients} clients x {self.seconds:.0f} s: {self.calls_per_s:.1f} calls/s "
                f"(one client alone {self.single_calls_per_s:.1f}), p50 {self.p50_ms:.1f} ms p99 {self.p99_ms:.1f} ms "
                f"(alone p50 {self.single_p50_ms:.1f}), shed {self.shed_rate:.1%} ({self.shed_by_server} refusals at the "
                f"server), errors {self.error_rate:.1%} {self.error_examples or ''}, probes {self.probes} "
                f"(max {self.probe_max_ms:.0f} ms, {self.probes_not_serving} not SERVING), RSS MiB "
                f"{self.rss_mib_first_quarter:.0f} -> {self.rss_mib_last_quarter:.0f} (peak {self.rss_mib_peak:.0f})")

    def as_dict(self) -> dict:
        return {**asdict(self), "error_rate": self.error_rate, "shed_rate": self.shed_rate}


def rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


_CALL_NUMBERS = itertools.count()  # next() is atomic in CPython: unique across threads and phases


def _calls(make_client: Callable[[], object], call: Callable[[object, int], None], seconds: float,
           stop: threading.Event, latencies: list[float], outcomes: Counter, examples: dict[str, str],
           lock: threading.Lock) -> None:
    client = make_client()
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not stop.is_set():
            n = next(_CALL_NUMBERS)
            t0 = time.perf_counter()
            try:
                call(client, n)
                outcome = "ok"
            except grpc.RpcError as e:
                outcome = "shed" if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else e.code().name
                examples.setdefault(outcome, (e.details() or "")[:300])
            elapsed = (time.perf_counter() - t0) * 1000
            with lock:
                outcomes[outcome] += 1
                if outcome == "ok":
                    latencies.append(elapsed)
    finally:
        client.close()


def _phase(make_client, call, clients: int, seconds: float) -> tuple[list[float], Counter, dict[str, str], float]:
    latencies: list[float] = []
    outcomes: Counter = Counter()
    examples: dict[str, str] = {}
    lock, stop = threading.Lock(), threading.Event()
    threads = [threading.Thread(target=_calls,
                                args=(make_client, call, seconds, stop, latencies, outcomes, examples, lock),
                                daemon=True) for _ in range(clients)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return latencies, outcomes, examples, time.monotonic() - t0


def run_load(service: str, address: str, pid: int, make_client: Callable[[], object],
             call: Callable[[object, int], None], clients: int, seconds: float, single_seconds: float = 3.0,
             shed_counter: Callable[[], float] | None = None) -> LoadResult:
    """``call(client, n)`` makes one call (``n`` unique across every call of the process, e.g. for ids)."""
    result = LoadResult(service, clients, seconds)
    single, single_outcomes, single_examples, single_wall = _phase(make_client, call, 1, single_seconds)
    assert single_outcomes["ok"] == sum(single_outcomes.values()), f"one client alone failed: {single_examples}"
    result.single_calls_per_s = single_outcomes["ok"] / single_wall
    result.single_p50_ms = _percentile(single, 50)
    shed_before = shed_counter() if shed_counter else 0.0

    samples: list[tuple[float, float]] = []  # (seconds since start, RSS MiB)
    probe_ms: list[float] = []
    not_serving = 0
    done = threading.Event()

    def watch():
        nonlocal not_serving
        start = time.monotonic()
        while not done.is_set():
            samples.append((time.monotonic() - start, rss_mib(pid)))
            t0 = time.perf_counter()
            if check_health(address, timeout=5.0) != "SERVING":
                not_serving += 1
            probe_ms.append((time.perf_counter() - t0) * 1000)
            done.wait(0.25)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    latencies, outcomes, examples, wall = _phase(make_client, call, clients, seconds)
    done.set()
    watcher.join()

    result.calls = sum(outcomes.values())
    result.ok, result.shed = outcomes["ok"], outcomes["shed"]
    result.errors = {k: v for k, v in outcomes.items() if k not in ("ok", "shed")}
    result.error_examples = {k: v for k, v in examples.items() if k in result.errors}
    result.calls_per_s = result.ok / wall
    result.p50_ms, result.p99_ms = _percentile(latencies, 50), _percentile(latencies, 99)
    result.probes, result.probes_not_serving = len(probe_ms), not_serving
    result.probe_max_ms = max(probe_ms, default=0.0)
    quarter = wall / 4
    result.rss_mib_peak = max((r for _, r in samples), default=0.0)
    result.rss_mib_first_quarter = max((r for t, r in samples if t <= quarter), default=0.0)
    result.rss_mib_last_quarter = max((r for t, r in samples if t >= wall - quarter), default=0.0)
    if shed_counter:
        result.shed_by_server = int(shed_counter() - shed_before)
    return result
