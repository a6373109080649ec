"""Procedural programming problems whose reference answer is a test suite the sandbox runs.

The reference_answer is the JSON test suite the reward service's code verifier reads (see
``temper.reward.verifiers.code``): stdin -> expected stdout cases, or Python assertion scripts.
Domains:

- ``code.sum_numbers``: read space-separated integers, print their sum (stdin/stdout);
- ``code.reverse_words``: read a line, print its words in reverse order (stdin/stdout);
- ``code.fibonacci``: define ``fib(n)`` (assertions).
"""

from __future__ import annotations

import json
import random

from temper.runtime.errors import InvalidArgument
from temper.v1 import common_pb2

INSTRUCTION = "Answer with a complete Python 3 program in a ```python code block."
WORDS = ["alpha", "beta", "gamma", "delta", "red", "green", "blue", "one", "two", "three", "sun", "moon"]


def _sum_numbers(rng: random.Random) -> tuple[str, dict]:
    tests = []
    for _ in range(4):
        nums = [rng.randint(-1000, 1000) for _ in range(rng.randint(1, 8))]
        tests.append({"stdin": " ".join(map(str, nums)) + "\n", "expected_stdout": f"{sum(nums)}\n"})
    return ("Read one line of space-separated integers from standard input and print their sum.",
            {"language": "python3", "tests": tests})


def _reverse_words(rng: random.Random) -> tuple[str, dict]:
    tests = []
    for _ in range(4):
        words = rng.choices(WORDS, k=rng.randint(1, 6))
        tests.append({"stdin": " ".join(words) + "\n", "expected_stdout": " ".join(reversed(words)) + "\n"})
    return ("Read one line from standard input and print its words in reverse order, separated by single spaces.",
            {"language": "python3", "tests": tests})


def _fibonacci(rng: random.Random) -> tuple[str, dict]:
    fib = [0, 1]
    while len(fib) < 40:
        fib.append(fib[-1] + fib[-2])
    ns = sorted(rng.sample(range(0, 40), 4))
    tests = [{"assertion": f"assert fib({n}) == {fib[n]}"} for n in ns]
    return ("Write a Python function `fib(n)` that returns the n-th Fibonacci number, with fib(0) = 0 and fib(1) = 1.",
            {"language": "python3", "tests": tests})


GENERATORS = {"code.sum_numbers": _sum_numbers, "code.reverse_words": _reverse_words, "code.fibonacci": _fibonacci}


def make_task(domain: str, rng: random.Random, task_id: str) -> common_pb2.Task:
    if domain not in GENERATORS:
        raise InvalidArgument(f"unknown domain {domain!r}; known: {sorted(GENERATORS)}", field="domains")
    question, suite = GENERATORS[domain](rng)
    return common_pb2.Task(task_id=task_id, domain=domain, prompt=f"{question} {INSTRUCTION}",
                           reference_answer=json.dumps(suite))
