"""The shipped benchmark sets scored for real: every HumanEval problem's canonical solution passes its own
check() in the real sandbox (gVisor) and a wrong body fails it; every CHAMP answer kept is accepted by the
math verifier when boxed, and a wrong one is not."""

from __future__ import annotations

import gzip
import json
import random

import pytest

from temper import tasks
from temper.reward.core import Scorer
from temper.reward.settings import RewardSettings
from temper.reward.verifiers.code import sandbox_runner
from temper.tasks import data, shipped
from temper.v1 import common_pb2


def _group(task: common_pb2.Task, texts: list[str], gid: str) -> common_pb2.RolloutGroup:
    return common_pb2.RolloutGroup(group_id=gid, job_id="j", task=task, trajectories=[
        common_pb2.Trajectory(trajectory_id=f"{gid}/{k}", group_id=gid, completion_text=t) for k, t in enumerate(texts)])


@pytest.mark.timeout(900)
def test_every_humaneval_canonical_solution_passes_in_the_sandbox_and_a_wrong_body_fails(sandbox):
    problems = {}
    with gzip.open(shipped.path("humaneval", "dataset"), "rt") as f:
        for line in f:
            p = json.loads(line)
            problems[p["prompt"]] = p
    ds = data.load("data.humaneval", {"dataset": "humaneval"})
    assert len(ds.train) == len(problems) == 164
    scorer = Scorer(RewardSettings(), sandbox=sandbox_runner(sandbox.address))
    failed = []
    try:
        for i, row in enumerate(ds.train):
            p = problems[row.prompt.rsplit("\n\n", 1)[0]]
            task = common_pb2.Task(task_id=f"t{i}", domain="data.humaneval", prompt=row.prompt,
                                   reference_answer=row.answer, metadata={"verifier": ds.verifier})
            right = f"```python\n{p['prompt']}{p['canonical_solution']}```"
            wrong = f"```python\n{p['prompt']}    return None\n```"
            scored = scorer.score_group(_group(task, [right, wrong], f"g{i}"))
            totals = [t.reward.total for t in scored.trajectories]
            if totals != [1.0, 0.0]:
                failed.append((p["task_id"], totals, [c.detail for c in scored.trajectories[0].reward.components]))
    finally:
        scorer.close()
    assert not failed, failed[:5]


def test_every_champ_answer_kept_is_accepted_boxed_and_a_wrong_one_is_not(scorer):
    config = {"dataset": "champ"}
    ds = data.load("data.champ", config)
    task = tasks.make_task("data.champ", random.Random(0), "t", config)
    assert task.metadata["verifier"] == "math"
    refused = []
    for i, row in enumerate(ds.train):
        t = common_pb2.Task(task_id=f"t{i}", domain="data.champ", prompt=row.prompt, reference_answer=row.answer,
                            metadata={"verifier": "math"})
        scored = scorer.score_group(_group(t, [f"So the answer is \\boxed{{{row.answer}}}.", "\\boxed{98765}"], "g"))
        totals = [x.reward.total for x in scored.trajectories]
        if totals != [1.0, 0.0] and row.answer != "98765":
            refused.append((row.where, row.answer, totals))
    assert not refused, refused
