"""Math answers checked with HuggingFace's math-verify (LaTeX, fractions, intervals, sets, equivalent forms).

The answer is taken from the completion (``MathOptions.answer_format``: the last \\boxed{}, the
last <answer> tag, or math-verify's own extraction) and compared with the reference by
math-verify: symbolic and numeric equality (1/2 = 0.5 = \\frac{1}{2}, but 0.333 != 1/3), interval
and set equality, ``x = 2`` against 2.

math-verify bounds sympy with ``signal.alarm``, which only works on a process's main thread,
and sympy can hang on adversarial input: 9^{9^{9^{9^9}}} is one C-level integer power that no
signal interrupts. So comparisons run in a pebble ``ProcessPool`` (spawned workers, each call on
a worker's main thread) with math-verify's own timeouts inside, and every answer scheduled with
``hard_timeout_seconds``: pebble kills a worker whose task outlives it and starts a fresh one, so
a hung answer costs one hard timeout, never a stuck service. A timed-out or hung comparison
scores 0 with a detail saying so (the answer was not shown equal; an adversarial answer must not
escape its 0 by hanging the checker).
"""

from __future__ import annotations

import functools
import multiprocessing
from collections.abc import Sequence
from concurrent.futures import TimeoutError as FutureTimeout

from pebble import ProcessExpired, ProcessPool

from temper.reward.verifiers import Check, Verifier, register, short
from temper.reward.verifiers import extract
from temper.runtime.errors import InvalidArgument, require
from temper.runtime.logs import get_logger

_log = get_logger(component="reward.math")


# -- worker side (runs in the pool's processes, on their main thread) -----------------------------
def _warm() -> None:
    import math_verify  # noqa: F401 - import once per worker (~1 s), not per call


def _latex(text: str) -> str:
    return text if ("$" in text or "\\boxed" in text or "\\(" in text) else f"${text}$"


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str, timeout: int):
    from math_verify import parse

    return parse(_latex(gold), parsing_timeout=timeout)


def check_answers(gold: str, answers: Sequence[str | None], whole: bool, timeout: int) -> list[tuple[float, str]] | None:
    """(value, detail) per answer, or None if the reference itself cannot be parsed.

    ``whole``: the answers are whole completions (math-verify extracts), else extracted answers.
    """
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    gold_parsed = _parse_gold(gold, timeout)
    if not gold_parsed:
        return None
    out: list[tuple[float, str]] = []
    for answer in answers:
        if answer is None:
            out.append((0.0, "no answer found"))
            continue
        try:
            pred = parse(answer if whole else _latex(answer), parsing_timeout=timeout, raise_on_error=True)
        except (Exception, TimeoutException) as e:  # noqa: BLE001 - math-verify raises many types: "unparsable"
            out.append((0.0, f"answer {answer!r} unparsable ({type(e).__name__})"))
            continue
        if not pred:
            out.append((0.0, f"answer {answer!r} unparsable"))
            continue
        try:
            ok = verify(gold_parsed, pred, timeout_seconds=timeout, raise_on_error=True)
        except (Exception, TimeoutException) as e:  # noqa: BLE001 - a timeout or sympy failure: not shown equal
            out.append((0.0, f"answer {pred[-1]!s} not comparable ({type(e).__name__})"))
            continue
        shown = pred[-1] if whole else answer
        out.append((1.0 if ok else 0.0, f"answer {shown!s} {'=' if ok else '!='} reference {gold!s}"))
    return out


# -- service side ----------------------------------------------------------------------------------


@register
class MathVerifier(Verifier):
    name = "math"
    components = ("math",)
    check = staticmethod(check_answers)  # what the workers run (module-level: spawned workers import it)

    def __init__(self, settings, **_):
        self.options = settings.math
        # pebble times each task from its start in a worker, kills a worker past the timeout and
        # replaces it; spawned workers (no forked threads or locks of the service)
        self._pool = ProcessPool(max_workers=self.options.workers, initializer=_warm,
                                 context=multiprocessing.get_context("spawn"))

    def prepare(self, task, field):
        reference = task.reference_answer.strip()
        require(len(reference) <= self.options.max_answer_chars, f"{field}.reference_answer",
                f"reference longer than {self.options.max_answer_chars} characters")
        return reference, f"{field}.reference_answer"

    def _answer(self, completion: str) -> str | None:
        fmt = self.options.answer_format
        if fmt == "auto":
            return completion
        found = extract.last_boxed(completion) if fmt == "boxed" else extract.tagged(completion, "answer")
        return found if found else None

    def verify(self, completions: Sequence[str], prepared: tuple[str, str]) -> list[list[Check]]:
        reference, field = prepared
        answers = [self._answer(c) for c in completions]
        too_long = [a is not None and self.options.answer_format != "auto" and len(a) > self.options.max_answer_chars
                    for a in answers]
        results = self._run(reference, field, [None if long else a for a, long in zip(answers, too_long)])
        checks = []
        for long, (value, detail, error) in zip(too_long, results):
            if long:
                detail = f"answer longer than {self.options.max_answer_chars} characters, not parsed"
            checks.append([Check(self.name, value, detail=short(detail), error=error)])
        return checks

    def _run(self, gold: str, field: str, answers: list[str | None]) -> list[tuple[float, str, str]]:
        """(value, detail, error) per answer; one pool task per answer, each with the hard timeout.

        A hung answer scores 0 (it was not shown equal in time; the same as a timeout math-verify
        catches itself); pebble replaces its worker and the other answers are unaffected.
        """
        timeout, hard = self.options.timeout_seconds, self.options.hard_timeout_seconds
        whole = self.options.answer_format == "auto"
        futures = [None if a is None else self._pool.schedule(self.check, (gold, [a], whole, timeout), timeout=hard)
                   for a in answers]
        out: list[tuple[float, str, str]] = []
        for a, future in zip(answers, futures):
            if future is None:
                out.append((0.0, "no answer found", ""))
                continue
            try:
                part = future.result()
            except FutureTimeout:
                _log.error("math-verify hung; worker replaced", seconds=hard, answer=short(str(a)))
                out.append((0.0, f"comparison hung past {hard:g}s (worker replaced)", ""))
                continue
            except ProcessExpired as e:  # the worker died under the answer (e.g. out of memory): not shown equal
                _log.error("math-verify worker died; replaced", exit_code=e.exitcode, answer=short(str(a)))
                out.append((0.0, f"comparison worker died (exit code {e.exitcode}; worker replaced)", ""))
                continue
            if part is None:
                for f in futures:
                    if f is not None:
                        f.cancel()
                raise InvalidArgument(f"math-verify cannot parse the reference {gold!r}", field=field)
            out.append((*part[0], ""))
        return out

    def close(self) -> None:
        self._pool.stop()
        self._pool.join()
