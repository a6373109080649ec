"""Sandbox benchmark (`make bench`): the service vs the same programs as bare subprocesses.

Workloads: (a) a trivial Python program; (b) a realistic solution checked by 20 assertions
(through the tamper-proof harness; bare: the solution and the assertions in one file).
Isolated mode (a fresh gVisor sandbox per program): Execute for (a), RunTests for (b); warm
latency (one call at a time, the pool refilled between calls), back-to-back latency, throughput
at concurrency = CPU cores. Batch mode (a fresh gVisor sandbox per group): RunTestsBatch of a
GRPO-sized group of GROUP programs, CORES callers at once; executions/s counts programs; plus
the warm latency of a single program (a group of one). CPU per execution: the service with
every sandbox process it reaped (bare: the subprocesses), which depends less than wall time on
what else loads the machine.
Goals (issue 13): warm p50 of (a) under 100 ms; executions/s of (b) at least half of bare at
the same concurrency.
"""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from temper.v1 import sandbox_pb2
from tests.sandbox.helpers import client as sandbox_client
from tests.sandbox.helpers import start_sandbox

pytestmark = pytest.mark.bench

TRIVIAL = "print('hello')\n"

SOLUTION = '''
import collections


def longest_palindrome(s: str) -> str:
    best = ""
    for center in range(2 * len(s) - 1):
        lo, hi = center // 2, center // 2 + center % 2
        while lo >= 0 and hi < len(s) and s[lo] == s[hi]:
            lo -= 1
            hi += 1
        if hi - lo - 1 > len(best):
            best = s[lo + 1:hi]
    return best


def top_k(words, k):
    counts = collections.Counter(words)
    return sorted(counts, key=lambda w: (-counts[w], w))[:k]


def fib(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
'''

ASSERTIONS = '''
assert longest_palindrome("babad") in ("bab", "aba")
assert longest_palindrome("cbbd") == "bb"
assert longest_palindrome("a") == "a"
assert longest_palindrome("racecar") == "racecar"
assert longest_palindrome("forgeeksskeegfor") == "geeksskeeg"
assert longest_palindrome("abacdfgdcaba") == "aba"
assert longest_palindrome("x" * 300) == "x" * 300
assert longest_palindrome("abb") == "bb"
assert fib(0) == 0
assert fib(1) == 1
assert fib(10) == 55
assert fib(50) == 12586269025
assert fib(90) == 2880067194370816120
assert fib(20) == 6765
assert top_k(["a", "b", "a"], 1) == ["a"]
assert top_k(["i", "love", "leetcode", "i", "love", "coding"], 2) == ["i", "love"]
assert top_k(["the", "day", "is", "sunny", "the", "the", "the", "sunny", "is", "is"], 4) == ["the", "is", "sunny", "day"]
assert top_k([], 3) == []
assert top_k(["z"], 5) == ["z"]
assert sorted(top_k(list("abcabc"), 3)) == ["a", "b", "c"]
'''

CORES = os.cpu_count() or 2
GROUP = 16  # programs per RunTestsBatch call: a GRPO group


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def process_cpu_seconds(pid: int) -> float:
    """CPU of ``pid`` and of the children it reaped (for the service: every sandbox's runsc processes)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure(call, n: int, concurrency: int, pause: float = 0.0, cpu=children_cpu_seconds, per_call: int = 1) -> dict:
    """Run ``call`` n times on ``concurrency`` threads; latencies in ms (per call), throughput in
    executions/s and CPU ms per execution (a call is ``per_call`` executions)."""
    def timed(_):
        t0 = time.perf_counter()
        call()
        latency = time.perf_counter() - t0
        if pause:
            time.sleep(pause)
        return latency

    cpu0, t0 = cpu(), time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        latencies = list(pool.map(timed, range(n)))
    wall = time.perf_counter() - t0 - (pause * n / concurrency if pause else 0)
    return {"n": n * per_call, "per_s": n * per_call / wall, "p50": statistics.median(latencies) * 1000,
            "p99": percentile(latencies, 0.99) * 1000, "cpu_ms": (cpu() - cpu0) / (n * per_call) * 1000}


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    svc = start_sandbox(tmp_path_factory.mktemp("bench"), "--max-concurrency", str(CORES), "--max-queue", "16")
    yield svc
    svc.stop()


@pytest.fixture(scope="module")
def batch_service(tmp_path_factory):
    svc = start_sandbox(tmp_path_factory.mktemp("bench-batch"), "--max-concurrency", str(CORES), "--max-queue", "16",
                        "--execution-mode", "batch")
    yield svc
    svc.stop()


def test_sandbox_bench(service, batch_service):
    workdir = Path(tempfile.mkdtemp())
    (workdir / "trivial.py").write_text(TRIVIAL)
    (workdir / "solution.py").write_text(SOLUTION + "\n" + ASSERTIONS)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}

    def bare(name):
        def call():
            p = subprocess.run(["python3", name], cwd=workdir, env=env, capture_output=True)
            assert p.returncode == 0, p.stderr
        return call

    client = sandbox_client(service)

    def trivial():
        r = client.execute(TRIVIAL, wall_seconds=10)
        assert r.verdict == sandbox_pb2.VERDICT_OK and r.stdout == b"hello\n", r

    def realistic():
        r = client.run_tests(SOLUTION, [ASSERTIONS], wall_seconds=10)
        assert r.passed == 1, r

    batch_client = sandbox_client(batch_service)

    def trivial_batch():
        r = batch_client.run_tests_batch([TRIVIAL] * GROUP, [{"stdin": "", "expected_stdout": "hello"}],
                                         wall_seconds=10)
        assert r.execution_mode == "batch" and all(x.passed == 1 for x in r.results), r

    def realistic_batch():
        r = batch_client.run_tests_batch([SOLUTION] * GROUP, [ASSERTIONS], wall_seconds=10)
        assert r.execution_mode == "batch" and all(x.passed == 1 for x in r.results), r

    def trivial_one():
        r = batch_client.execute(TRIVIAL, wall_seconds=10)
        assert r.verdict == sandbox_pb2.VERDICT_OK and r.stdout == b"hello\n", r

    def realistic_one():
        r = batch_client.run_tests(SOLUTION, [ASSERTIONS], wall_seconds=10)
        assert r.passed == 1, r

    # warm-up: imports, page cache, pools
    for call in (trivial, realistic, trivial, realistic, trivial_batch, realistic_batch, trivial_one, realistic_one):
        call()
    load_before = " ".join(f"{x:.1f}" for x in os.getloadavg())
    rows = []

    def service_cpu():
        return process_cpu_seconds(service.proc.pid)

    def batch_cpu():
        return process_cpu_seconds(batch_service.proc.pid)

    for label, sandboxed, one, grouped, bare_call in (
            ("(a) trivial python", trivial, trivial_one, trivial_batch, bare("trivial.py")),
            ("(b) solution + 20 asserts", realistic, realistic_one, realistic_batch, bare("solution.py"))):
        rows.append((label, "bare", 1, measure(bare_call, 30, 1)))
        rows.append((label, "isolated warm", 1, measure(sandboxed, 30, 1, pause=0.6, cpu=service_cpu)))
        rows.append((label, "isolated back-to-back", 1, measure(sandboxed, 30, 1, cpu=service_cpu)))
        rows.append((label, "batch warm (group of 1)", 1, measure(one, 30, 1, pause=0.6, cpu=batch_cpu)))
        rows.append((label, "bare", CORES, measure(bare_call, 60, CORES)))
        rows.append((label, "isolated", CORES, measure(sandboxed, 60, CORES, cpu=service_cpu)))
        rows.append((label, f"batch (groups of {GROUP})", CORES,
                     measure(grouped, 8, CORES, cpu=batch_cpu, per_call=GROUP)))
    client.close()
    batch_client.close()

    print(f"\nsandbox benchmark ({CORES} cores, runsc ptrace; isolated: a fresh gVisor sandbox per program, "
          f"batch: per group of {GROUP}; load average before: {load_before})")
    print(f"{'workload':<28}{'mode':<26}{'conc':>5}{'n':>5}{'exec/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'CPU ms/exec':>13}")
    for label, mode, conc, m in rows:
        print(f"{label:<28}{mode:<26}{conc:>5}{m['n']:>5}{m['per_s']:>9.1f}{m['p50']:>9.1f}{m['p99']:>9.1f}"
              f"{m['cpu_ms']:>13.0f}")
    print("(p50/p99 are per call: in batch rows a call is a whole group)")
    for label in ("(a) trivial python", "(b) solution + 20 asserts"):
        get = {(mode, conc): m for m_label, mode, conc, m in rows if m_label == label}
        bare_rate, bare_cpu = get[("bare", CORES)]["per_s"], get[("bare", CORES)]["cpu_ms"]
        grouped = get[(f"batch (groups of {GROUP})", CORES)]
        print(f"{label}: warm p50 isolated {get[('isolated warm', 1)]['p50']:.0f} ms, batch (group of 1) "
              f"{get[('batch warm (group of 1)', 1)]['p50']:.0f} ms; executions/s vs bare at concurrency {CORES}: "
              f"isolated {get[('isolated', CORES)]['per_s'] / bare_rate:.2f}, "
              f"batch {grouped['per_s'] / bare_rate:.2f}; CPU per execution vs bare: "
              f"isolated {get[('isolated', CORES)]['cpu_ms'] / bare_cpu:.1f}x, batch {grouped['cpu_ms'] / bare_cpu:.1f}x")
