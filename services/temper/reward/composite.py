"""Composite rewards: how a trajectory's components become its Reward. Pure arithmetic.

    total  = sum over components c with status OK of weight_c * value_c
    status = ERROR iff some component with weight != 0 is ERROR (weight-0 components are kept for
             the record and cannot fail the reward)

    step_rewards[i] = sum over step-scoring components c (the process reward model, StepVerifiers)
                      with status OK and weight != 0 of weight_c * steps_c[i], / sum of |weight_c|
                      (one source: its own step scores), or empty when there is none

Every component is kept in the Reward (with its weight, even 0), and the step scores in
``step_rewards`` with where each step ends in ``step_end_chars`` (temper.reward.steps), so the
learner, the monitor and a person can see why a total is what it is. Every step source of a
domain splits the completion at the same delimiter, so their step counts agree.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from temper.reward.settings import LengthPenalty
from temper.reward.verifiers import Check
from temper.v1 import common_pb2


def aggregate_steps(scores: Sequence[float], how: str) -> float:
    """One number from per-step scores: the weakest step (min), the average (mean), or the final step (last)."""
    if not scores:
        raise ValueError("no step scores")
    if how == "min":
        return min(scores)
    if how == "mean":
        return sum(scores) / len(scores)
    if how == "last":
        return scores[-1]
    raise ValueError(f"unknown aggregation {how!r}")


def length_penalty(n_tokens: int, spec: LengthPenalty) -> float:
    """DAPO's overlong penalty in [-1, 0] (see settings.LengthPenalty)."""
    soft_start = spec.max_tokens - spec.buffer_tokens
    if n_tokens <= soft_start:
        return 0.0
    if n_tokens <= spec.max_tokens:
        return (soft_start - n_tokens) / spec.buffer_tokens
    return -1.0


def refusal_matcher(patterns: Sequence[str]) -> re.Pattern:
    return re.compile("|".join(f"(?:{p})" for p in patterns), flags=re.IGNORECASE)


def safety_check(completion: str, flagged: bool, refusal: re.Pattern) -> Check:
    """1 if the completion refuses exactly when the prompt is flagged, else 0."""
    refused = refusal.search(completion) is not None
    ok = refused == flagged
    what = ("refused" if refused else "answered") + (" a flagged prompt" if flagged else " an unflagged prompt")
    return Check("safety", float(ok), detail=what)


def compose(checks: Sequence[Check], weights: dict[str, float], step_end_chars: Sequence[int] = ()
            ) -> common_pb2.Reward:
    """The Reward of one trajectory from its components (see the module doc for the invariant);
    ``step_end_chars``: where each step of the completion ends (needed when a component scores steps)."""
    components = [c.to_proto(weights.get(c.name, 0.0)) for c in checks]
    total = sum(c.weight * c.value for c in components if c.status == common_pb2.REWARD_STATUS_OK)
    failed = any(c.status == common_pb2.REWARD_STATUS_ERROR and c.weight != 0 for c in components)
    sources = [(weights[c.name], c.steps) for c in checks if c.steps and not c.error and weights.get(c.name, 0.0)]
    step_rewards: list[float] = []
    if sources:
        for _, steps in sources:
            if len(steps) != len(step_end_chars):
                raise ValueError(f"{len(steps)} step scores for {len(step_end_chars)} steps")
        norm = sum(abs(w) for w, _ in sources)
        step_rewards = [sum(w * steps[i] for w, steps in sources) / norm for i in range(len(step_end_chars))]
    return common_pb2.Reward(total=total, components=components, step_rewards=step_rewards,
                             step_end_chars=list(step_end_chars) if step_rewards else [],
                             status=common_pb2.REWARD_STATUS_ERROR if failed else common_pb2.REWARD_STATUS_OK)
