"""A job waits out a dependency that is down (inference or reward restarting): each call that fails with a
transient error is tried again, the job fails only after ``dependency_wait_seconds`` in a row of them, other
errors fail it at once, and a stop ends the wait with the job STOPPED. In memory: scripted callables."""

import threading

from temper.scheduler.core import Job, JobSpec
from temper.v1 import scheduler_pb2
from tests.conftest import wait_until
from tests.scheduler.test_job_state import Loop, generate

DONE, FAILED, STOPPED = scheduler_pb2.JOB_STATE_DONE, scheduler_pb2.JOB_STATE_FAILED, scheduler_pb2.JOB_STATE_STOPPED


class Down(Exception):
    """What a dependency that is down raises (the service passes grpc UNAVAILABLE)."""


def transient(e: BaseException) -> bool:
    return isinstance(e, Down)


def flaky(call, failures: list[int]):
    """``call``, raising Down on the calls whose number (0-based) is in ``failures``."""
    n = [0]

    def f(*args):
        n[0] += 1
        if n[0] - 1 in failures:
            raise Down(f"down at call {n[0] - 1}")
        return call(*args)

    f.calls = n
    return f


def spec() -> JobSpec:
    return JobSpec(job_id="j", steps=3, prompts_per_step=2, group_size=2, domains=["toy.copy"])


def test_calls_failing_while_a_dependency_restarts_are_tried_again_and_the_job_finishes():
    loop = Loop(spec())
    gen = flaky(generate, [0, 1, 4])
    version = flaky(loop.version, [2, 3, 5])
    job = loop.job = Job(loop.spec, gen, loop.publish, version, transient=transient, dependency_wait_seconds=60)
    job.start()
    wait_until(lambda: job.state == DONE, 60, what="the job done")
    assert job.steps_done == 3 and job.groups_published == 6 and job.error == ""
    assert len(set(loop.sent)) == 6 and gen.calls[0] == 3 + 3  # each failed generate was made again


def test_a_dependency_down_longer_than_the_wait_fails_the_job_naming_the_error():
    loop = Loop(spec())
    job = loop.job = Job(loop.spec, flaky(generate, list(range(1000))), loop.publish, loop.version,
                         transient=transient, dependency_wait_seconds=1.0)
    job.start()
    wait_until(lambda: job.state == FAILED, 30, what="the job failed")
    assert job.error.startswith("Down: down at call") and job.steps_done == 0


def test_an_error_that_is_not_transient_fails_the_job_at_once():
    loop = Loop(spec())
    calls = []

    def broken(prompts, s, seed):
        calls.append(1)
        raise ValueError("the model answered nonsense")

    job = loop.job = Job(loop.spec, broken, loop.publish, loop.version, transient=transient)
    job.start()
    wait_until(lambda: job.state == FAILED, 30, what="the job failed")
    assert job.error == "ValueError: the model answered nonsense" and len(calls) == 1


def test_a_stop_while_waiting_for_a_dependency_leaves_the_job_stopped_not_failed():
    loop = Loop(spec())
    waiting = threading.Event()

    def down(*args):
        waiting.set()
        raise Down("inference restarting")

    job = loop.job = Job(loop.spec, generate, loop.publish, down, transient=transient, dependency_wait_seconds=600)
    job.start()
    assert waiting.wait(10)
    job.stop()
    assert job.state == STOPPED and job.error == ""
