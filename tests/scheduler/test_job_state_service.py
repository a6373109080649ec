"""The real scheduler process on a data dir with saved jobs: what it resumes, what it refuses to resume."""

import grpc
import pytest

from temper.client.sdk import SchedulerClient
from temper.scheduler.store import JobStore
from temper.v1 import scheduler_pb2
from tests.conftest import spawn_service
from tests.scheduler.test_job_state import Loop, spec

pytestmark = pytest.mark.slow  # starts the scheduler as a process


def test_a_job_saved_against_another_broker_is_stopped_not_resumed_and_persistence_can_be_off(tmp_path, broker):
    """A data dir left by an earlier stack (`temper up` ... `temper down`, then `temper up` again): the job had
    published 4 groups; the new embedded broker holds none, so nothing it trained on exists any more."""
    store = JobStore(tmp_path / "work" / "scheduler-data" / "jobs.sqlite")
    old = Loop(spec(job_id="old")).make(store)
    old.start_version = 0
    old.run_step(0)
    old.steps_done = 1
    old.save()
    done = Loop(spec(job_id="done", steps=1)).make(store)
    done.state = scheduler_pb2.JOB_STATE_DONE
    done.save()
    store.close()
    args = ("--kafka-bootstrap", broker, "--inference-address", "127.0.0.1:1")
    scheduler = spawn_service("scheduler", tmp_path / "work", *args)
    try:
        with scheduler.client(SchedulerClient) as client:
            status = client.job("old")
            assert status.state == scheduler_pb2.JOB_STATE_STOPPED and status.steps_done == 1
            assert "the broker holds 0 rollouts, fewer than the 4 this job published" in status.error
            assert client.job("done").state == scheduler_pb2.JOB_STATE_DONE
    finally:
        scheduler.stop()
    assert {j.spec.job_id: j.state for j in JobStore(scheduler.data_dir / "jobs.sqlite").jobs()} == {
        "old": scheduler_pb2.JOB_STATE_STOPPED, "done": scheduler_pb2.JOB_STATE_DONE}

    scheduler = spawn_service("scheduler", tmp_path / "work", *args, "--no-persist-jobs")
    try:
        with scheduler.client(SchedulerClient) as client, pytest.raises(grpc.RpcError) as e:
            client.job("done")
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        scheduler.stop()
