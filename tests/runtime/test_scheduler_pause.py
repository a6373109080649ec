"""A paused job holds before its next step (the step in flight finishes and is published), resumes
where it stopped, and a stop while paused ends it; pause/resume of a finished job is refused."""

import pytest

from temper.runtime.errors import FailedPrecondition
from temper.scheduler.core import Job, JobSpec
from temper.v1 import inference_pb2, scheduler_pb2
from tests.conftest import wait_until


def make_job(steps, pause_at=None):
    calls, published = [], []
    holder = {}

    def generate(prompts, spec, seed):
        calls.append(seed)
        if len(calls) - 1 == pause_at:
            holder["job"].pause("test")  # paused while this step is in flight
        return inference_pb2.GenerateResponse(results=[inference_pb2.PromptResult(
            completions=[inference_pb2.Completion(text="1", token_ids=[1], logprobs=[-0.1])])
            for _ in prompts])

    job = Job(JobSpec(job_id="j", steps=steps, prompts_per_step=2, group_size=1, domains=["toy.copy"],
                      max_policy_lag=steps), generate, published.append, lambda: 0)
    holder["job"] = job
    return job, calls, published


def test_pause_holds_before_the_next_step_and_resume_continues():
    job, calls, published = make_job(steps=5, pause_at=1)
    job.start()
    wait_until(lambda: job.steps_done == 2, 10, what="the step in flight to finish")
    assert job.status().state == scheduler_pb2.JOB_STATE_PAUSED and job.status().pause_reason == "test"
    assert len(published) == 4  # both steps' groups are out
    job.resume()
    wait_until(lambda: job.state == scheduler_pb2.JOB_STATE_DONE, 10, what="the job to finish")
    assert len(calls) == 5 and job.steps_done == 5 and job.pause_reason == ""


def test_stop_while_paused_runs_no_further_step():
    job, calls, _ = make_job(steps=1000, pause_at=1)
    job.start()
    wait_until(lambda: job.state == scheduler_pb2.JOB_STATE_PAUSED and job.steps_done == 2, 10, what="pause")
    job.stop()
    assert job.state == scheduler_pb2.JOB_STATE_STOPPED
    assert len(calls) == 2  # had the pause not held, an instant generate would have run on and on


def test_pause_or_resume_of_a_finished_job_is_refused():
    job, _, _ = make_job(steps=1)
    job.start()
    wait_until(lambda: job.state == scheduler_pb2.JOB_STATE_DONE, 10, what="done")
    for action in (job.pause, job.resume):
        with pytest.raises(FailedPrecondition) as e:
            action()
        assert e.value.field == "job_id"
