"""Reasoning steps of a completion: where the reward service splits text, and where each step ends.

A completion's steps are the pieces between occurrences of the domain's step delimiter
(``[reward.domains.NAME].step_delimiter``, else ``[reward].prm_step_delimiter``); each step after the
first keeps its delimiter and empty pieces merge into the next, so ``"".join(steps) == completion``.
Step ``i`` ends at ``len(steps[0]) + ... + len(steps[i])`` (exclusive, in code points), so the last
step ends at ``len(completion)``: every character belongs to exactly one step. These ends travel
in ``Reward.step_end_chars`` beside ``Reward.step_rewards``; the learner maps them to tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate


def split_steps(completion: str, delimiter: str) -> list[str]:
    """Steps of ``completion`` at ``delimiter``, each after the first keeping its delimiter, empty ones merged
    into the next, so that ``"".join(steps) == completion``."""
    if not delimiter:
        raise ValueError("empty step delimiter")
    parts = completion.split(delimiter)
    steps: list[str] = []
    carry = ""
    for i, part in enumerate(parts):
        text = carry + (delimiter if i else "") + part
        if part.strip():
            steps.append(text)
            carry = ""
        else:
            carry = text
    if carry:
        if steps:
            steps[-1] += carry
        else:
            steps.append(carry)
    return steps


def step_end_chars(steps: Sequence[str], skip: int = 0) -> list[int]:
    """Exclusive end of each step in the text ``"".join(steps)[skip:]``: a step that ends within the first
    ``skip`` characters (a prefilled ``response_prefix`` the completion continues) ends at 0."""
    return [max(0, end - skip) for end in accumulate(len(s) for s in steps)]
