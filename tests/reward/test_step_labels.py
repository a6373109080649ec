"""Math-Shepherd step labels (temper.reward.step_labels) with a scripted policy and verifier whose step
structure is known: a correct first step and a wrong second step give the labels worked out by hand."""

from __future__ import annotations

import json

import pytest

from temper.reward.dataset import records_from_group
from temper.reward.step_labels import (
    LABEL_DEFAULTS,
    LabelOptions,
    Rollout,
    Rollouts,
    Sampled,
    Verdict,
    label,
    resolve_settings,
    split_heldout,
    step_accuracy,
    step_auc,
)
from temper.reward.train import load_records
from temper.runtime.errors import InvalidArgument
from temper.v1 import common_pb2

# 2 + 3 = 5, then 5 * 4 = 20. The trajectory gets step 1 right and step 2 wrong.
TASK = common_pb2.Task(task_id="t1", domain="math.chain", prompt="(2 + 3) * 4 = ?", reference_answer="20")
COMPLETION = "a = 5\nb = 21\nanswer 21"


class Scripted:
    """A policy that finishes a prefix right exactly when every step so far is right: from "a = 5\\n" half
    its rollouts go on right (the odd ones slip), from "a = 5\\nb = 21\\n" it can only repeat the wrong value."""

    def __init__(self):
        self.calls: list[tuple[list[str], int]] = []

    def __call__(self, task, prefixes, k):
        self.calls.append((list(prefixes), k))
        out = []
        for p in prefixes:
            if p.endswith("b = 21\n"):
                out.append([Rollout("answer 21") for _ in range(k)])
            elif p.endswith("a = 5\n"):
                out.append([Rollout("b = 20\nanswer 20" if j % 2 == 0 else "b = 19\nanswer 19") for j in range(k)])
            else:
                out.append([Rollout("answer 0") for _ in range(k)])
        return Rollouts(out, policy_version=7)


def verifier(task, completions):
    return [Verdict(float(c.text.rstrip().endswith(f"answer {task.reference_answer}")), "exact_answer")
            for c in completions]


def sampled(completion=COMPLETION, task=TASK, i=0):
    return Sampled(task, completion, "stop", job_id="job-1", group_id=f"job-1/s0/p{i}",
                   trajectory_id=f"job-1/s0/p{i}/0", policy_version=3)


def test_a_right_step_then_a_wrong_step():
    gen = Scripted()
    run = label([sampled()], gen, verifier, LabelOptions(k=4, budget=100, delimiter="\n"))
    assert gen.calls == [(["a = 5\n", "a = 5\nb = 21\n"], 4)]  # one prefix per step but the last, each at a step's end
    [rec] = run.records
    assert rec["steps"] == ["a = 5", "\nb = 21", "\nanswer 21"]
    assert rec["soft_labels"] == [0.5, 0.0, 0.0]  # 2 of 4 right after step 1; none after step 2; the outcome is wrong
    assert rec["hard_labels"] == [1.0, 0.0, 0.0]
    assert rec["step_labels"] == rec["soft_labels"] and rec["label_kind"] == "soft"
    assert run.rollouts == 8
    prov = rec["provenance"]
    assert (prov["job_id"], prov["policy_version"], prov["rollout_policy_version"]) == ("job-1", 3, 7)
    assert (prov["verifier"], prov["k"], prov["delimiter"], prov["rollouts"]) == ("exact_answer", 4, "\n", 8)
    assert rec["trajectory_id"] == "job-1/s0/p0/0" and rec["prompt"] == TASK.prompt


def test_hard_labels_and_a_right_outcome():
    right = "a = 5\nb = 20\nanswer 20"
    run = label([sampled(right)], Scripted(), verifier, LabelOptions(k=2, budget=100, delimiter="\n", label_kind="hard"))
    [rec] = run.records
    # from "a = 5\nb = 20\n" the scripted policy knows no continuation: both rollouts wrong, though the step is right
    assert rec["soft_labels"] == [0.5, 0.0, 1.0]
    assert rec["step_labels"] == rec["hard_labels"] == [1.0, 0.0, 1.0]


def test_budget_is_never_exceeded():
    gen = Scripted()
    # each trajectory: 3 steps -> 2 prefixes x k=2 = 4 rollouts; 10 allows two of three
    run = label([sampled(i=i) for i in range(3)], gen, verifier, LabelOptions(k=2, budget=10, delimiter="\n"))
    assert len(run.records) == 2 and run.rollouts == 8 <= 10
    assert sum(len(p) * k for p, k in gen.calls) == run.rollouts  # what was asked of the policy is what was counted
    assert run.skipped["over_budget"] == 1
    # a shorter trajectory still fits the budget left after a long one is refused
    short = sampled("a = 5\nanswer 21", i=9)
    run = label([sampled(i=i) for i in range(2)] + [short], Scripted(), verifier,
                LabelOptions(k=3, budget=9, delimiter="\n"), seed=0)
    assert run.rollouts <= 9
    assert [r["trajectory_id"] for r in run.records].count("job-1/s0/p9/0") == 1


def test_response_prefix_is_a_step_the_policy_continues_after():
    task = common_pb2.Task(task_id="t2", domain="math.chain", prompt="p", reference_answer="20",
                           metadata={"response_prefix": "Let us think.\n"})
    gen = Scripted()
    run = label([sampled(COMPLETION, task)], gen, verifier, LabelOptions(k=2, budget=100, delimiter="\n"))
    [rec] = run.records
    assert rec["steps"][0] == "Let us think." and "".join(rec["steps"]) == "Let us think.\n" + COMPLETION
    # the prefixes handed to the policy are completion-side (the engine prefills the response prefix itself):
    # the prefix's own step is continued from nothing (fresh samples)
    assert gen.calls[0][0] == ["", "a = 5\n", "a = 5\nb = 21\n"]
    assert rec["soft_labels"] == [0.0, 0.5, 0.0, 0.0]
    assert run.rollouts == 6
    # a response prefix with the delimiter inside it: its first step ends where no rollout can start
    inside = common_pb2.Task(task_id="t3", domain="math.chain", prompt="p", reference_answer="20",
                             metadata={"response_prefix": "A\nB: "})
    run = label([sampled(COMPLETION, inside)], Scripted(), verifier, LabelOptions(k=2, budget=100, delimiter="\n"))
    assert run.records == [] and run.skipped["step_in_prefix"] == 1 and run.rollouts == 0


def test_a_step_the_verifier_could_not_score_leaves_the_trajectory_unlabelled():
    def failing(task, completions):
        return [Verdict(None, "exact_answer")] + verifier(task, completions)[1:]

    run = label([sampled()], Scripted(), failing, LabelOptions(k=2, budget=100, delimiter="\n"))
    assert run.records == [] and run.skipped["score_error"] == 1


def test_single_step_trajectories_are_skipped():
    run = label([sampled("answer 20"), sampled()], Scripted(), verifier, LabelOptions(k=2, budget=100, delimiter="\n"))
    assert len(run.records) == 1 and run.skipped["too_few_steps"] == 1


@pytest.mark.parametrize("options, field", [
    (LabelOptions(k=2, budget=0, delimiter="\n"), "--budget"),
    (LabelOptions(k=0, budget=10, delimiter="\n"), "--k"),
    (LabelOptions(k=2, budget=10, delimiter="\n\n"), "--delimiter"),  # never occurs in the completion
    (LabelOptions(k=2, budget=10, delimiter=""), "--delimiter"),
    (LabelOptions(k=2, budget=10, delimiter="\n", threshold=0), "--threshold"),
])
def test_bad_options_are_refused_before_any_rollout(options, field):
    gen = Scripted()
    with pytest.raises(InvalidArgument) as e:
        label([sampled()], gen, verifier, options)
    assert e.value.field == field
    assert gen.calls == []


def test_settings_come_from_the_flag_else_the_job_table_else_the_default():
    table = {"k": 3, "budget": 12, "label": "hard", "delimiter": {"toy.copy": " "}}
    values, sources = resolve_settings(table, {"k": 5, "budget": None, "threshold": 0.5, "delimiter": None})
    assert values == {"k": 5, "budget": 12, "label": "hard", "threshold": 0.5, "min_steps": 2, "max_steps": 64,
                      "delimiter": {"toy.copy": " "}}
    assert sources == {"k": "flag --k", "budget": "job.step_labels", "label": "job.step_labels",
                       "threshold": "flag --threshold", "min_steps": "default", "max_steps": "default",
                       "delimiter": "job.step_labels"}
    assert resolve_settings(None, {}) == (LABEL_DEFAULTS, dict.fromkeys(LABEL_DEFAULTS, "default"))


@pytest.mark.parametrize("table, flags, field, allowed", [
    ({"budgett": 5}, {}, "job.step_labels.budgett", "allowed: k, budget, label, threshold, min_steps, max_steps"),
    ({"budget": 0}, {}, "job.step_labels.budget", "must be >= 1"),
    ({"budget": "512"}, {}, "job.step_labels.budget", "must be an integer"),
    ({"k": True}, {}, "job.step_labels.k", "must be an integer"),
    ({"label": "fuzzy"}, {}, "job.step_labels.label", "one of soft, hard"),
    ({"threshold": 1.5}, {}, "job.step_labels.threshold", "(0, 1]"),
    ({"min_steps": 4, "max_steps": 3}, {}, "job.step_labels.max_steps", ">= min_steps (4)"),
    ({"delimiter": ""}, {}, "job.step_labels.delimiter", "non-empty string"),
    ({"delimiter": {"toy.copy": 1}}, {}, "job.step_labels.delimiter.toy.copy", "non-empty string"),
    ({"budget": 10}, {"budget": 0}, "--budget", "must be >= 1"),  # the flag set the bad value: named as the flag
    ({"max_steps": 3}, {"min_steps": 4}, "job.step_labels.max_steps", ">= min_steps (4)"),
])
def test_bad_settings_are_refused_naming_the_table_key_or_flag(table, flags, field, allowed):
    with pytest.raises(InvalidArgument) as e:
        resolve_settings(table, flags)
    assert e.value.field == field and allowed in e.value.message, str(e.value)


def test_records_are_what_the_prm_trainer_reads(tmp_path):
    run = label([sampled(i=i) for i in range(2)], Scripted(), verifier, LabelOptions(k=2, budget=100, delimiter="\n"))
    path = tmp_path / "labels.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in run.records))
    loaded = load_records([path])
    assert [r["step_labels"] for r in loaded] == [[0.5, 0.0, 0.0]] * 2


def test_export_records_carry_what_labelling_needs():
    task = common_pb2.Task(task_id="t", domain="toy.copy", prompt="copy 1 2 4", reference_answer="4",
                           metadata={"response_prefix": "<a>"})
    ok = common_pb2.Reward(total=1.0, status=common_pb2.REWARD_STATUS_OK, components=[
        common_pb2.RewardComponent(name="exact_answer", value=1.0, weight=1.0, status=common_pb2.REWARD_STATUS_OK)])
    group = common_pb2.RolloutGroup(group_id="g", job_id="j", task=task, trajectories=[
        common_pb2.Trajectory(trajectory_id="g/0", completion_text="4 7", policy_version=5, finish_reason="length",
                              reward=ok)])
    [rec] = [r for r in records_from_group(group) if "label" in r]
    back = Sampled.from_record(json.loads(json.dumps(rec)))
    assert back.task == task and back.completion == "4 7" and back.finish_reason == "length"
    assert (back.policy_version, back.job_id, back.trajectory_id) == (5, "j", "g/0")


def test_step_auc_and_accuracy_by_hand():
    # positives score 0.9, 0.4; negatives 0.4, 0.1: pairs (0.9>0.4) (0.9>0.1) (0.4=0.4: half) (0.4>0.1) -> 3.5 / 4
    scores, labels = [0.9, 0.4, 0.4, 0.1], [1.0, 1.0, 0.0, 0.0]
    assert step_auc(scores, labels) == 0.875
    assert step_accuracy(scores, labels) == 0.75  # 0.4 of a positive step is below 0.5
    assert step_auc([0.2, 0.3], [1.0, 1.0]) is None and step_accuracy([], []) is None


def test_heldout_split_keeps_tasks_whole():
    recs = [{"task_id": f"t{i // 2}", "trajectory_id": f"t{i // 2}/{i % 2}"} for i in range(8)]  # 4 tasks x 2
    train, held = split_heldout(recs, 0.25, seed=1)
    assert len(held) == 2 and len(train) == 6
    assert not {r["task_id"] for r in train} & {r["task_id"] for r in held}
    train, held = split_heldout(recs[:2], 0.5)  # one task: nothing can be held out
    assert held == [] and len(train) == 2
