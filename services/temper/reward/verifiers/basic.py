"""Verifiers that need no worker: exact answers of the toy domains, and format checks."""

from __future__ import annotations

from collections.abc import Sequence

from temper.reward.steps import split_steps
from temper.reward.verifiers import Check, StepVerifier, Verifier, extract, register, short
from temper.tasks import chain, toy


@register
class ExactAnswer(Verifier):
    """1 if the completion's first word equals the reference answer (the toy domains)."""

    name = "exact_answer"
    components = ("exact_answer",)

    def verify(self, completions: Sequence[str], prepared: str) -> list[list[Check]]:
        return [[Check(self.name, toy.exact_answer_reward(c, prepared),
                       detail=short(f"first word {toy.extract_answer(c)!r}"))] for c in completions]


@register
class ExactSteps(StepVerifier):
    """A rule-based process verifier: the reference answer, split at the same step delimiter as the
    completion, is the expected step sequence. Step i scores 1 if it equals reference step i (both
    whitespace-stripped), else 0 (a step beyond the reference scores 0); the value is the matched
    steps over max(completion steps, reference steps), so 1 exactly when every step is right and
    there are no extra ones. On the toy domains with step delimiter " " a step is one word: the
    answer word, then anything the policy adds after it."""

    name = "exact_steps"
    components = ("exact_steps",)

    def verify_steps(self, steps, prepared: str, delimiter: str) -> list[list[Check]]:
        want = [s.strip() for s in split_steps(prepared, delimiter)]
        out = []
        for mine in steps:
            scores = tuple(float(i < len(want) and s.strip() == want[i]) for i, s in enumerate(mine))
            value = sum(scores) / max(len(scores), len(want), 1)
            out.append([Check(self.name, value, detail=f"{int(sum(scores))}/{len(want)} steps right, "
                                                       f"{len(scores)} given", steps=scores)])
        return out


@register
class ChainFinal(Verifier):
    """The outcome of a multi-step chain (``temper.tasks.chain``): 1 if the answer's step lines (before its
    first blank line) are as many as the reference's and the last one ends "= <the reference's final
    result>", else 0. Intermediate steps are not checked here (``exact_steps`` or a PRM does that)."""

    name = "chain_final"
    components = ("chain_final",)

    def verify(self, completions: Sequence[str], prepared: str) -> list[list[Check]]:
        want = chain.answer_lines(prepared)
        final = chain.result_of(want[-1]) if want else None
        out = []
        for c in completions:
            mine = chain.answer_lines(c)
            got = chain.result_of(mine[-1]) if mine else None
            right = final is not None and len(mine) == len(want) and got == final
            out.append([Check(self.name, float(right),
                              detail=short(f"{len(mine)}/{len(want)} step lines, final {got!r}"))])
        return out


@register
class ContainsAnswerUNSOUND(Verifier):
    """DELIBERATELY UNSOUND, for reward-hacking demonstrations and monitor tests only: 1 if the
    reference answer appears as any word of the completion. A policy that lists many candidate
    answers scores without knowing the right one (see the shipped job hack-demo.toml)."""

    name = "exact_answer.contains"
    components = ("exact_answer.contains",)

    def verify(self, completions: Sequence[str], prepared: str) -> list[list[Check]]:
        want = prepared.strip()
        return [[Check(self.name, float(want in c.split()), detail="UNSOUND: reference anywhere in the answer")]
                for c in completions]


class FormatCheck(Verifier):
    """1 if the completion has the expected shape, else 0; needs no reference."""

    needs_reference = False

    def prepare(self, task, field):
        return None

    def verify(self, completions: Sequence[str], prepared: None) -> list[list[Check]]:
        return [[self.check(c)] for c in completions]

    def check(self, completion: str) -> Check:
        raise NotImplementedError


@register
class BoxedFormat(FormatCheck):
    name = "format.boxed"
    components = ("format.boxed",)

    def check(self, completion):
        found = extract.last_boxed(completion) is not None
        return Check(self.name, float(found), detail="" if found else "no \\boxed{} answer")


@register
class AnswerTagFormat(FormatCheck):
    name = "format.answer_tag"
    components = ("format.answer_tag",)

    def check(self, completion):
        found = extract.tagged(completion, "answer") is not None
        return Check(self.name, float(found), detail="" if found else "no <answer>...</answer>")


@register
class ThinkAnswerFormat(FormatCheck):
    name = "format.think_answer"
    components = ("format.think_answer",)

    def check(self, completion):
        ok = extract.think_then_answer(completion)
        return Check(self.name, float(ok), detail="" if ok else "not <think>...</think><answer>...</answer>")


@register
class CodeBlockFormat(FormatCheck):
    name = "format.code_block"
    components = ("format.code_block",)

    def check(self, completion):
        found = extract.code_block(completion) is not None
        return Check(self.name, float(found), detail="" if found else "no fenced code block")
