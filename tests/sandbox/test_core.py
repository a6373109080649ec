"""The sandbox core without a sandbox: judging, output matching, admission, limits."""

from __future__ import annotations

import signal
import threading

import pytest

from temper.runtime.errors import InvalidArgument, ResourceExhausted
from temper.sandbox.core import (
    MiB,
    Admission,
    Limits,
    OutputMatch,
    Policy,
    RunFacts,
    Verdict,
    judge,
    judge_assertions,
    outputs_match,
)
from tests.conftest import wait_until

LIMITS = Limits(wall_seconds=2, cpu_seconds=1, memory_mb=64, max_processes=8, max_output_bytes=100)


@pytest.mark.parametrize("facts, verdict", [
    (RunFacts(), Verdict.OK),
    (RunFacts(exit_code=1), Verdict.RUNTIME_ERROR),
    (RunFacts(exit_code=-1, signal=signal.SIGSEGV), Verdict.RUNTIME_ERROR),
    (RunFacts(exit_code=-1, signal=signal.SIGXCPU, cpu_seconds=1.0), Verdict.TIMEOUT),
    (RunFacts(cpu_seconds=1.5), Verdict.TIMEOUT),
    (RunFacts(exit_code=-1, signal=signal.SIGKILL, killed="wall"), Verdict.TIMEOUT),
    (RunFacts(exit_code=-1, signal=signal.SIGKILL, killed="output", stdout_bytes=101), Verdict.OUTPUT_LIMIT),
    (RunFacts(stdout_bytes=150), Verdict.OUTPUT_LIMIT),
    (RunFacts(max_rss_bytes=65 * MiB), Verdict.MEMORY_LIMIT),
    (RunFacts(exit_code=-1, killed="memory"), Verdict.MEMORY_LIMIT),
    (RunFacts(exit_code=-1, killed="sandbox", error="boom"), Verdict.SANDBOX_ERROR),
])
def test_judge(facts, verdict):
    assert judge(facts, LIMITS).verdict is verdict


def test_assertion_pass_needs_the_nonce():
    nonce = b"n" * 32
    ok = judge(RunFacts(), LIMITS)
    assert judge_assertions(ok, nonce, nonce).verdict is Verdict.OK
    assert judge_assertions(ok, b"", nonce).verdict is Verdict.RUNTIME_ERROR
    assert judge_assertions(ok, nonce + b"x", nonce).verdict is Verdict.RUNTIME_ERROR
    failed = judge(RunFacts(exit_code=1, stderr=b"Traceback ...\nAssertionError: 3 != 4\n"), LIMITS)
    assert judge_assertions(failed, b"", nonce).verdict is Verdict.WRONG_ANSWER


@pytest.mark.parametrize("actual, expected, loose, exact", [
    (b"3\n", b"3\n", True, True),
    (b"3 \n\n", b"3", True, False),
    (b"1 2\r\n3\n", b"1 2\n3", True, False),
    (b"1  2\n", b"1 2\n", False, False),
    (b"", b"\n", True, False),
])
def test_outputs_match(actual, expected, loose, exact):
    assert outputs_match(actual, expected, OutputMatch.TRAILING_WHITESPACE) is loose
    assert outputs_match(actual, expected, OutputMatch.EXACT) is exact


def test_admission_refuses_beyond_the_queue():
    admission = Admission(max_concurrency=1, max_queue=1)
    release, inside = threading.Event(), threading.Event()

    def hold():
        with admission.slot():
            inside.set()
            release.wait()

    holder = threading.Thread(target=hold)
    holder.start()
    inside.wait()
    def wait():
        with admission.slot():
            pass

    waiter = threading.Thread(target=wait)
    waiter.start()
    wait_until(lambda: admission.waiting >= 1, 10, interval=0.01, what="a waiting caller")
    with pytest.raises(ResourceExhausted), admission.slot():
        pass
    assert admission.running == 1 and admission.waiting == 1
    release.set()
    holder.join()
    waiter.join()
    assert admission.running == 0 and admission.waiting == 0


def test_limits_default_and_cpu_follows_wall():
    policy = Policy(defaults=Limits(10, 10, 512, 64, 1 << 20), maxima=Limits(60, 60, 4096, 512, 16 << 20),
                    compile_limits=Limits(60, 60, 2048, 64, 1 << 20))
    assert policy.resolve(Limits()) == Limits(10, 10, 512, 64, 1 << 20)
    assert policy.resolve(Limits(wall_seconds=2)).cpu_seconds == 2
    assert policy.resolve(Limits(wall_seconds=2, cpu_seconds=5)).cpu_seconds == 5


def test_invalid_argument_names_the_field():
    from temper.sandbox.config import SandboxConfig
    from temper.sandbox.core import Program, SourceFile, validate

    config = SandboxConfig()
    with pytest.raises(InvalidArgument) as e:
        validate(Program("python3", [SourceFile("", b"x")], limits=Limits(memory_mb=-1)),
                 config.language_presets(), config.policy(), prefix="program.")
    assert e.value.field == "program.limits.memory_mb"
