"""A math worker function that hangs in C on the answer "hang" (kept light: spawned workers import it)."""

from temper.reward.verifiers.math_answer import check_answers


def hanging_check(gold, answers, whole, timeout):
    if answers[0] == "hang":
        sum(range(10**13))  # one C call: math-verify's SIGALRM cannot interrupt it
    return check_answers(gold, answers, whole, timeout)
