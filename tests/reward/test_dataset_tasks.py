"""Tasks drawn from a dataset file (``data.<name>``) are scored by the verifier the job declared for it:
exact answers, math-verify, and a row's own test suite run in the real sandbox."""

from __future__ import annotations

import json
import random

import pytest

from temper import tasks
from temper.reward.core import Scorer
from temper.reward.settings import DomainSpec, RewardSettings
from temper.reward.verifiers.code import sandbox_runner
from temper.v1 import common_pb2
from tests.reward.conftest import component


def group_of(task: common_pb2.Task, texts: list[str]) -> common_pb2.RolloutGroup:
    return common_pb2.RolloutGroup(group_id="g", task=task, trajectories=[
        common_pb2.Trajectory(trajectory_id=f"g/{k}", group_id="g", completion_text=t) for k, t in enumerate(texts)])


def one_task(tmp_path, rows: list[dict], **options) -> common_pb2.Task:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tasks.make_task("data.mine", random.Random(0), "t", {"path": str(path), **options})


def test_exact_answer_and_math_rows(scorer, tmp_path):
    exact = one_task(tmp_path, [{"q": "copy 1 2 3", "a": "3"}], prompt_field="q", answer_field="a",
                     verifier="exact_answer")
    scored = scorer.score_group(group_of(exact, ["3", "2"]))
    assert [t.reward.total for t in scored.trajectories] == [1.0, 0.0]
    assert [c.name for c in scored.trajectories[0].reward.components] == ["exact_answer"]
    math = one_task(tmp_path, [{"problem": "What is 1/2 + 1/4?", "solution": "\\frac{3}{4}"}],
                    prompt_field="problem", answer_field="solution", verifier="math",
                    instruction="Put your final answer in \\boxed{}.")
    assert math.prompt.endswith("\n\nPut your final answer in \\boxed{}.")
    scored = scorer.score_group(group_of(math, ["so \\boxed{0.75}", "\\boxed{3/4}", "\\boxed{1/2}", "3/4"]))
    assert [component(t, "math").value for t in scored.trajectories] == [1.0, 1.0, 0.0, 0.0]
    # the domain's own table may add a model or shaping component; the declared verifier still scores the row
    shaped = Scorer(RewardSettings(domains={"data.mine": DomainSpec(weights={"math": 1.0, "safety": 0.5})}))
    try:
        scored = shaped.score_group(group_of(math, ["\\boxed{3/4}"]))
        assert {c.name for c in scored.trajectories[0].reward.components} == {"math", "safety"}
    finally:
        shaped.close()


def py(code: str) -> str:
    return f"```python\n{code}\n```"


def test_code_rows_run_their_own_tests_in_the_sandbox(sandbox, tmp_path):
    rows = [{"prompt": "Read two integers and print their sum.",
             "tests": [{"stdin": "1 2\n", "expected_stdout": "3\n"}, {"stdin": "-4 4\n", "expected_stdout": "0\n"}]}]
    task = one_task(tmp_path, rows, prompt_field="prompt", answer_field="tests", verifier="code.pass_fraction")
    scorer = Scorer(RewardSettings(), sandbox=sandbox_runner(sandbox.address))
    try:
        scored = scorer.score_group(group_of(task, [py("print(sum(map(int, input().split())))"),
                                                    py("print(3)"), "no code"]))
    finally:
        scorer.close()
    assert [t.reward.total for t in scored.trajectories] == pytest.approx([1.0, 0.5, 0.0])
    assert [component(t, "code.pass_fraction").weight for t in scored.trajectories] == [1.0] * 3
