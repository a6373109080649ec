"""Trace sampling through the real loop: a toy job with ``[launcher] trace_sample_ratio = 0.5``.

Every service gets the ratio; the decision is made once, by trace id, where a step's trace starts
(the scheduler) and followed downstream (gRPC metadata, Kafka headers), so a step is either traced
in every service it passed or in none; a ``learner.step`` (a root span linking to the steps it
trained on) is kept exactly when the step it trained on was kept.
"""

import json
import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.e2e

STEPS = 30


def _spans(home: Path, service: str) -> list[dict]:
    path = home / "logs" / f"{service}.spans.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("sampled")
    text = (REPO / "services" / "temper" / "jobs" / "toy.toml").read_text()
    text = re.sub(r"(?m)^steps = \d+", f"steps = {STEPS}", text, count=1)
    text = re.sub(r"(?m)^size = \d+", "size = 0", text, count=1)  # [job.eval]: none
    (base / "job.toml").write_text(text + "\n[launcher]\ntrace_sample_ratio = 0.5\n")
    home, runs = base / "home", base / "runs"
    proc = subprocess.run([sys.executable, "-m", "temper.cli.main", "--home", str(home), "run", "--config",
                           str(base / "job.toml"), "--runs", str(runs)],
                          capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((runs / "latest" / "summary.json").read_text())
    assert len(summary["steps"]) == STEPS
    return home


# the spans each step's trace makes downstream: (service, span name) -> how many per step
PER_STEP = {("inference", "/temper.v1.InferenceService/Generate"): 1, ("reward", "consume rollouts"): 16,
            ("replay", "consume scored"): 16, ("monitor", "consume scored"): 16}


def test_a_share_of_the_steps_is_traced_and_each_kept_one_in_every_service(run):
    home = run
    kept = {s["context"]["trace_id"] for s in _spans(home, "scheduler") if s["name"] == "scheduler.step"}
    # every step is a new trace (ids random): keeping all 30 or none at ratio 0.5 has odds 2 in 2^30
    assert 0 < len(kept) < STEPS, len(kept)
    for (service, name), per_step in PER_STEP.items():
        spans = [s for s in _spans(home, service) if s["name"] == name]
        by_trace = defaultdict(int)
        for span in spans:
            by_trace[span["context"]["trace_id"]] += 1
        # each kept step traced through this hop, once per group; no span of a dropped step
        assert by_trace == {t: per_step for t in kept}, (service, name, len(kept), dict(by_trace))


def test_a_learner_step_is_kept_with_the_step_it_trained_on(run):
    home = run
    kept = {s["context"]["trace_id"] for s in _spans(home, "scheduler") if s["name"] == "scheduler.step"}
    learner = [s for s in _spans(home, "learner") if s["name"] == "learner.step"]
    linked = [{link["context"]["trace_id"] for link in s["links"]} for s in learner]
    assert all(len(links) == 1 for links in linked), linked  # on-policy: one scheduler step per update
    # the learner's own decision: every kept update links to a kept step, and every kept step's update is there
    assert {t for links in linked for t in links} == kept
