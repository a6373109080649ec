"""Multi-step arithmetic chains: tasks whose answer is a sequence of steps, one per line, so that a
process reward (a PRM's, or the rule-based ``exact_steps``) can tell which step went wrong.

- ``chain.add_sub``: start with a one-digit number, then three additions or subtractions of one-digit
  numbers (every intermediate result stays >= 0). The prompt is plain text, not a chat turn: two worked
  examples (drawn from the same rng, so a task is reproducible from its seed), each a line "Start with
  3, then add 6, then subtract 2." followed by one line per step, "3 + 6 = 9", examples apart by a blank
  line; then the task's own first line. A model continues with the steps, and its answer ends at the
  first blank line (the job's ``stop = ["\\n\\n"]`` ends generation there).

The reference answer is the steps joined by "\\n" ("3 + 6 = 9\\n9 - 2 = 7\\n7 + 1 = 8"): with the
domain's step delimiter "\\n" it is also the expected step sequence of ``exact_steps``. The outcome
verifier ``chain_final`` (``temper.reward.verifiers.basic.ChainFinal``) credits an answer whose step lines
up to its first blank line are as many as the reference's and whose last one ends "= <the final result>".
SmolLM2-135M-Instruct (T = 0.6) gets its first step right in ~60 % of answers, the second in ~30 %, the
third (the answer) in ~5 %: a chain it can learn step by step.
"""

from __future__ import annotations

import random

from temper.runtime.errors import InvalidArgument
from temper.v1 import common_pb2

STEPS = 3
EXAMPLES = 2


def _chain(rng: random.Random, steps: int = STEPS) -> tuple[str, list[str]]:
    """(the task's line, its step lines)."""
    start = x = rng.randint(1, 9)
    ops, lines = [], []
    for _ in range(steps):
        b = rng.randint(1, 9)
        if rng.random() < 0.5 or x - b < 0:
            ops.append(f"add {b}")
            lines.append(f"{x} + {b} = {x + b}")
            x += b
        else:
            ops.append(f"subtract {b}")
            lines.append(f"{x} - {b} = {x - b}")
            x -= b
    return f"Start with {start}, then {', then '.join(ops)}.", lines


def _add_sub(rng: random.Random) -> tuple[str, str]:
    shots = [_chain(rng) for _ in range(EXAMPLES)]
    question, lines = _chain(rng)
    prompt = "".join(f"{q}\n" + "\n".join(steps) + "\n\n" for q, steps in shots) + question + "\n"
    return prompt, "\n".join(lines)


GENERATORS = {"chain.add_sub": _add_sub}


def make_task(domain: str, rng: random.Random, task_id: str) -> common_pb2.Task:
    if domain not in GENERATORS:
        raise InvalidArgument(f"unknown domain {domain!r}; known: {sorted(GENERATORS)}", field="domains")
    prompt, answer = GENERATORS[domain](rng)
    return common_pb2.Task(task_id=task_id, domain=domain, prompt=prompt, reference_answer=answer)


def answer_lines(completion: str) -> list[str]:
    """The step lines of an answer: its non-empty lines before its first blank line, stripped."""
    head = completion.lstrip("\n").split("\n\n", 1)[0]
    return [line.strip() for line in head.split("\n") if line.strip()]


def result_of(line: str) -> str | None:
    """What a step line says its result is: the text after its last "=", stripped (None without one)."""
    return line.rsplit("=", 1)[1].strip() if "=" in line else None
