"""Where a sandbox execution's time goes (`make bench`): one sandbox's life, step by step.

Straight on the runsc backend (no gRPC), for each step: wall time and the host CPU of every
process of that sandbox (runsc, gofer, sentry and its ptrace stubs, from /proc), which is what
limits throughput on a loaded machine. Steps: boot (runsc + agent, with the warm interpreter or
the fork server started), a second of idling, file transfer, a run on the pre-started
interpreter (isolated mode) or forked from the fork server (batch mode), and a run that starts
a new interpreter (what every run without either would pay).
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import pytest

from temper.sandbox.config import SandboxConfig
from temper.sandbox.core import RUN_MODE, TEST_MODE, Limits, SourceFile
from temper.sandbox.runsc import RunscBackend
from tests.bench.test_sandbox_bench import ASSERTIONS, SOLUTION

pytestmark = pytest.mark.bench
TICK = os.sysconf("SC_CLK_TCK")
LIMITS = Limits(wall_seconds=10, cpu_seconds=10, memory_mb=512, max_processes=64, max_output_bytes=1 << 20)
ROUNDS = 5


def sandbox_cpu(sandbox) -> float:
    total = 0
    for pid in sandbox.cgroup.pids():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(x) for x in fields[11:15])
    return total / TICK


@pytest.mark.parametrize("mode", ["isolated", "batch"])
def test_sandbox_profile(tmp_path, mode):
    config = SandboxConfig(data_dir=str(tmp_path), execution_mode=mode)
    backend = RunscBackend(config.runsc_settings())
    harness = list(config.language_presets()["python3"].test_harness)
    steps: dict[str, list[tuple[float, float]]] = {}

    def step(name, sandbox, action, *args, **kwargs):
        c0, t0 = sandbox_cpu(sandbox) if sandbox else 0.0, time.perf_counter()
        value = action(*args, **kwargs)
        c1 = sandbox_cpu(sandbox if sandbox else value)
        steps.setdefault(name, []).append(((time.perf_counter() - t0) * 1000, (c1 - c0) * 1000))
        return value

    try:
        for _ in range(ROUNDS):
            sandbox = step("boot (runsc, agent, interpreter or fork server)", None, backend.new_sandbox)
            step("idle, 1 s", sandbox, time.sleep, 1.0)
            if mode == "batch":
                sandbox.begin(0)
            step("prepare (files in)", sandbox, sandbox.prepare, [SourceFile("main.py", b"print('hello')\n")])
            facts = step("trivial run, pre-started/forked", sandbox, sandbox.run, harness, {}, b"", LIMITS,
                         control=RUN_MODE)
            assert facts.stdout == b"hello\n", facts
            if mode == "batch":
                sandbox.begin(1)
            sandbox.prepare([SourceFile("main.py", SOLUTION.encode())])
            nonce = os.urandom(32)
            facts = step("solution + 20 asserts, " + ("forked" if mode == "batch" else "new interpreter"),
                         sandbox, sandbox.run, harness, {}, b"", LIMITS, control=TEST_MODE + nonce + ASSERTIONS.encode())
            assert facts.report == nonce, facts
            step("python3 -c pass, new interpreter", sandbox, sandbox.run, ["python3", "-c", "pass"], {}, b"", LIMITS)
            sandbox.close()
    finally:
        backend.close()
    print(f"\nsandbox profile, {mode} mode (median of {ROUNDS}; load average {os.getloadavg()[0]:.1f})")
    print(f"{'step':<52}{'wall ms':>9}{'CPU ms':>9}")
    for name, values in steps.items():
        print(f"{name:<52}{statistics.median(v[0] for v in values):>9.0f}"
              f"{statistics.median(v[1] for v in values):>9.0f}")
