"""A job on the real benchmark sets that registry packages ship (``dataset = "humaneval"`` and ``"champ"``,
``temper.tasks.shipped``), as `temper run` runs it: real processes, real broker, the real sandbox, the tiny
model. The tiny model writes neither code nor math (its reward is ~0); ``[reward.code] require_code_block =
false`` runs each raw completion as the program, so every HumanEval sample went through the sandbox against
its problem's check(); the held-out rows of both sets are evaluated before and after."""

import json
import subprocess
import sys

import pytest

from tests.e2e.jobfiles import run_job_file

pytestmark = pytest.mark.e2e

STEPS = 4


@pytest.fixture(scope="module")
def summary(tmp_path_factory):
    base = tmp_path_factory.mktemp("shipped-sets-job")
    text = f"""
[job]
steps = {STEPS}
prompts_per_step = 2   # with group_size 2: the 4 samples a step the summary keeps are the whole step
group_size = 2
domains = ["data.humaneval", "data.champ"]
max_tokens = 8

[job.domain_config."data.humaneval"]
dataset = "humaneval"
eval_fraction = 0.1

[job.domain_config."data.champ"]
dataset = "champ"
eval_fraction = 0.1

[job.eval]
size = 3

[model]
preset = "tiny"
context = 1024               # HumanEval's prompts run to ~500 of the tiny tokenizer's tokens

[inference]
engine = "hf"

[reward.code]
require_code_block = false   # the tiny model writes no code block: run its completion as it is
"""
    (base / "job.toml").write_text(text)
    dry = subprocess.run([sys.executable, "-m", "temper.cli.main", "--home", str(base / "home"), "run", "--config",
                          str(base / "job.toml"), "--dry-run"], capture_output=True, text=True, timeout=300)
    assert dry.returncode == 0, dry.stderr
    assert "data.humaneval: shipped dataset humaneval (OpenAI HumanEval" in dry.stdout
    assert "164 rows, 147 train, 17 held out (eval_fraction 0.1); verifier code.all_pass" in dry.stdout
    assert "127 rows, 114 train, 13 held out (eval_fraction 0.1); verifier math" in dry.stdout
    return run_job_file(base, text)


def test_both_sets_trained_and_evaluated_through_the_loop(summary):
    assert len(summary["steps"]) == STEPS
    samples = [s for step in summary["samples"].values() for s in step]
    by_domain = {d: [s for s in samples if s["domain"] == d] for d in ("data.humaneval", "data.champ")}
    assert all(by_domain.values()), {d: len(v) for d, v in by_domain.items()}
    for s in by_domain["data.humaneval"]:
        (test,) = json.loads(s["reference"])["tests"]
        assert "def check(candidate)" in test["assertion"]
        assert "code.all_pass" in s["components"] and s["reward"] == s["components"]["code.all_pass"]
    for s in by_domain["data.champ"]:
        assert s["prompt"].endswith("Put your final answer in \\boxed{}.") and "math" in s["components"]
    assert {d for step in summary["steps"] for d in step["domain_mean_reward"]} == {"data.humaneval", "data.champ"}
    for when in ("before", "after"):
        assert set(summary["eval"][when]["accuracy"]) == {"data.humaneval", "data.champ"}, summary["eval"]
