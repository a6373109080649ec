"""Each verifier on real cases: tricky equivalences, and wrong answers that look right."""

from __future__ import annotations

import random

import pytest

from temper.reward.core import Scorer
from temper.reward.settings import MathOptions, RewardSettings
from temper.reward.verifiers import extract
from temper.reward.verifiers.math_answer import MathVerifier
from temper.runtime.errors import InvalidArgument
from temper.tasks import code_problems, gym, math_problems
from tests.builders import rollout_group
from tests.reward.conftest import component
from tests.reward.hanging import hanging_check


def math_values(scorer, reference, answers, domain="math"):
    scored = scorer.score_group(rollout_group(domain, reference, answers))
    return [component(t, "math").value for t in scored.trajectories]


@pytest.mark.parametrize("reference,right,wrong", [
    # 1/2 in every form; 0.333 is not 1/3; a sign or a near miss is wrong
    ("\\frac{1}{2}", ["0.5", "1/2", "\\frac{1}{2}", "\\dfrac{1}{2}", "\\frac{2}{4}", "0.50", "50\\%"],
     ["-\\frac{1}{2}", "2", "0.51", "\\frac{1}{3}"]),
    ("0.5", ["\\frac12", "1/2"], ["5", "0.05"]),
    ("1/3", ["\\frac{1}{3}", "\\frac{2}{6}"], ["0.333", "0.33", "0.3333"]),
    ("\\frac{\\sqrt{2}}{2}", ["\\frac{1}{\\sqrt{2}}", "\\sqrt{2}/2"], ["\\sqrt{2}", "0.7"]),
    ("2\\pi", ["2\\pi", "\\pi \\cdot 2", "\\tau"][:2], ["6.28", "\\pi"]),
    # intervals: open/closed ends matter
    ("[1, 2)", ["[1,2)", "[1, 2)"], ["(1, 2)", "[1, 2]", "(1, 2]"]),
    ("(-\\infty, 4)", ["(-\\infty,4)", "(-\\infty, 4)"], ["(-\\infty, 4]", "(4, \\infty)"]),
    # sets: order does not matter, members do
    ("\\{1, 4\\}", ["\\{4, 1\\}", "\\{1,4\\}"], ["\\{1, 4, 5\\}", "\\{1\\}", "\\{1, -4\\}"]),
    # an equation's right-hand side against a value
    ("x = 2", ["2", "x=2"], ["-2", "x = 3"]),
    ("-\\frac{33}{5}", ["-6.6", "\\frac{-33}{5}"], ["6.6", "-6.5"]),
])
def test_math_equivalences_and_lookalikes(scorer, reference, right, wrong):
    answers = [f"Reasoning...\n\\boxed{{{a}}}" for a in right + wrong]
    assert math_values(scorer, reference, answers) == [1.0] * len(right) + [0.0] * len(wrong)


def test_math_answer_extraction(scorer):
    ref = "\\frac{1}{2}"
    values = math_values(scorer, ref, [
        "first \\boxed{3}, then corrected: \\boxed{1/2}",  # the last box counts
        "\\boxed{1/2} ... on reflection \\boxed{3}",
        "The answer is 1/2.",  # no box: the default format wants \boxed{}
        "\\boxed{\\frac{1}{2}",  # unclosed
        "",
    ])
    assert values == [1.0, 0.0, 0.0, 0.0, 0.0]
    scored = scorer.score_group(rollout_group("math", ref, ["The answer is 1/2."]))
    assert component(scored.trajectories[0], "math").detail == "no answer found"
    assert component(scored.trajectories[0], "format.boxed").value == 0.0


@pytest.mark.slow  # its own math verifier: a pool of worker processes
def test_math_answer_formats():
    tagged = Scorer(RewardSettings(math=MathOptions(answer_format="answer_tag")))
    auto = Scorer(RewardSettings(math=MathOptions(answer_format="auto")))
    try:
        assert math_values(tagged, "\\frac{1}{2}", ["<answer>0.5</answer>", "\\boxed{0.5}", "<answer>2</answer>"]) == \
            [1.0, 0.0, 0.0]
        assert math_values(auto, "\\frac{1}{2}", ["so the final answer is $\\frac{1}{2}$", "\\boxed{0.5}",
                                                   "the answer is 3"]) == [1.0, 1.0, 0.0]
    finally:
        tagged.close()
        auto.close()


def test_math_reference_problems(scorer):
    with pytest.raises(InvalidArgument) as e:
        scorer.score_group(rollout_group("math", "", ["\\boxed{1}"]))
    assert e.value.field == "group.task.reference_answer"
    with pytest.raises(InvalidArgument) as e:
        scorer.score_group(rollout_group("math", "\\text{}", ["\\boxed{1}"]))
    assert e.value.field == "group.task.reference_answer" and "cannot parse" in e.value.message


@pytest.mark.slow  # its own math verifier: a pool of worker processes
def test_math_hung_worker_is_replaced_and_scores_zero():
    class Hanging(MathVerifier):
        check = staticmethod(hanging_check)

    v = Hanging(RewardSettings(math=MathOptions(workers=1, timeout_seconds=1, hard_timeout_seconds=3)))
    try:
        answers = ["\\boxed{7}", "\\boxed{hang}", "\\boxed{7.0}", "\\boxed{8}"]
        checks = v.verify(answers, ("7", "group.task.reference_answer"))
        values = [c[0].value for c in checks]
        assert values == [1.0, 0.0, 1.0, 0.0]
        assert "hung" in checks[1][0].detail and not checks[1][0].error
        # the replacement pool serves the next group
        assert [c[0].value for c in v.verify(["\\boxed{7}"], ("7", "f"))] == [1.0]
    finally:
        v.close()


@pytest.mark.parametrize("domain", sorted(math_problems.GENERATORS))
def test_generated_math_tasks_verify(scorer, domain):
    rng = random.Random(3)
    for _ in range(3):
        task = math_problems.make_task(domain, rng, "t")
        assert "\\boxed{}" in task.prompt
        g = rollout_group(domain, task.reference_answer, [f"\\boxed{{{task.reference_answer}}}", "\\boxed{1234567}"])
        assert math_values(scorer, task.reference_answer, [t.completion_text for t in g.trajectories], domain) == [1.0, 0.0]


def test_exact_answer_and_formats(scorer):
    scored = scorer.score_group(rollout_group("toy.copy", "4", ["4", "4 5", "5 4", ""]))
    assert [t.reward.total for t in scored.trajectories] == [1.0, 1.0, 0.0, 0.0]
    assert extract.last_boxed("a \\boxed{\\{1, 2\\}} b") == "\\{1, 2\\}"
    assert extract.last_boxed("\\boxed{\\frac{1}{2}} and \\fbox{3}") == "3"
    assert extract.last_boxed("\\boxed{unclosed") is None
    assert extract.tagged("<answer> 1 </answer> <answer>2</answer>") == "2"
    assert extract.think_then_answer("<think>hmm</think>\n<answer>2</answer>")
    assert not extract.think_then_answer("<think>hmm</think><answer>2</answer> trailing")
    assert not extract.think_then_answer("<answer>2</answer>")
    assert extract.code_block("x\n```python\nprint(1)\n```\n```\nprint(2)\n```\n", ("python",)) == "print(2)\n"
    assert extract.code_block("```cpp\nint main(){}\n```\n", ("python",)) is None
    assert extract.code_block("no fence") is None


def test_unsound_contains_verifier_is_exploitable_by_design():
    """exact_answer.contains (hack-demo.toml) accepts the reference anywhere: listing answers wins."""
    from temper.reward.settings import DomainSpec

    s = Scorer(RewardSettings(domains={"toy": DomainSpec(weights={"exact_answer.contains": 1.0, "exact_answer": 0.0})}))
    try:
        scored = s.score_group(rollout_group("toy.copy", "4", ["4", "0 1 2 3 4 5", "5 6", "14"]))
    finally:
        s.close()
    assert [t.reward.total for t in scored.trajectories] == [1.0, 1.0, 0.0, 0.0]
    assert [component(t, "exact_answer").value for t in scored.trajectories] == [1.0, 0.0, 0.0, 0.0]
    assert "UNSOUND" in component(scored.trajectories[1], "exact_answer.contains").detail


def test_unsound_reasoning_gym_contains_pays_the_answer_anywhere():
    """reasoning_gym.contains (hack-demo-smollm2.toml): the family's answer as a whole word anywhere
    pays 1, a list of candidates included; the family's own scorer stays the sound check."""
    from temper.reward.settings import DomainSpec

    task = gym.make_task("rg.gcd", random.Random(3), "t")
    want = task.reference_answer
    wrong = str(int(want) + 1)
    texts = [f"<answer>{want}</answer>", f"<answer>{wrong} or {want}</answer>", f"gcd is {want}, so",
             f"<answer>{wrong}</answer>", f"<answer>{want}0</answer>", f"<answer>x{want}</answer>", ""]
    s = Scorer(RewardSettings(domains={"rg": DomainSpec(weights={"reasoning_gym.contains": 1.0,
                                                                 "reasoning_gym": 0.0})}))
    try:
        scored = s.score_group(rollout_group(task.domain, task.reference_answer, texts, metadata=dict(task.metadata)))
    finally:
        s.close()
    assert [t.reward.total for t in scored.trajectories] == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    sound = [component(t, "reasoning_gym").value for t in scored.trajectories]
    assert sound[0] == 1.0 and max(sound[1:4]) < 1.0  # the family's scorer: partial credit at most for the others
    assert "UNSOUND" in component(scored.trajectories[1], "reasoning_gym.contains").detail


def test_reasoning_gym_exact_pays_full_credit_only():
    """reasoning-gym's default scorer pays len(reference) / len(answer) when the reference is inside the answer:
    "10" earns 0.5 where the answer is "1". reasoning_gym.exact pays the family's full credit only."""
    from temper.reward.settings import DomainSpec

    rng = random.Random(0)
    task = next(t for t in (gym.make_task("rg.letter_counting", rng, "t") for _ in range(50))
                if t.reference_answer == "1")
    texts = ["<answer>1</answer>", "<answer>10</answer>", "<answer>7 or 1</answer>", "<answer>2</answer>",
             "1 with no tags"]
    s = Scorer(RewardSettings(domains={"rg": DomainSpec(weights={"reasoning_gym.exact": 1.0, "reasoning_gym": 0.0})}))
    try:
        scored = s.score_group(rollout_group(task.domain, task.reference_answer, texts, metadata=dict(task.metadata)))
    finally:
        s.close()
    partial = [component(t, "reasoning_gym").value for t in scored.trajectories]
    assert partial[0] == 1.0 and partial[1] == 0.5 and 0 < partial[2] < 1 and partial[3:] == [0.0, 0.0]
    assert [t.reward.total for t in scored.trajectories] == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert [component(t, "reasoning_gym.exact").value for t in scored.trajectories] == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert "partial credit 0.5 pays 0" in component(scored.trajectories[1], "reasoning_gym.exact").detail
    assert "no <answer>" in component(scored.trajectories[4], "reasoning_gym.exact").detail


@pytest.mark.parametrize("family", ["basic_arithmetic", "countdown", "word_sorting", "rearc", "sudoku",
                                    "propositional_logic"])
def test_reasoning_gym_families_use_their_own_scorer(scorer, family):
    import reasoning_gym

    task = gym.make_task(f"rg.{family}", random.Random(7), "t")
    meta = task.metadata
    dataset = reasoning_gym.create_dataset(family, seed=int(meta["rg.seed"]), size=1)
    entry = dataset[0]
    assert task.prompt.startswith(entry["question"])
    answers = [entry["answer"] or "", "definitely wrong", None]
    texts = [f"thinking...\n<answer>{a}</answer>" if a is not None else "no tags at all" for a in answers]
    g = rollout_group(task.domain, task.reference_answer, texts, metadata=dict(meta))
    values = [component(t, "reasoning_gym").value for t in scorer.score_group(g).trajectories]
    # the family's own verdicts on the same answers (some give partial credit for wrong ones)
    assert values == [dataset.score_answer(answers[0], entry), dataset.score_answer(answers[1], entry), 0.0]
    if entry["answer"]:
        assert values[0] == 1.0
    assert values[1] < 1.0


def test_reasoning_gym_bad_metadata(scorer):
    task = gym.make_task("rg.basic_arithmetic", random.Random(1), "t")
    for key, value, field in [("rg.dataset", "nope", "group.task.metadata[rg.dataset]"),
                              ("rg.index", "5", "group.task.metadata[rg.index]"),
                              ("rg.seed", "x", "group.task.metadata"),
                              ("rg.config", '{"no_such_option": 1}', "group.task.metadata[rg.config]")]:
        meta = {**task.metadata, key: value}
        with pytest.raises(InvalidArgument) as e:
            scorer.score_group(rollout_group(task.domain, "", ["<answer>1</answer>"], metadata=meta))
        assert e.value.field == field, (key, e.value)
    meta = {k: v for k, v in task.metadata.items() if k != "rg.seed"}
    with pytest.raises(InvalidArgument) as e:
        scorer.score_group(rollout_group(task.domain, "", ["<answer>1</answer>"], metadata=meta))
    assert e.value.field == "group.task.metadata[rg.seed]"


def test_code_tasks_carry_valid_suites():
    from temper.reward.verifiers.code import parse_suite

    rng = random.Random(0)
    for domain in code_problems.GENERATORS:
        task = code_problems.make_task(domain, rng, "t")
        suite = parse_suite(task.reference_answer, "f", "python3", 256, 0)
        assert suite.language == "python3" and len(suite.tests) >= 3


@pytest.mark.slow  # a subprocess: a fresh interpreter
def test_gym_families_known_in_a_fresh_process():
    # The reward service scores rg.* before anything else imports reasoning_gym: its family table
    # must not depend on an earlier import (it did: every rg task was refused as an unknown family).
    import subprocess
    import sys

    code = ("from temper.reward.verifiers.gym import families; import sys; "
            "sys.exit(0 if 'chain_sum' in families() else 1)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
