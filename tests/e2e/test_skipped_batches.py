"""A job whose every group fails its reward still ends, through the real loop.

The toy job (tiny model, fully on-policy: ``max_policy_lag = 0``) with ``[reward] max_completion_chars = 1``:
every completion of two tokens is longer, so the reward service marks every group's reward ERROR; replay
stores them, and the learner drops each batch whole. Each consumed batch still makes a policy version (the
weights unchanged), so the scheduler, which waits for version ``start + step`` before generating step
``step``, goes on; the CLI counts the skipped batches as steps and the job ends DONE. Before this, the
learner skipped such a batch without a version and the job waited until its timeout.
"""

import json
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.e2e

STEPS, PROMPTS = 3, 4


def test_a_job_whose_every_reward_fails_ends_with_one_version_per_step(tmp_path):
    text = (REPO / "services" / "temper" / "jobs" / "toy.toml").read_text()
    # size: [job.eval], none
    for key, value in (("steps", STEPS), ("prompts_per_step", PROMPTS), ("size", 0), ("max_completion_chars", 1)):
        text, n = re.subn(rf"(?m)^{key} = \d+", f"{key} = {value}", text, count=1)
        assert n == 1, key
    (tmp_path / "job.toml").write_text(text)
    home, runs = tmp_path / "home", tmp_path / "runs"
    proc = subprocess.run([sys.executable, "-m", "temper.cli.main", "--home", str(home), "run", "--config",
                           str(tmp_path / "job.toml"), "--runs", str(runs), "--job-timeout", "300"],
                          capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((runs / "latest" / "summary.json").read_text())
    assert summary["job_state"] == "JOB_STATE_DONE" and summary["steps_done"] == STEPS
    assert summary["steps"] == []  # nothing trained: no reward curve point
    skipped = summary["skipped_batches"]
    assert [s["policy_version"] for s in skipped] == list(range(1, STEPS + 1)), skipped
    for s in skipped:
        assert s["after_step"] == 0 and s["values"]["skipped_batch"] == 1
        assert s["values"]["dropped_groups"] == PROMPTS and s["values"]["dropped_reward_error"] == PROMPTS
    assert proc.stdout.count("batch skipped, all 4 groups dropped (reward_error 4)") == STEPS, proc.stdout[-3000:]
    learner_log = (home / "logs" / "learner.log").read_text()
    assert learner_log.count("batch trained nothing: policy version advanced") == STEPS
