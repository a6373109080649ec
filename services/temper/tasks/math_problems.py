"""Procedural math problems with LaTeX reference answers, checked by the reward service's math verifier.

Each family draws its numbers from the rng and computes the answer with sympy, so every
reference is exact. Prompts ask for the final answer in \\boxed{} (the verifier's default
``answer_format``). Domains:

- ``math.fraction_sum``: a/b + c/d, answer in lowest terms (e.g. \\frac{5}{6});
- ``math.linear_equation``: a x + b = c, answer x (an integer or a fraction);
- ``math.inequality``: a x + b < c, answer an interval ((-\\infty, r) or (r, \\infty));
- ``math.quadratic_roots``: x^2 + p x + q = 0 with two distinct integer roots, answer the set {r1, r2}.
"""

from __future__ import annotations

import random

from temper.runtime.errors import InvalidArgument
from temper.v1 import common_pb2

INSTRUCTION = "Put your final answer in \\boxed{}."


def _latex(value) -> str:
    import sympy

    return sympy.latex(sympy.nsimplify(value))


def _nonzero(rng: random.Random, lo: int, hi: int) -> int:
    return rng.choice([v for v in range(lo, hi + 1) if v != 0])


def _lhs(a: int, b: int) -> str:
    """a x + b as a person writes it: no 1x, no + -3."""
    ax = {1: "x", -1: "-x"}.get(a, f"{a}x")
    return ax if b == 0 else f"{ax} {'+' if b > 0 else '-'} {abs(b)}"


def _fraction_sum(rng: random.Random) -> tuple[str, str]:
    import sympy

    a, c = rng.randint(1, 9), rng.randint(1, 9)
    b, d = rng.randint(2, 12), rng.randint(2, 12)
    return (f"Compute $\\frac{{{a}}}{{{b}}} + \\frac{{{c}}}{{{d}}}$ in lowest terms.",
            _latex(sympy.Rational(a, b) + sympy.Rational(c, d)))


def _linear_equation(rng: random.Random) -> tuple[str, str]:
    import sympy

    a, b, c = _nonzero(rng, -9, 9), rng.randint(-20, 20), rng.randint(-20, 20)
    return f"Solve for $x$: ${_lhs(a, b)} = {c}$.", _latex(sympy.Rational(c - b, a))


def _inequality(rng: random.Random) -> tuple[str, str]:
    import sympy

    a, b, c = _nonzero(rng, -9, 9), rng.randint(-20, 20), rng.randint(-20, 20)
    bound = _latex(sympy.Rational(c - b, a))
    answer = f"(-\\infty, {bound})" if a > 0 else f"({bound}, \\infty)"
    return (f"Solve ${_lhs(a, b)} < {c}$ for $x$. Give the solution set in interval notation.",
            answer)


def _quadratic_roots(rng: random.Random) -> tuple[str, str]:
    r1, r2 = rng.sample(range(-9, 10), 2)
    p, q = -(r1 + r2), r1 * r2

    def term(coef: int, var: str) -> str:
        if coef == 0:
            return ""
        mag = "" if abs(coef) == 1 and var else str(abs(coef))
        return f" {'+' if coef > 0 else '-'} {mag}{var}"

    lo, hi = sorted((r1, r2))
    return (f"Find all real solutions of $x^2{term(p, 'x')}{term(q, '')} = 0$. Give them as a set.",
            f"\\{{{lo}, {hi}\\}}")


GENERATORS = {"math.fraction_sum": _fraction_sum, "math.linear_equation": _linear_equation,
              "math.inequality": _inequality, "math.quadratic_roots": _quadratic_roots}


def make_task(domain: str, rng: random.Random, task_id: str) -> common_pb2.Task:
    if domain not in GENERATORS:
        raise InvalidArgument(f"unknown domain {domain!r}; known: {sorted(GENERATORS)}", field="domains")
    question, answer = GENERATORS[domain](rng)
    return common_pb2.Task(task_id=task_id, domain=domain, prompt=f"{question} {INSTRUCTION}", reference_answer=answer)
