"""reasoning-gym's procedural task families as domains ``rg.<family>`` (e.g. ``rg.countdown``).

A task's metadata names the entry exactly (``rg.dataset``, ``rg.seed``, ``rg.size``, ``rg.index``,
``rg.config``), so the reward service rebuilds it and scores with the family's own
``score_answer``. The prompt asks for the answer in <answer></answer> tags.
"""

from __future__ import annotations

import functools
import json
import random

from temper.runtime.errors import InvalidArgument
from temper.v1 import common_pb2

PREFIX = "rg."
# The verifier reads the last <answer>...</answer> of the completion (temper.reward.verifiers.gym).
INSTRUCTION = "Give your final answer inside <answer></answer> tags."


def families() -> list[str]:
    import reasoning_gym  # noqa: F401 - importing the package registers its families in DATASETS
    from reasoning_gym.factory import DATASETS

    return sorted(n for n in DATASETS if n != "composite")  # composite needs a list of families to mix


def _family(domain: str) -> str:
    family = domain[len(PREFIX):] if domain.startswith(PREFIX) else ""
    if family not in families():
        raise InvalidArgument(f"unknown domain {domain!r}; reasoning-gym families are rg.<name> for name in "
                              f"{families()}", field="domains")
    return family


def check_config(domain: str, config: dict, field: str = "domain_config") -> None:
    """The family's own config class accepts ``config`` and builds an entry; InvalidArgument naming
    ``field`` (and the option) otherwise."""
    import dataclasses

    from reasoning_gym.factory import DATASETS

    family = _family(domain)
    if not isinstance(config, dict):
        raise InvalidArgument(f"must be a table of {family}'s options", field=field)
    known = {f.name for f in dataclasses.fields(DATASETS[family][1])} - {"seed", "size"}
    for key in sorted(config):
        if key not in known:
            raise InvalidArgument(f"{family} has no option {key!r}; its options: {sorted(known)}", field=f"{field}.{key}")
    try:
        make_task(domain, random.Random(0), "check", config)
    except InvalidArgument:
        raise
    except Exception as e:  # noqa: BLE001 - the family's own validation (assertions, type errors)
        raise InvalidArgument(f"{family} refuses {config}: {type(e).__name__}: {e}", field=field) from None


def make_task(domain: str, rng: random.Random, task_id: str, config: dict | None = None) -> common_pb2.Task:
    """One task of the family ``domain`` (``rg.<family>``); ``config`` sets the family's options (difficulty)."""
    import reasoning_gym

    family = _family(domain)
    seed = rng.randrange(2**31)
    config_json = json.dumps(config or {}, sort_keys=True)
    entry = reasoning_gym.create_dataset(family, seed=seed, size=1, **(config or {}))[0]
    answer = entry.get("answer")
    return common_pb2.Task(
        task_id=task_id, domain=domain, prompt=f"{entry['question']}\n\n{INSTRUCTION}",
        reference_answer="" if answer is None else str(answer),
        metadata={"rg.dataset": family, "rg.seed": str(seed), "rg.size": "1", "rg.index": "0", "rg.config": config_json})


def difficulty_ladder(domain: str) -> list[dict] | None:
    ladder = _ladder(_family(domain))
    return None if ladder is None else [dict(rung) for rung in ladder]


@functools.cache
def _ladder(family: str) -> list[dict] | None:
    """The family's difficulty levels as option sets (level i -> the knobs reasoning-gym's own curriculum
    sets at its global level i, ranges inclusive of the easier levels), or None for a family without a
    curriculum. Only the knobs the curriculum controls are in each option set."""
    from reasoning_gym.coaching.attributes import RangeAttributeDefinition, ScalarAttributeDefinition
    from reasoning_gym.factory import CURRICULA

    if family not in CURRICULA:
        return None
    curriculum = CURRICULA[family]()
    attrs = list(curriculum.attributes.values())
    if not attrs:
        return None
    fields = []
    for a in attrs:
        if isinstance(a, RangeAttributeDefinition):
            fields += [a.lower_field_name, a.upper_field_name]
        elif isinstance(a, ScalarAttributeDefinition):
            fields.append(a.field_name)
    ladder = []
    for level in range(max(len(a.levels) for a in attrs)):
        curriculum.set_global_level(level)  # attributes with fewer levels stay at their hardest
        config = curriculum.generate_configuration()
        ladder.append({f: getattr(config, f) for f in fields})
    return ladder
