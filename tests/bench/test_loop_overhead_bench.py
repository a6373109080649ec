"""Telemetry overhead on the whole loop (`make bench`): the toy job with tracing, metrics and the
monitor's detectors on (as shipped) and off, run one after another in one session.

Each round runs ``temper run`` once per mode on fresh homes (the order rotates each round: the machine is
shared and its load comes and goes), the embedded toy job cut to ``TEMPER_LOOP_BENCH_STEPS`` steps
without held-out evaluation:

- on: the job file as shipped: every service writes its spans to ``logs/<service>.spans.jsonl``
  (``trace_sample_ratio`` 1: every trace kept), serves Prometheus on a port of its own, and the
  monitor runs every detector on the ``scored`` and ``sandbox-traces`` streams;
- no-traces: ``[launcher] traces = false, trace_sample_ratio = 0`` (no span recorded); metrics and
  detectors as shipped;
- off: no-traces, and ``[launcher] metrics = false`` (no metrics port), ``[monitor] read_traces =
  false`` and every detector ``enabled = false``.

A round's figures come from the run's ``summary.json``: steps per minute over the job (services
already up, so start-up is not in it) and the median step time after the first steps (the first
step loads and compiles). A mode's ratio is the median of its per-round ratios to off; the goal is that
telemetry costs at most 5 % of the loop's throughput. The toy model's steps are short (~0.4 s), so
the per-step cost of spans and detectors weighs more here than on a real model's steps of seconds
to minutes: this bounds the overhead from above.

Run with ``make bench`` (or ``pytest -q -s -m bench tests/bench/test_loop_overhead_bench.py``);
``TEMPER_LOOP_BENCH_ROUNDS`` / ``TEMPER_LOOP_BENCH_STEPS`` change the rounds and the job's steps.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
from collections import Counter

import pytest

from temper.monitor.detectors import DETECTORS
from tests.conftest import REPO

pytestmark = pytest.mark.bench

ROUNDS = int(os.environ.get("TEMPER_LOOP_BENCH_ROUNDS", "5"))
STEPS = int(os.environ.get("TEMPER_LOOP_BENCH_STEPS", "50"))
SKIP_STEPS = 5  # step times counted from here on (the first steps load and compile)
TOY = REPO / "services" / "temper" / "jobs" / "toy.toml"


MODES = ("on", "no-traces", "off")


def job_file(mode: str) -> str:
    text = TOY.read_text()
    text, n_steps = re.subn(r"(?m)^steps = \d+", f"steps = {STEPS}", text, count=1)
    text, n_size = re.subn(r"(?m)^size = \d+", "size = 0", text, count=1)  # [job.eval]: none
    assert n_steps == n_size == 1, "toy.toml's [job] steps / [job.eval] size not found"
    if mode == "on":
        return text
    extra = ["", "[launcher]", "traces = false", "trace_sample_ratio = 0.0"]
    if mode == "off":
        text, n_monitor = re.subn(r"(?m)^\[monitor\]$", "[monitor]\nread_traces = false", text, count=1)
        assert n_monitor == 1, "toy.toml has no [monitor] table"
        extra.append("metrics = false")
        for name in sorted(DETECTORS):
            extra += ["", f"[monitor.detectors.{name}]", "enabled = false"]
    return text + "\n".join(extra) + "\n"


def run_job(base, mode: str) -> dict:
    """One ``temper run`` of the job on a fresh home under ``base``: its figures, checked."""
    base.mkdir(parents=True)
    (base / "job.toml").write_text(job_file(mode))
    proc = subprocess.run([sys.executable, "-m", "temper.cli.main", "--home", str(base / "home"), "run",
                           "--config", str(base / "job.toml"), "--runs", str(base / "runs"), "--job-timeout", "900"],
                          capture_output=True, text=True, timeout=1200, cwd=base)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((base / "runs" / "latest" / "summary.json").read_text())
    assert len(summary["steps"]) == STEPS
    spans = Counter()
    for path in sorted((base / "home" / "logs").glob("*.spans.jsonl")):
        spans[path.name.removesuffix(".spans.jsonl")] = sum(1 for line in path.open() if line.strip())
    # the metrics ports each service logged when it bound (-1: none)
    ports = {int(p) for p in re.findall(r'"metrics_port": *(-?\d+)',
                                         "".join(f.read_text() for f in (base / "home" / "logs").glob("*.log")))}
    if mode == "on":  # every service traced the job
        assert {"scheduler", "inference", "reward", "replay", "learner"} <= {s for s, n in spans.items() if n}, spans
    else:
        assert not spans, spans
    if mode == "off":  # no metrics port
        assert ports == {-1}, ports
    else:
        assert ports and min(ports) > 0, ports
    step_seconds = [s["seconds"] for s in summary["steps"][SKIP_STEPS:]]
    return {"steps_per_minute": summary["steps_per_minute"], "step_p50": statistics.median(step_seconds),
            "spans": sum(spans.values())}


@pytest.mark.timeout(ROUNDS * len(MODES) * 300)  # a run takes about a minute
def test_telemetry_overhead_on_the_toy_loop(tmp_path):
    rounds: dict[str, list[dict]] = {m: [] for m in MODES}
    for r in range(ROUNDS):
        for mode in MODES[r % len(MODES):] + MODES[:r % len(MODES)]:
            rounds[mode].append(run_job(tmp_path / f"r{r}-{mode}", mode))
    print(f"\ntelemetry overhead, toy job of {STEPS} steps x 16 prompts x 8 samples (temper run, fresh home each), "
          f"{ROUNDS} rounds, order rotating; medians over rounds, ratios: median of the per-round ratios to off")
    for mode in MODES:
        rs = rounds[mode]
        per_round = ", ".join(f"{x['steps_per_minute']:.1f}" for x in rs)
        spans = statistics.median(x["spans"] for x in rs)
        ratio = statistics.median(x["steps_per_minute"] / o["steps_per_minute"] for x, o in zip(rs, rounds["off"]))
        step_ratio = statistics.median(x["step_p50"] / o["step_p50"] for x, o in zip(rs, rounds["off"]))
        print(f"  {mode:9s}: {statistics.median(x['steps_per_minute'] for x in rs):6.1f} steps/min "
              f"(rounds {per_round}), step p50 {statistics.median(x['step_p50'] for x in rs) * 1000:.0f} ms, "
              f"spans {spans:.0f} ({spans / STEPS:.0f}/step); throughput / off {ratio:.3f}, step time / off "
              f"{step_ratio:.3f}")
    print("  goal: on >= 0.95 of off")
