"""Verifiers: rule-based reward components, registered by name.

A verifier checks the completions of one group against what the task carries (a reference
answer, a test suite, a procedural task's parameters) and returns one ``Check`` per component
it produces for every completion. Its ``prepare`` validates the task once per group and raises
InvalidArgument naming the field when the task is unusable (a request error, not the
policy's fault); a completion that is merely wrong, unparsable or badly formatted is the
policy's fault and scores 0 with a ``detail`` saying why. A component that could not be
computed for reasons outside the completion (the sandbox is down) is never a silent 0: it is
an exception or an ERROR check.

Adding a verifier: subclass ``Verifier``, decorate with ``@register``; a domain then uses its
component names as keys of ``weights`` in ``[reward.domains.NAME]``. A verifier that scores each
reasoning step subclasses ``StepVerifier``: the scorer hands it the completions already split at
the domain's step delimiter, and its Checks carry one score per step (``Check.steps``), which the
composite reward passes on as ``Reward.step_rewards``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from temper.v1 import common_pb2

MAX_DETAIL_CHARS = 200


@dataclass(frozen=True)
class Check:
    """One reward component of one completion, as a verifier computed it."""

    name: str
    value: float = 0.0
    detail: str = ""
    error: str = ""  # non-empty: not computed (status ERROR), never read as a reward of 0
    steps: tuple[float, ...] = ()  # per-step scores (process rewards), one per step of the completion

    def to_proto(self, weight: float) -> common_pb2.RewardComponent:
        status = common_pb2.REWARD_STATUS_ERROR if self.error else common_pb2.REWARD_STATUS_OK
        return common_pb2.RewardComponent(name=self.name, value=0.0 if self.error else self.value, weight=weight,
                                          status=status, error=self.error, detail=short(self.detail))


def passes(value: float, threshold: float = 1.0) -> bool:
    """A reward or component reaching ``threshold`` (full credit at the default 1), a float sum landing a hair
    below it included: what held-out accuracy, the scheduler's pass rates and ``reasoning_gym.exact`` count."""
    return value >= threshold - 1e-9


def short(text: str, limit: int = MAX_DETAIL_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Verifier(ABC):
    """Scores completions of one task; instances are shared by every caller (thread-safe)."""

    name: ClassVar[str]
    components: ClassVar[tuple[str, ...]]  # names of the Checks ``verify`` returns, in this order
    needs_reference: ClassVar[bool] = True  # prepare() refuses an empty reference_answer

    def __init__(self, settings=None, **dependencies):
        """``settings``: the service's RewardSettings; ``dependencies``: e.g. ``sandbox`` (a RunTests callable)."""
        self.settings = settings

    def prepare(self, task: common_pb2.Task, field: str) -> Any:
        """What ``verify`` needs from ``task``, validated once per group.

        ``field`` is the task's path in the request ("group.task"); a bad task raises InvalidArgument
        naming the sub-field, e.g. "group.task.reference_answer".
        """
        return task.reference_answer.strip()

    def prepare_group(self, group: common_pb2.RolloutGroup, field: str) -> Any:
        """``prepare`` for the group's task (``field`` is the group's path, "group"). A verifier that
        needs to know whose completions it checks (the code verifier tags its sandbox runs with the
        job, group, task and trajectory ids) overrides this one."""
        return self.prepare(group.task, f"{field}.task")

    @abstractmethod
    def verify(self, completions: Sequence[str], prepared: Any) -> list[list[Check]]:
        """One list of Checks (one per name in ``components``) for each completion."""

    def close(self) -> None:  # noqa: B027 - most verifiers hold nothing to release
        """Release workers or channels."""


class StepVerifier(Verifier):
    """Scores each reasoning step of a completion: one Check per component, whose ``steps`` hold one
    score per step and whose ``value`` summarises them."""

    def verify(self, completions: Sequence[str], prepared: Any) -> list[list[Check]]:
        """Steps split at the service's default delimiter (the scorer calls ``verify_steps`` with the
        domain's own)."""
        from temper.reward.steps import split_steps

        delimiter = self.settings.prm_step_delimiter if self.settings is not None else "\n\n"
        return self.verify_steps([split_steps(c, delimiter) for c in completions], prepared, delimiter)

    @abstractmethod
    def verify_steps(self, steps: Sequence[Sequence[str]], prepared: Any, delimiter: str) -> list[list[Check]]:
        """One list of Checks for each completion, given as its steps (split at ``delimiter``)."""


VERIFIER_TYPES: dict[str, type[Verifier]] = {}


def register(cls: type[Verifier]) -> type[Verifier]:
    if cls.name in VERIFIER_TYPES:
        raise ValueError(f"verifier {cls.name!r} registered twice")
    VERIFIER_TYPES[cls.name] = cls
    return cls
