"""Prioritized replay with experience reuse in a real job: the shipped toy-reuse job (`temper run`,
every real service, tiny model). The learner sends each group's mean |advantage| to replay after
every step; a group whose rewards are all equal gets priority 0 and is never drawn again, while
groups with a signal are drawn up to 4 times. So priorities move sampling in their direction: the
groups the learner draws again hold far fewer no-signal groups than the scheduler generated.
Reuse stays under the policy-lag bound (replay's max_policy_lag = 4)."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e
STEPS = 8
MAX_POLICY_LAG = 4  # the job's [replay.tables.default] max_policy_lag


def test_learner_priorities_reach_replay_and_move_sampling_under_the_lag_bound(tmp_path):
    runs = tmp_path / "runs"
    proc = subprocess.run([sys.executable, "-m", "temper.cli.main", "--home", str(tmp_path / "home"), "run",
                           "--job", "toy-reuse", "--steps", str(STEPS), "--runs", str(runs)],
                          capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((runs / "latest" / "summary.json").read_text())
    steps = summary["steps"]
    assert len(steps) == STEPS
    values = [s["values"] for s in steps]
    # priorities reached replay after every step (groups drawn for the last time are gone: not all updated)
    assert all(0 < v["priorities_updated"] <= v["groups"] for v in values), values
    # the table's priorities became unequal (all groups arrive with the same one): weights below 1 ...
    assert all(0 < v["replay_importance_weight_min"] <= v["replay_importance_weight_mean"] + 1e-9 <= 1 + 2e-9
               for v in values), values
    assert min(v["replay_importance_weight_min"] for v in values) < 1
    # ... and groups were reused, from earlier steps
    reused = sum(v["replay_reused_draws"] for v in values)
    assert reused >= STEPS // 2 and sum(v["replay_times_sampled_mean"] for v in values) / STEPS > 1.1
    # the direction: a group without a learning signal (all rewards equal) gets priority 0 after its
    # first step and is not drawn again, so reused draws have far fewer of them than what was generated
    generated = summary["sampling"]
    flat_generated = sum(d["zero_variance_groups"] for d in generated["domains"]) / generated["groups_scored"]
    flat_reused = sum(v["replay_reused_no_signal_draws"] for v in values) / reused
    assert flat_generated > 0.2, generated  # the tiny model rarely answers right: many all-zero groups
    assert flat_reused < 0.25 * flat_generated, (flat_reused, flat_generated)
    # the lag bound held: every group trained on was at most MAX_POLICY_LAG versions behind the learner
    for s in steps:
        assert s["policy_version"] - 1 - s["min_sample_policy_version"] <= MAX_POLICY_LAG, s
        assert s["values"]["dropped_stale"] == 0  # replay never handed out a group the learner would drop
