"""A job whose only domain is a folder of code problems with their own tests, as `temper run` runs it: real
processes, real broker, the real sandbox, the tiny model.

The tiny model writes no code (its reward is ~0); the job's ``[reward.code] require_code_block = false`` runs
each raw completion as solution.py, so every scored trajectory went through the sandbox: it carries the
problem's per-test records (an empty completion, or one refused for having no code block, carries none)."""

import json

import pytest

from temper.reward.verifiers.suites import CASE_PREFIX
from tests.e2e.jobfiles import run_job_file

pytestmark = pytest.mark.e2e

STEPS = 2
PROBLEMS = {
    "add": ("Write add(a, b).", {"test_add.py": "from solution import add\n\n\ndef test_one():\n"
                                                "    assert add(1, 2) == 3\n\n\ndef test_two():\n"
                                                "    assert add(2, 2) == 4\n"}),
    "neg": ("Write neg(x).", {"test_neg.py": "assert neg(3) == -3\n"}),
}
IDS = {"add": {"test_add.py::test_one", "test_add.py::test_two"}, "neg": {"test_neg.py"}}


@pytest.fixture(scope="module")
def summary(tmp_path_factory):
    base = tmp_path_factory.mktemp("tests-folder-job")
    for name, (prompt, tests) in PROBLEMS.items():
        (base / "problems" / name / "tests").mkdir(parents=True)
        (base / "problems" / name / "prompt.md").write_text(prompt)
        for file, text in tests.items():
            (base / "problems" / name / "tests" / file).write_text(text)
    return run_job_file(base, f"""
[job]
steps = {STEPS}
prompts_per_step = 2
group_size = 2
domains = ["data.mine"]
max_tokens = 4

[job.domain_config."data.mine"]
path = "problems"
verifier = "tests.pass_fraction"

[model]
preset = "tiny"

[inference]
engine = "hf"

[reward.code]
require_code_block = false   # the tiny model writes no code block: run its completion as it is
""", job_timeout=600)


def test_the_loop_ran_and_every_reward_came_from_the_problems_tests(summary):
    assert len(summary["steps"]) == STEPS
    samples = [s for step in summary["samples"].values() for s in step]
    assert samples
    prompts = {p: name for name, (p, _) in PROBLEMS.items()}
    for s in samples:
        assert s["domain"] == "data.mine"
        name = prompts[s["prompt"].split("\n")[0]]
        assert json.loads(s["reference"])["files"] == PROBLEMS[name][1]
        records = {k.removeprefix(CASE_PREFIX): v for k, v in s["components"].items() if k.startswith(CASE_PREFIX)}
        # the sandbox ran each of the problem's tests (an empty completion is no program: nothing ran)
        assert set(records) == (IDS[name] if s["completion"].strip() else set()), s
        assert s["reward"] == pytest.approx(s["components"]["tests.pass_fraction"])
        assert s["reward"] == pytest.approx(sum(records.values()) / len(records) if records else 0.0)
    assert any(s["completion"].strip() for s in samples)
    assert {d for step in summary["steps"] for d in step["domain_mean_reward"]} == {"data.mine"}
