"""The multi-step chain domain: tasks reproducible and right, the outcome verifier chain_final, and the
default composite (chain_final counts, exact_steps kept per step at weight 0, steps split per line)."""

import random

import pytest

from temper import tasks
from temper.reward.core import score_group
from temper.reward.settings import RewardSettings
from temper.reward.steps import split_steps
from temper.reward.verifiers.basic import ChainFinal
from temper.tasks import chain
from tests.builders import rollout_group
from tests.reward.conftest import component


def _check_lines(lines: list[str]) -> None:
    value = None
    for line in lines:
        left, result = line.split(" = ")
        a, op, b = left.split(" ")
        assert value is None or int(a) == value  # each step starts from the previous result
        value = int(a) + int(b) if op == "+" else int(a) - int(b)
        assert op in "+-" and 1 <= int(b) <= 9 and int(result) == value >= 0


def test_tasks_are_reproducible_right_and_show_two_worked_examples():
    assert "chain.add_sub" in tasks.domains()
    for seed in range(50):
        t = tasks.make_task("chain.add_sub", random.Random(seed), f"t{seed}")
        assert t == tasks.make_task("chain.add_sub", random.Random(seed), f"t{seed}")
        lines = t.reference_answer.split("\n")
        assert len(lines) == chain.STEPS
        _check_lines(lines)
        *examples, question = t.prompt.split("\n\n")
        assert len(examples) == chain.EXAMPLES and question.startswith("Start with ") and question.endswith(".\n")
        assert question.startswith(f"Start with {lines[0].split(' ')[0]}, then ")
        for ex in examples:
            head, *steps = ex.split("\n")
            assert head.startswith("Start with ") and len(steps) == chain.STEPS
            _check_lines(steps)


def test_chain_final_credits_the_last_step_of_an_answer_of_the_right_length():
    ref = "3 + 6 = 9\n9 - 2 = 7\n7 + 1 = 8"
    verdicts = ChainFinal().verify([
        ref, ref + "\n\n", "\n" + ref + "\n\nStart with 1, then add 1.\n1 + 1 = 2",  # text after a blank line is not read
        "3 + 6 = 10\n10 - 2 = 8\n7 + 1 = 8",  # a wrong step, the right last result: outcome only
        "3 + 6 = 9\n9 - 2 = 7", "3 + 6 = 9\n9 - 2 = 7\n7 + 1 = 8\n8 + 0 = 8",  # too few / too many steps
        "3 + 6 = 9\n9 - 2 = 7\n7 + 1 = 9", "3 + 6 = 9\n9 - 2 = 7\n\n7 + 1 = 8", "", "8"], ref)
    assert [v[0].value for v in verdicts] == [1, 1, 1, 1, 0, 0, 0, 0, 0, 0]
    assert verdicts[4][0].detail == "2/3 step lines, final '7'"


def test_the_default_composite_scores_the_outcome_and_keeps_each_step():
    ref = "3 + 6 = 9\n9 - 2 = 7\n7 + 1 = 8"
    group = rollout_group("chain.add_sub", ref, [ref + "\n\n", "3 + 6 = 9\n9 - 2 = 6\n6 + 1 = 7\n\n"], prompt="Start")
    spec = RewardSettings().domains["chain"]
    assert spec.step_delimiter == "\n" and spec.weights == {"chain_final": 1.0, "exact_steps": 0.0}
    scored = score_group(group)
    right, wrong = scored.trajectories
    assert (right.reward.total, wrong.reward.total) == (1.0, 0.0)
    steps = component(wrong, "exact_steps")
    assert steps.weight == 0.0 and steps.value == pytest.approx(1 / 3)  # the first step right, the others not
    assert not wrong.reward.step_rewards  # a weight-0 step source gives no step rewards
    assert split_steps(ref + "\n\n", "\n") == ["3 + 6 = 9", "\n9 - 2 = 7", "\n7 + 1 = 8\n\n"]
