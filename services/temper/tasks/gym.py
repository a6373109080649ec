"""reasoning-gym's procedural task families as domains ``rg.<family>`` (e.g. ``rg.countdown``).

A task's metadata names the entry exactly (``rg.dataset``, ``rg.seed``, ``rg.size``, ``rg.index``,
``rg.config``), so the reward service rebuilds it and scores with the family's own
``score_answer``. The prompt asks for the answer in <answer></answer> tags.
"""

from __future__ import annotations

import json
import random

from temper.runtime.errors import InvalidArgument
from temper.v1 import common_pb2

PREFIX = "rg."
INSTRUCTION = "Give your final answer inside <answer></answer> tags."


def families() -> list[str]:
    from reasoning_gym.factory import DATASETS

    return sorted(n for n in DATASETS if n != "composite")  # composite needs a list of families to mix


def make_task(domain: str, rng: random.Random, task_id: str, config: dict | None = None) -> common_pb2.Task:
    """One task of the family ``domain`` (``rg.<family>``); ``config`` sets the family's options (difficulty)."""
    import reasoning_gym

    family = domain[len(PREFIX):] if domain.startswith(PREFIX) else ""
    if family not in families():
        raise InvalidArgument(f"unknown domain {domain!r}; reasoning-gym families are rg.<name> for name in "
                              f"{families()}", field="domains")
    seed = rng.randrange(2**31)
    config_json = json.dumps(config or {}, sort_keys=True)
    entry = reasoning_gym.create_dataset(family, seed=seed, size=1, **(config or {}))[0]
    answer = entry.get("answer")
    return common_pb2.Task(
        task_id=task_id, domain=domain, prompt=f"{entry['question']}\n\n{INSTRUCTION}",
        reference_answer="" if answer is None else str(answer),
        metadata={"rg.dataset": family, "rg.seed": str(seed), "rg.size": "1", "rg.index": "0", "rg.config": config_json})
