"""Costs fitted from measured runs, and the model's predictions checked against runs it was not fitted on.

A run is what ``temper run`` leaves: its ``summary.json`` (the job, the config, the learner's StepMetrics) and
the home's span files (``<home>/logs/<service>.spans.jsonl``, every replica's). From them, per run:

- generation: each scheduler step's Generate server spans (one per replica), sequences per replica and the
  job's ``max_tokens`` (decode iterations); fitted over runs of different batch sizes to
  ``iteration_seconds + seq_seconds x sequences`` per iteration (least squares);
- training: each step's ``train_seconds`` against its ``input_tokens x epochs``, fitted to a fixed part plus
  tokens / rate;
- push: the learner's UpdateWeights client spans; scoring: the reward replicas' ``consume rollouts`` spans
  (one per group); storing: replay's ``consume scored`` spans; execution: the sandbox's server spans;
- the step interval: the time between the ends of successive ``learner.step`` spans, over the steps after the
  first two (start-up); the step overhead is what the interval has beyond the stages, averaged over runs.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass
from pathlib import Path

from temper.capacity.model import Allocation, Costs, Workload, predict

WARMUP_STEPS = 2


@dataclass
class RunMeasure:
    name: str
    workload: Workload
    allocation: Allocation
    gen_points: list[tuple[float, float]]     # (sequences on the replica, seconds per decode iteration)
    train_points: list[tuple[float, float]]   # (train tokens, seconds)
    push: list[float]
    reward: list[float]
    store: list[float]
    sandbox: list[float]
    executions_per_group: float
    step_interval: float                      # measured steady-state seconds per step


def _spans(logs: Path, service: str) -> list[dict]:
    out = []
    for path in sorted(logs.glob(f"{service}*.spans.jsonl")):
        stem = path.name.removesuffix(".spans.jsonl")
        if stem != service and not stem.removeprefix(service + "-").isdigit():
            continue
        for line in path.read_text().splitlines():
            if line.strip():
                out.append(json.loads(line))
    return out


def _seconds(span: dict) -> float:
    return (span["end_time_unix_nano"] - span["start_time_unix_nano"]) / 1e9


def measure_run(run: Path, logs: Path | None = None, name: str = "") -> RunMeasure:
    """What one run measured. ``run``: its folder (or summary.json); ``logs``: its home's logs folder (default:
    the ``home`` the summary names). Spans are those of the run's job only (a home's span files keep every
    job it ran): the scheduler's ``scheduler.step`` spans of the job id, the spans of their traces, and the
    ``learner.step`` spans linked to them with their children."""
    run = Path(run)
    summary_path = run / "summary.json" if run.is_dir() else run
    summary = json.loads(summary_path.read_text())
    if logs is None:
        if not summary.get("home"):
            raise ValueError(f"{summary_path}: names no home; give its home's logs folder")
        logs = Path(summary["home"]) / "logs"
    job, config = summary["job"], summary.get("config", {})
    steps = [s for s in summary["steps"] if s.get("step", 0) > WARMUP_STEPS]
    if len(steps) < 2:
        raise ValueError(f"{summary_path}: {len(summary['steps'])} steps; calibration needs at least "
                         f"{WARMUP_STEPS + 2}")
    epochs = int(config.get("learner", {}).get("epochs", 1))
    completion = [s["values"]["tokens"] / max(1, s["samples"]) for s in steps]
    prompt = [(s["values"]["input_tokens"] - s["values"]["tokens"]) / max(1, s["samples"]) for s in steps]
    replicas = {svc: int(config.get(svc, {}).get("replicas", 1)) for svc in ("inference", "reward", "sandbox")}
    slots = replicas["sandbox"] * (int(config.get("sandbox", {}).get("max_concurrency", 0)) or os.cpu_count() or 1)
    workload = Workload(prompts_per_step=job["prompts_per_step"], group_size=job["group_size"],
                        prompt_tokens=round(statistics.mean(prompt)), completion_tokens=job["max_tokens"],
                        mean_completion_tokens=statistics.mean(completion), epochs=epochs,
                        max_policy_lag=job.get("max_policy_lag", 0))
    allocation = Allocation(inference_replicas=replicas["inference"], reward_replicas=replicas["reward"],
                            sandbox_slots=slots)

    step_spans = [s for s in _spans(logs, "scheduler") if s["name"] == "scheduler.step"
                  and s.get("attributes", {}).get("temper.job_id") == job["job_id"]]
    first = {s["context"]["trace_id"]: s["attributes"].get("temper.step", 0) for s in step_spans}
    traces = {t for t, step in first.items() if step >= WARMUP_STEPS}   # steady-state steps' traces

    def of_job(service: str, name: str, within: set[str]) -> list[dict]:
        return [s for s in _spans(logs, service) if s["name"].endswith(name) and s["context"]["trace_id"] in within]

    learner = _spans(logs, "learner")
    steps_of_job = [s for s in learner if s["name"] == "learner.step"
                    and any(link["context"]["trace_id"] in first for link in s.get("links", []))]
    ends = sorted(s["end_time_unix_nano"] for s in steps_of_job)
    intervals = [(b - a) / 1e9 for a, b in zip(ends, ends[1:])][WARMUP_STEPS:]
    if not intervals:
        raise ValueError(f"{logs}: fewer than {WARMUP_STEPS + 2} learner.step spans of job {job['job_id']}")
    learner_traces = {s["context"]["trace_id"] for s in steps_of_job}
    seqs = -(-job["prompts_per_step"] // replicas["inference"]) * job["group_size"]
    reward = of_job("reward", "consume rollouts", traces)
    sandbox = [s for s in of_job("sandbox", "", traces) if s.get("kind") == "SERVER"]
    return RunMeasure(
        name=name or str(summary_path.parent), workload=workload, allocation=allocation,
        gen_points=[(seqs, _seconds(s) / job["max_tokens"]) for s in of_job("inference", "/Generate", traces)],
        train_points=[(s["values"]["input_tokens"] * epochs, s["values"]["train_seconds"]) for s in steps],
        push=[_seconds(s) for s in learner if s["name"].endswith("/UpdateWeights")
              and s["context"]["trace_id"] in learner_traces],
        reward=[_seconds(s) for s in reward],
        store=[_seconds(s) for s in of_job("replay", "consume scored", traces)],
        sandbox=[_seconds(s) for s in sandbox],
        executions_per_group=len(sandbox) / len(reward) if reward else 0.0,
        step_interval=statistics.median(intervals))


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``y = a + b x`` (a, b >= 0); one distinct x: a = 0 and b = mean(y / x)."""
    xs = [x for x, _ in points]
    if len(set(xs)) < 2:
        return 0.0, statistics.mean(y / x for x, y in points)
    mx, my = statistics.mean(xs), statistics.mean(y for _, y in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x in xs)
    a = my - b * mx
    if a < 0:  # through the origin
        return 0.0, sum(x * y for x, y in points) / sum(x * x for x in xs)
    if b <= 0:
        return my, 1e-12
    return a, b


def fit(runs: list[RunMeasure], source: str = "") -> Costs:
    """Costs fitted on ``runs`` (different batch sizes make the per-sequence and fixed parts separable)."""
    if not runs:
        raise ValueError("runs: nothing to calibrate on")
    iteration, seq = _line([p for r in runs for p in r.gen_points])
    fixed, per_token = _line([p for r in runs for p in r.train_points])

    def mean(values: list[float]) -> float:
        return statistics.mean(values) if values else 0.0

    costs = Costs(source=source, iteration_seconds=iteration, seq_seconds=seq, max_num_seqs=1 << 20,
                  gpus_per_inference_replica=0, learner_tokens_per_second=1.0 / per_token, train_step_seconds=fixed,
                  push_seconds=mean([p for r in runs for p in r.push]),
                  reward_group_seconds=mean([p for r in runs for p in r.reward]),
                  sandbox_seconds=mean([p for r in runs for p in r.sandbox]),
                  replay_group_seconds=mean([p for r in runs for p in r.store]))
    overheads = [r.step_interval - predict(costs, _with_code(r), r.allocation).step_seconds for r in runs]
    return costs.model_copy(update={"step_overhead_seconds": max(0.0, statistics.mean(overheads))})


def _with_code(r: RunMeasure) -> Workload:
    """The run's workload with its measured sandbox executions (a share of groups x executions per sample)."""
    if r.executions_per_group <= 0:
        return r.workload
    per_sample = r.executions_per_group / r.workload.group_size
    return r.workload.model_copy(update={"code_fraction": 1.0, "executions_per_sample": per_sample})


def check(costs: Costs, runs: list[RunMeasure]) -> list[dict]:
    """The model's step time for each run against the run's measured one."""
    out = []
    for r in runs:
        p = predict(costs, _with_code(r), r.allocation)
        out.append({"run": r.name, "prompts_per_step": r.workload.prompts_per_step,
                    "group_size": r.workload.group_size, "max_policy_lag": r.workload.max_policy_lag,
                    "inference_replicas": r.allocation.inference_replicas,
                    "predicted_seconds": p.step_seconds, "measured_seconds": r.step_interval,
                    "ratio": p.step_seconds / r.step_interval, "bottleneck": p.bottleneck})
    return out
