"""Scoring: verifiers per domain, registered by name; composite total from the components.

Pure domain logic (no gRPC, no Kafka). A group with a bad request (unknown domain, missing
reference) raises InvalidArgument for synchronous callers; ``score_or_mark`` instead returns
the group with every reward carrying an explicit ERROR status, for the stream path where the
sample must go on, marked, rather than vanish or get a silent 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from temper.runtime.errors import InvalidArgument, require
from temper.tasks import toy
from temper.v1 import common_pb2

MAX_COMPLETION_CHARS = 1 << 20


@dataclass(frozen=True)
class Verifier:
    name: str
    score: Callable[[str, str], float]  # (completion text, reference answer) -> reward in [0, 1]
    needs_reference: bool = True


VERIFIERS: dict[str, Verifier] = {
    "exact_answer": Verifier("exact_answer", toy.exact_answer_reward),
}
# domain -> verifier name
DOMAIN_VERIFIERS: dict[str, str] = {domain: "exact_answer" for domain in toy.GENERATORS}


def score_group(group: common_pb2.RolloutGroup) -> common_pb2.RolloutGroup:
    """Return a copy of ``group`` with ``reward`` set on every trajectory."""
    domain = group.task.domain
    require(bool(group.group_id), "group.group_id", "required")
    require(domain in DOMAIN_VERIFIERS, "group.task.domain",
            f"unknown domain {domain!r}; known: {sorted(DOMAIN_VERIFIERS)}")
    verifier = VERIFIERS[DOMAIN_VERIFIERS[domain]]
    require(not verifier.needs_reference or bool(group.task.reference_answer.strip()),
            "group.task.reference_answer", f"domain {domain!r} needs a reference answer")
    require(len(group.trajectories) > 0, "group.trajectories", "empty group")
    scored = common_pb2.RolloutGroup()
    scored.CopyFrom(group)
    for i, traj in enumerate(scored.trajectories):
        require(len(traj.completion_text) <= MAX_COMPLETION_CHARS, f"group.trajectories[{i}].completion_text",
                f"longer than {MAX_COMPLETION_CHARS} characters")
        value = verifier.score(traj.completion_text, group.task.reference_answer)
        traj.reward.CopyFrom(common_pb2.Reward(
            total=value, status=common_pb2.REWARD_STATUS_OK,
            components=[common_pb2.RewardComponent(name=verifier.name, value=value, weight=1.0,
                                                   status=common_pb2.REWARD_STATUS_OK)]))
    return scored


def score_or_mark(group: common_pb2.RolloutGroup) -> common_pb2.RolloutGroup:
    """``score_group``, or the group with an ERROR reward on every trajectory saying why."""
    try:
        return score_group(group)
    except InvalidArgument as e:
        marked = common_pb2.RolloutGroup()
        marked.CopyFrom(group)
        for traj in marked.trajectories:
            traj.reward.CopyFrom(common_pb2.Reward(status=common_pb2.REWARD_STATUS_ERROR, components=[
                common_pb2.RewardComponent(name="request", status=common_pb2.REWARD_STATUS_ERROR, error=str(e))]))
        return marked
