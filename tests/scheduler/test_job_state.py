"""Durable job state (temper.scheduler.store + Job.checkpoint/restore): round trips, a job killed mid-step
resumes without regenerating finished steps or counting anything twice, the servicer resumes saved jobs."""

import json
import threading

import pytest
from pydantic import ValidationError

from temper.runtime.config import describe_errors, load_config
from temper.runtime.errors import FailedPrecondition
from temper.scheduler.config import SchedulerConfig
from temper.scheduler.core import Job, JobSpec
from temper.scheduler.servicer import SchedulerServicer
from temper.scheduler.store import JobStore
from temper.v1 import common_pb2, inference_pb2, scheduler_pb2
from tests.conftest import wait_until

DONE, RUNNING, PAUSED = scheduler_pb2.JOB_STATE_DONE, scheduler_pb2.JOB_STATE_RUNNING, scheduler_pb2.JOB_STATE_PAUSED


def generate(prompts, s, seed):
    return inference_pb2.GenerateResponse(policy_version=0, results=[inference_pb2.PromptResult(
        prompt_token_ids=[1], completions=[inference_pb2.Completion(text="x", token_ids=[1], logprobs=[-0.1])
                                           for _ in range(s.group_size)]) for _ in prompts])


def scored(group, solved=lambda k: k % 2 == 0) -> common_pb2.RolloutGroup:
    out = common_pb2.RolloutGroup()
    out.CopyFrom(group)
    for k, t in enumerate(out.trajectories):
        t.reward.status = common_pb2.REWARD_STATUS_OK
        t.reward.total = 1.0 if solved(k) else 0.0
    return out


class Loop:
    """The rest of the loop, in memory: replay keeps the first copy of a group id (as the real one does), the
    learner trains one version per ``prompts_per_step`` groups stored, the scored stream feeds ``job``."""

    def __init__(self, spec: JobSpec):
        self.spec = spec
        self.stored: dict[str, common_pb2.RolloutGroup] = {}
        self.sent: list[str] = []
        self.job: Job | None = None

    def publish(self, group):
        self.sent.append(group.group_id)
        if group.group_id not in self.stored:
            self.stored[group.group_id] = group
        self.job.observe_scored(scored(group))  # the stream may deliver a copy again: the journal refuses it

    def version(self) -> int:
        return len(self.stored) // self.spec.prompts_per_step

    def make(self, store, publish=None) -> Job:
        self.job = Job(self.spec, generate, publish or self.publish, self.version, journal=store)
        return self.job


def spec(**kw) -> JobSpec:
    return JobSpec(**{"job_id": "j1", "steps": 4, "prompts_per_step": 4, "group_size": 2,
                      "domains": ["toy.copy", "toy.next"], "sampling": {"adaptive": {"window": 2}}, **kw})


def test_a_finished_jobs_state_round_trips_through_the_store(tmp_path):
    s = spec()
    store = JobStore(tmp_path / "jobs.sqlite")
    loop = Loop(s)
    job = loop.make(store)
    job.save()
    job.start()
    wait_until(lambda: job.state == DONE, 180, what="job done")
    store.close()

    saved = JobStore(tmp_path / "jobs.sqlite").jobs()
    assert [x.spec for x in saved] == [s] and saved[0].state == DONE and saved[0].outcomes == []
    again = Loop(s).make(None).restore(saved[0].checkpoint, saved[0].outcomes)
    assert again.status() == job.status()
    assert json.loads(json.dumps(again.checkpoint())) == json.loads(json.dumps(job.checkpoint()))
    status = again.status()
    assert status.steps_done == 4 and status.groups_published == 16 and status.groups_scored == 16
    assert sum(d.groups for d in status.domains) == sum(d.drawn for d in status.domains) == 16


def test_outcomes_are_recorded_once_and_the_ones_after_the_checkpoint_are_learned_on_restore(tmp_path):
    s = spec(steps=1)
    store = JobStore(tmp_path / "jobs.sqlite")
    loop = Loop(s)
    job = loop.make(store)
    job.run_step(0)
    job.save()  # holds the step's 4 outcomes
    assert store.jobs()[0].outcomes == []  # folded into the checkpoint (only their keys remain)
    extra = common_pb2.RolloutGroup()
    extra.CopyFrom(loop.stored["j1/s0/p0"])
    extra.group_id = "j1/s0/p9"
    job.observe_scored(scored(extra))  # after the checkpoint: in the journal only
    job.observe_scored(scored(extra))  # a redelivery
    job.observe_scored(scored(loop.stored["j1/s0/p1"]))  # one the checkpoint already holds
    assert job.groups_scored == 5
    saved = store.jobs()[0]
    assert [o["domain"] for _, o in saved.outcomes] == [extra.task.domain]
    again = Loop(s).make(None).restore(saved.checkpoint, saved.outcomes)
    assert again.status().domains == job.status().domains and again.groups_scored == 5


def test_a_job_killed_mid_step_resumes_from_the_step_it_had_not_finished(tmp_path):
    """The first scheduler dies while publishing step 1 (2 of its 4 groups out). The second regenerates step 1
    under the same ids and goes on: replay stores every id of every step once, 4 per step, and the counters say
    4 steps, 16 groups, 16 learned outcomes."""
    s = spec()
    path = tmp_path / "jobs.sqlite"
    loop = Loop(s)
    dead, stuck = threading.Event(), threading.Event()

    class Dying(JobStore):  # writes nothing once the process "died"
        def save(self, *a):
            if not dead.is_set():
                super().save(*a)

        def record_outcome(self, *a):
            return None if dead.is_set() else super().record_outcome(*a)

    def publish_then_die(group):
        if group.group_id == "j1/s1/p2":
            dead.set()
            stuck.wait(300)
            raise RuntimeError("killed")
        loop.publish(group)

    first = loop.make(Dying(path), publish_then_die)
    first.save()
    first.start()
    wait_until(dead.is_set, 180, what="the first scheduler dies mid-step")
    saved = JobStore(path).jobs()[0]
    assert saved.state == RUNNING and saved.checkpoint["steps_done"] == 1

    store = JobStore(path)
    second = loop.make(store).restore(saved.checkpoint, saved.outcomes)
    second.start()
    wait_until(lambda: second.state == DONE, 180, what="the resumed job done")
    stuck.set()
    first.halt()

    expected = {f"j1/s{step}/p{i}" for step in range(4) for i in range(4)}
    assert set(loop.stored) == expected  # every step trained on exactly its 4 groups
    assert [g for g in loop.sent if loop.sent.count(g) > 1] == ["j1/s1/p0", "j1/s1/p1"] * 2  # only those again
    assert not any(g.startswith("j1/s0/") for g in loop.sent[6:])  # step 0 was never generated again
    status = second.status()
    assert (status.steps_done, status.groups_published, status.groups_scored) == (4, 16, 16)
    assert sum(d.drawn for d in status.domains) == 16 == sum(d.groups for d in status.domains)
    assert JobStore(path).jobs()[0].state == DONE


@pytest.mark.parametrize("sampling", [{}, {"adaptive": {"window": 2}}], ids=["uniform", "adaptive"])
def test_a_resumed_job_counts_the_steps_the_learner_already_trained_as_done(tmp_path, sampling):
    """Killed after its last publish but before the checkpoint: the serving version says step 1 is trained.
    Its draws count once (a fresh-clone CI run of the kill -9 e2e test once saw one step's draws missing from
    the domains' `drawn`), and with uniform sampling the draws after it are the ones an uninterrupted job makes."""
    s = spec(steps=3, sampling=sampling)
    reference = Loop(s)
    reference.make(None).start_version = 0
    for step in range(3):
        reference.job.run_step(step)

    loop = Loop(s)
    job = loop.make(None)
    job.start_version = 0
    job.run_step(0)
    job.steps_done = 1
    checkpoint = job.checkpoint()
    job.run_step(1)  # published (and trained: version 2), never checkpointed
    again = loop.make(JobStore(tmp_path / "jobs.sqlite")).restore(checkpoint)
    again.start()
    wait_until(lambda: again.state == DONE, 180, what="job done")
    assert len(loop.sent) == 12 and set(loop.sent) == set(loop.stored)  # step 1 not generated again
    assert (again.steps_done, again.groups_published) == (3, 12)
    status = again.status()
    assert sum(d.drawn for d in status.domains) == 12
    if not sampling:
        assert ([loop.stored[g].task.prompt for g in sorted(loop.stored)]
                == [reference.stored[g].task.prompt for g in sorted(reference.stored)])
        assert [d.drawn for d in status.domains] == [d.drawn for d in reference.job.status().domains]


def test_the_servicer_resumes_running_and_paused_jobs_and_keeps_finished_ones(tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite")
    loops = {}

    def make_job(s, resumed):
        loops[s.job_id] = Loop(s)
        return loops[s.job_id].make(store)

    for job_id, state in (("done", DONE), ("paused", PAUSED), ("running", RUNNING)):
        job = make_job(spec(job_id=job_id, steps=2), False)
        job.state = state
        job.save()
    servicer = SchedulerServicer(make_job)
    assert servicer.resume_saved(store.jobs()) == ["paused", "running"]
    try:
        wait_until(lambda: servicer.jobs["running"].state == DONE, 180, what="the running job done")
        assert servicer.jobs["paused"].state == PAUSED and not loops["paused"].sent  # holds until ResumeJob
        assert servicer.jobs["done"].status().state == DONE and not loops["done"].sent
        with pytest.raises(FailedPrecondition, match="^spec.job_id: .*still running"):
            servicer.StartJob(scheduler_pb2.StartJobRequest(spec=spec(job_id="new").to_proto()), None)
        servicer.jobs["paused"].stop()
        with pytest.raises(FailedPrecondition, match="^spec.job_id: .*already ran"):
            servicer.StartJob(scheduler_pb2.StartJobRequest(spec=spec(job_id="done").to_proto()), None)
    finally:
        servicer.stop_all()
    assert {x.spec.job_id: x.state for x in store.jobs()} == {
        "done": DONE, "paused": scheduler_pb2.JOB_STATE_STOPPED, "running": DONE}


def test_halting_at_shutdown_leaves_the_job_to_be_resumed(tmp_path):
    """A client closed under the job as the process stops (here: publish fails) is not the job's failure."""
    store = JobStore(tmp_path / "jobs.sqlite")
    publishing, hold = threading.Event(), threading.Event()

    def publish(group):
        publishing.set()
        hold.wait(300)
        raise RuntimeError("producer closed")

    job = Loop(spec()).make(store, publish)
    job.save()
    job.start()
    wait_until(publishing.is_set, 180, what="publishing")
    threading.Timer(0.2, hold.set).start()
    job.halt()
    assert job.state == RUNNING and not job.error and store.jobs()[0].state == RUNNING


def test_persist_jobs_is_a_validated_scheduler_key(tmp_path):
    config = tmp_path / "job.toml"
    assert load_config(SchedulerConfig, []).persist_jobs is True
    config.write_text("[scheduler]\npersist_jobs = false\n")
    assert load_config(SchedulerConfig, ["--config", str(config)]).persist_jobs is False
    for table, expected in (("persist_jobs = \"sometimes\"", "[scheduler] persist_jobs: Input should be a valid "
                                                              "boolean"),
                            ("persist_job = false", "[scheduler] persist_job: unknown key (did you mean "
                                                    "persist_jobs?)")):
        config.write_text(f"[scheduler]\n{table}\n")
        argv = ["--config", str(config)]
        with pytest.raises(ValidationError) as e:
            load_config(SchedulerConfig, argv)
        assert describe_errors(SchedulerConfig, e.value, argv)[0].startswith(expected)
