"""The whole loop, as `make run` runs it: real processes, real broker, real gRPC, real learning."""

import json
import math
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One `temper run --job toy` (the tiny model's job) in a private home; returns (home, summary)."""
    base = tmp_path_factory.mktemp("e2e")
    home, runs = base / "home", base / "runs"
    proc = subprocess.run([sys.executable, "-m", "temper.cli.main", "--home", str(home), "run", "--job", "toy",
                           "--runs", str(runs)],
                          capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((runs / "latest" / "summary.json").read_text())
    return home, summary, proc.stdout


def test_the_loop_learns(run):
    _, summary, stdout = run
    steps = summary["steps"]
    assert len(steps) == summary["job"]["steps"]
    assert [s["policy_version"] for s in steps] == list(range(1, len(steps) + 1))
    k = len(steps) // 5
    n = k * steps[0]["samples"]  # samples behind each mean
    first = sum(s["mean_reward"] for s in steps[:k]) / k
    last = sum(s["mean_reward"] for s in steps[-k:]) / k
    # Chance: with p <= 0.5 the std of a mean of n Bernoulli rewards is <= 0.5 / sqrt(n) (~0.009 for
    # n = 3840); a gain of 0.3 is > 20 such standard deviations. The random policy starts near 1/30.
    assert last - first > max(0.3, 10 * 0.5 / math.sqrt(n)), (first, last)
    assert last > 0.6, last  # the absolute bar: most answers right
    assert steps[0]["mean_reward"] < 0.3  # the initial policy does badly
    assert "reward" in stdout and "step" in stdout
    for s in steps:  # on-policy (max_policy_lag = 0): step v trained on samples of version v - 1
        assert s["mean_sample_policy_version"] == s["policy_version"] - 1


def _spans(home: Path, service: str) -> list[dict]:
    path = home / "logs" / f"{service}.spans.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_one_trace_follows_a_sample_through_every_hop(run):
    home, _, _ = run
    traces = defaultdict(set)  # trace id -> services that recorded a span in it
    for service in ("scheduler", "inference", "reward", "replay"):
        for span in _spans(home, service):
            traces[span["context"]["trace_id"]].add(service)
    step_traces = {s["context"]["trace_id"] for s in _spans(home, "scheduler") if s["name"] == "scheduler.step"}
    assert step_traces
    complete = [t for t in step_traces if traces[t] == {"scheduler", "inference", "reward", "replay"}]
    # every step's trace reaches inference (gRPC), reward (Kafka) and replay (Kafka again)
    assert len(complete) == len(step_traces), {t: traces[t] for t in step_traces if t not in complete}


def test_learner_steps_link_to_the_scheduler_steps_they_trained_on(run):
    home, summary, _ = run
    step_traces = {s["context"]["trace_id"] for s in _spans(home, "scheduler") if s["name"] == "scheduler.step"}
    learner = [s for s in _spans(home, "learner") if s["name"] == "learner.step"]
    assert len(learner) == len(summary["steps"])
    assert all(s["links"] for s in learner)
    linked = {link["context"]["trace_id"] for s in learner for link in s["links"]}
    assert linked <= step_traces
    assert len(linked) == len(summary["steps"])  # on-policy: each update trained on exactly one scheduler step
