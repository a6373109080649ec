"""Every verifier module, imported so that each registers itself; the component -> verifier map."""

from __future__ import annotations

from temper.reward.verifiers import VERIFIER_TYPES, Verifier
from temper.reward.verifiers import basic, code, gym, math_answer, suites  # noqa: F401 - registration


def component_names() -> list[str]:
    return sorted(name for cls in VERIFIER_TYPES.values() for name in cls.components)


def verifier_of(component: str) -> type[Verifier] | None:
    for cls in VERIFIER_TYPES.values():
        if component in cls.components:
            return cls
    return None
