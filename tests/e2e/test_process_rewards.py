"""Process supervision end to end: the shipped toy-steps job (rule-based per-step verifier exact_steps
in the reward service, process_grpo in the learner) through every real service on the tiny model."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e
STEPS = 4


def test_a_process_grpo_job_trains_on_the_reward_services_step_rewards(tmp_path):
    runs = tmp_path / "runs"
    proc = subprocess.run([sys.executable, "-m", "temper.cli.main", "--home", str(tmp_path / "home"), "run",
                           "--job", "toy-steps", "--steps", str(STEPS), "--runs", str(runs)],
                          capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((runs / "latest" / "summary.json").read_text())
    steps = summary["steps"]
    assert [s["policy_version"] for s in steps] == list(range(1, STEPS + 1))
    for s in steps:
        v = s["values"]
        # every sampled completion with at least one word has step rewards (an empty one falls back to
        # its total), each with 1 or 2 steps (max_tokens = 2, one word per step); no group was refused
        assert 0 < v["step_reward_trajectories"] <= s["samples"], v
        assert v["step_reward_trajectories"] <= v["step_rewards"] <= 2 * v["step_reward_trajectories"], v
        assert v["dropped_groups"] == 0, v
