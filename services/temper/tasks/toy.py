"""Toy task domains with exact verifiers, for the walking-skeleton loop and tests.

Each domain generates prompts in the tiny model's word vocabulary and scores a completion
exactly: the answer is the first whitespace-separated word of the completion.

- ``toy.copy``: "copy d1 d2 d3"; answer d3 (the last digit shown).
- ``toy.next``: "next d1 d2 d3"; answer (d3 + 1) mod 10.
- ``toy.add``: "a + b" with single digits and a + b <= 9; answer a + b (harder: it needs
  attention over two operands; the tiny model learns it slowly).
A random policy over the tiny vocabulary (30 words) scores about 1/30 on each.
"""

from __future__ import annotations

import random

from temper.runtime.errors import InvalidArgument
from temper.v1 import common_pb2


def _add(rng: random.Random) -> tuple[str, str]:
    a = rng.randint(0, 9)
    b = rng.randint(0, 9 - a)
    return f"{a} + {b}", str(a + b)


def _copy(rng: random.Random) -> tuple[str, str]:
    digits = [str(rng.randint(0, 9)) for _ in range(3)]
    return f"copy {' '.join(digits)}", digits[-1]


def _next(rng: random.Random) -> tuple[str, str]:
    digits = [rng.randint(0, 9) for _ in range(3)]
    return f"next {' '.join(map(str, digits))}", str((digits[-1] + 1) % 10)


GENERATORS = {"toy.add": _add, "toy.copy": _copy, "toy.next": _next}


def make_task(domain: str, rng: random.Random, task_id: str) -> common_pb2.Task:
    if domain not in GENERATORS:
        raise InvalidArgument(f"unknown domain {domain!r}; known: {sorted(GENERATORS)}", field="domains")
    prompt, answer = GENERATORS[domain](rng)
    return common_pb2.Task(task_id=task_id, domain=domain, prompt=prompt, reference_answer=answer)


def extract_answer(completion: str) -> str | None:
    words = completion.split()
    return words[0] if words else None


def exact_answer_reward(completion: str, reference: str) -> float:
    """1.0 if the completion's first word equals the reference answer, else 0.0."""
    return 1.0 if extract_answer(completion) == reference.strip() else 0.0
