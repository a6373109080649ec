"""Code rewards against the real sandbox service (gVisor): correct, wrong, partial, timeout, compile
errors, assertion tests; and a clear verdict when the sandbox is down."""

from __future__ import annotations

import json
import random

import pytest

from temper.reward.core import Scorer
from temper.reward.settings import CodeOptions, RewardSettings
from temper.reward.verifiers.code import SandboxUnavailable, sandbox_runner
from temper.runtime.broker import free_port
from temper.runtime.errors import InvalidArgument
from temper.tasks import code_problems
from temper.v1 import common_pb2
from tests.builders import rollout_group
from tests.reward.conftest import component

SUM_SUITE = json.dumps({"tests": [{"stdin": "1 2\n", "expected_stdout": "3\n"},
                                  {"stdin": "-5 5 10\n", "expected_stdout": "10\n"},
                                  {"stdin": "7\n", "expected_stdout": "7\n"}], "wall_seconds": 2})


def py(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}\n```\n"


class Counting:
    """The real runner, counting calls."""

    def __init__(self, runner):
        self.runner, self.calls = runner, 0

    def __call__(self, request, timeout):
        self.calls += 1
        return self.runner(request, timeout)


@pytest.fixture(scope="module")
def counted(sandbox):
    return Counting(sandbox_runner(sandbox.address))


@pytest.fixture(scope="module")
def code_scorer(counted):
    s = Scorer(RewardSettings(), sandbox=counted)
    yield s
    s.close()


def values(scored, name="code.pass_fraction"):
    return [component(t, name).value for t in scored.trajectories]


def test_correct_partial_wrong_timeout(code_scorer, counted):
    texts = [
        py("print(sum(map(int, input().split())))"),  # correct
        py("print(sum(abs(int(x)) for x in input().split()))"),  # wrong only with negatives: 2/3
        py("print(42)"),  # wrong
        py("while True:\n    pass"),  # times out on every test
        py("import sys\nsys.exit(3)"),  # runtime error
        "I would use sum() over the input.",  # no code block: no sandbox run
        py("print(sum(map(int, input().split())))"),  # the same program again: run once
    ]
    before = counted.calls
    scored = code_scorer.score_group(rollout_group("code", SUM_SUITE, texts))
    assert values(scored) == pytest.approx([1.0, 2 / 3, 0.0, 0.0, 0.0, 0.0, 1.0])
    assert values(scored, "code.all_pass") == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert [t.reward.total for t in scored.trajectories] == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert all(t.reward.status == common_pb2.REWARD_STATUS_OK for t in scored.trajectories)
    details = [component(t, "code.pass_fraction").detail for t in scored.trajectories]
    assert details[1] == "2/3 passed; failed: #1 WRONG_ANSWER"
    assert details[3].startswith("0/3 passed; failed: #0 TIMEOUT")
    assert "RUNTIME_ERROR" in details[4]
    assert details[5] == "no code block"
    assert component(scored.trajectories[5], "format.code_block").value == 0.0
    assert counted.calls - before == 5  # 5 distinct programs; no call for the missing block


def test_assertion_tests_and_a_cheat(code_scorer):
    suite = json.dumps({"tests": [{"assertion": "assert fib(0) == 0"}, {"assertion": "assert fib(10) == 55"},
                                  {"assertion": "assert fib(20) == 6765"}]})
    texts = [py("def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a"),
             py("def fib(n):\n    return n"),  # right for 0 only
             py("import os\ndef fib(n):\n    os._exit(0)")]  # exiting early does not fake a pass
    scored = code_scorer.score_group(rollout_group("code.fibonacci", suite, texts))
    assert values(scored) == pytest.approx([1.0, 1 / 3, 0.0])


def test_compile_errors(code_scorer):
    suite = json.dumps({"language": "c", "tests": [{"stdin": "", "expected_stdout": "hi\n"}]})
    good = '```c\n#include <stdio.h>\nint main(void) { puts("hi"); return 0; }\n```'
    bad = "```c\nint main(void) { return }\n```"
    scored = code_scorer.score_group(rollout_group("code", suite, [good, bad]))
    assert values(scored, "code.all_pass") == [1.0, 0.0]
    assert component(scored.trajectories[1], "code.all_pass").detail.startswith("COMPILE_ERROR")


@pytest.mark.parametrize("domain", sorted(code_problems.GENERATORS))
def test_generated_code_tasks(code_scorer, domain):
    solutions = {
        "code.sum_numbers": "print(sum(map(int, input().split())))",
        "code.reverse_words": "print(' '.join(reversed(input().split())))",
        "code.fibonacci": "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
    }
    task = code_problems.make_task(domain, random.Random(5), "t")
    scored = code_scorer.score_group(rollout_group(domain, task.reference_answer,
                                                   [py(solutions[domain]), py("print('no')")]))
    assert values(scored, "code.all_pass") == [1.0, 0.0]


def test_bad_suites_are_invalid_arguments(code_scorer):
    cases = [("not json", "group.task.reference_answer"),
             ("[]", "group.task.reference_answer"),
             ('{"tests": []}', "group.task.reference_answer.tests"),
             ('{"tests": [{"stdin": "1"}]}', "group.task.reference_answer.tests[0]"),
             ('{"tests": [{"assertion": "assert 1", "expected_stdout": "x"}]}', "group.task.reference_answer.tests[0]"),
             ('{"tests": [{"assertion": 3}]}', "group.task.reference_answer.tests[0]"),
             ('{"tests": [{"assertion": "assert 1"}], "wall_seconds": -1}', "group.task.reference_answer.wall_seconds"),
             ('{"tests": [{"assertion": "assert 1"}], "timeout": 1}', "group.task.reference_answer"),
             ('{"tests": [{"assertion": "assert 1"}], "output_match": "fuzzy"}',
              "group.task.reference_answer.output_match")]
    for suite, field in cases:
        with pytest.raises(InvalidArgument) as e:
            code_scorer.score_group(rollout_group("code", suite, [py("print(1)")]))
        assert e.value.field == field, (suite, e.value)
    # limits beyond the sandbox's maxima: the sandbox refuses, and that is the task's fault
    with pytest.raises(InvalidArgument) as e:
        spec = json.dumps({"tests": [{"assertion": "assert 1"}], "wall_seconds": 10_000})
        code_scorer.score_group(rollout_group("code", spec, [py("print(1)")]))
    assert e.value.field == "group.task.reference_answer" and "sandbox refused" in e.value.message


def test_sandbox_down_is_retried_then_a_clear_verdict():
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    options = dict(retries=2, retry_backoff_seconds=0.05, timeout_seconds=2)
    retry = Scorer(RewardSettings(code=CodeOptions(**options)), sandbox=sandbox_runner(dead))
    mark = Scorer(RewardSettings(code=CodeOptions(on_unavailable="mark", **options)), sandbox=sandbox_runner(dead))
    nothing = Scorer(RewardSettings())
    try:
        with pytest.raises(SandboxUnavailable, match="after 3 attempt") as e:
            retry.score_group(rollout_group("code", SUM_SUITE, [py("print(3)")]))
        assert e.value.code.name == "UNAVAILABLE"
        scored = mark.score_group(rollout_group("code", SUM_SUITE, [py("print(3)"), "no code"]))
        t0, t1 = scored.trajectories
        assert t0.reward.status == common_pb2.REWARD_STATUS_ERROR
        c = component(t0, "code.all_pass")
        assert c.status == common_pb2.REWARD_STATUS_ERROR and "sandbox unavailable after 3 attempt" in c.error
        assert t1.reward.status == common_pb2.REWARD_STATUS_OK  # no program: nothing needed the sandbox
        with pytest.raises(SandboxUnavailable, match="no sandbox configured"):
            nothing.score_group(rollout_group("code", SUM_SUITE, [py("print(3)")]))
    finally:
        retry.close()
        mark.close()
        nothing.close()


@pytest.fixture(scope="module")
def batch_sandbox(tmp_path_factory):
    """A sandbox service in execution_mode "batch": a gVisor sandbox per RunTestsBatch call."""
    from tests.conftest import spawn_service

    svc = spawn_service("sandbox", tmp_path_factory.mktemp("reward-batch-sandbox"), "--no-publish-traces",
                        "--max-concurrency", "2", "--max-queue", "16", "--execution-mode", "batch")
    yield svc
    svc.stop()


def test_batched_group_scores_as_one_call_per_program(batch_sandbox, code_scorer):
    """code.batch_size: a group's distinct programs go in RunTestsBatch calls; the rewards are the same."""
    texts = [py("print(sum(map(int, input().split())))"), py("print(sum(abs(int(x)) for x in input().split()))"),
             py("print(42)"), py("while True:\n    pass"), py("import sys\nsys.exit(3)"),
             "I would use sum() over the input.", py("print(sum(map(int, input().split())))"),
             py("import os\nopen('/tmp/x', 'w').write('left')\nos.fork() or __import__('time').sleep(100)")]
    counted = Counting(sandbox_runner(batch_sandbox.address))
    batched = Scorer(RewardSettings(code=CodeOptions(batch_size=4)), sandbox=counted)
    try:
        scored = batched.score_group(rollout_group("code", SUM_SUITE, texts))
    finally:
        batched.close()
    assert counted.calls == 2  # 6 distinct programs in calls of up to 4
    alone = code_scorer.score_group(rollout_group("code", SUM_SUITE, texts))
    assert values(scored) == values(alone) == pytest.approx([1.0, 2 / 3, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0])
    assert ([component(t, "code.pass_fraction").detail for t in scored.trajectories]
            == [component(t, "code.pass_fraction").detail for t in alone.trajectories])
