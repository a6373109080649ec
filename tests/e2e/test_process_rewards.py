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


def test_a_job_with_a_learned_prm_in_the_composite_trains_on_its_step_rewards(tmp_path):
    """A PRM (a tiny token-classification model) beside the outcome verifier: the reward service scores every
    step with it, the total counts its weakest step at weight 0.5, and the learner's grpo_process adds the
    outcome's advantage to the PRM steps' -- through every real service."""
    from temper.jobs import path as job_path
    from temper.reward.models import build_tiny_reward_model
    from tests.e2e.jobfiles import edit_job

    prm = build_tiny_reward_model(tmp_path / "prm", seed=1)
    text = edit_job(job_path("toy-steps").read_text(), {("job", "steps"): str(STEPS),
                                                        ("learner", "advantage"): '"grpo_process"'})
    text = text.replace("weights = { exact_steps = 1.0 }", "weights = { exact_answer = 1.0, prm = 0.5 }", 1)
    text = text.replace("\n[scheduler]", f'\n[reward.prm]\ndir = "{prm}"\n\n[scheduler]', 1)
    assert "prm = 0.5" in text and "[reward.prm]" in text
    (tmp_path / "job.toml").write_text(text)
    runs = tmp_path / "runs"
    proc = subprocess.run([sys.executable, "-m", "temper.cli.main", "--home", str(tmp_path / "home"), "run",
                           "--config", str(tmp_path / "job.toml"), "--runs", str(runs)],
                          capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((runs / "latest" / "summary.json").read_text())
    assert [s["policy_version"] for s in summary["steps"]] == list(range(1, STEPS + 1))
    assert summary["config"]["learner"]["advantage"] == "grpo_process"
    for s in summary["steps"]:
        v = s["values"]
        # the PRM scores every completion with a word (1 or 2 steps): its step rewards reached the learner
        assert 0 < v["step_reward_trajectories"] <= s["samples"], v
        assert v["step_reward_trajectories"] <= v["step_rewards"] <= 2 * v["step_reward_trajectories"], v
        assert v["dropped_groups"] == 0, v
    samples = [x for xs in summary["samples"].values() for x in xs]
    assert samples and all({"exact_answer", "prm"} <= set(x["components"]) for x in samples), samples[:2]
