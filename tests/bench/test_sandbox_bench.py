"""Sandbox benchmark (`make bench`): the service vs the same programs as bare subprocesses.

Workloads: (a) a trivial Python program (Execute); (b) a realistic solution checked by 20
assertions (RunTests with one assertion script, through the tamper-proof harness; bare: the
solution and the assertions in one file). For each: warm latency (one call at a time, the pool
refilled between calls), back-to-back latency, throughput at concurrency = CPU cores, and CPU
per call (the service with every sandbox process it reaped; bare: the subprocesses), which does
not depend on what else loads the machine.
Goals (issue 3): warm p50 of (a) under 100 ms; throughput of (b) at least half of bare.
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


def measure(call, n: int, concurrency: int, pause: float = 0.0, cpu=children_cpu_seconds) -> dict:
    """Run ``call`` n times on ``concurrency`` threads; latencies in ms, throughput in calls/s, CPU ms per call."""
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
    return {"n": n, "per_s": n / wall, "p50": statistics.median(latencies) * 1000,
            "p99": percentile(latencies, 0.99) * 1000, "cpu_ms": (cpu() - cpu0) / n * 1000}


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    svc = start_sandbox(tmp_path_factory.mktemp("bench"), "--max-concurrency", str(CORES), "--max-queue", "16")
    yield svc
    svc.stop()


def test_sandbox_bench(service):
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

    for call in (trivial, realistic, trivial, realistic):  # warm-up: imports, page cache, pool
        call()
    load_before = " ".join(f"{x:.1f}" for x in os.getloadavg())
    rows = []
    def service_cpu():
        return process_cpu_seconds(service.proc.pid)

    for label, sandboxed, bare_call in (("(a) trivial python", trivial, bare("trivial.py")),
                                        ("(b) solution + 20 asserts", realistic, bare("solution.py"))):
        rows.append((label, "bare", 1, measure(bare_call, 30, 1)))
        rows.append((label, "sandbox warm", 1, measure(sandboxed, 30, 1, pause=0.6, cpu=service_cpu)))
        rows.append((label, "sandbox back-to-back", 1, measure(sandboxed, 30, 1, cpu=service_cpu)))
        rows.append((label, "bare", CORES, measure(bare_call, 60, CORES)))
        rows.append((label, "sandbox", CORES, measure(sandboxed, 60, CORES, cpu=service_cpu)))
    client.close()

    print(f"\nsandbox benchmark ({CORES} cores, runsc ptrace, one fresh gVisor sandbox per call; "
          f"load average before: {load_before})")
    print(f"{'workload':<28}{'mode':<22}{'conc':>5}{'n':>5}{'calls/s':>10}{'p50 ms':>9}{'p99 ms':>9}{'CPU ms/call':>13}")
    for label, mode, conc, m in rows:
        print(f"{label:<28}{mode:<22}{conc:>5}{m['n']:>5}{m['per_s']:>10.1f}{m['p50']:>9.1f}{m['p99']:>9.1f}"
              f"{m['cpu_ms']:>13.0f}")
    for label in ("(a) trivial python", "(b) solution + 20 asserts"):
        get = {(m_label, mode, conc): m for m_label, mode, conc, m in rows if m_label == label}
        ratio = get[(label, "sandbox", CORES)]["per_s"] / get[(label, "bare", CORES)]["per_s"]
        warm = get[(label, "sandbox warm", 1)]["p50"]
        print(f"{label}: warm p50 {warm:.0f} ms; throughput at concurrency {CORES}: sandbox/bare = {ratio:.2f}")
