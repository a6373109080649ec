"""Chaos on a real job: while the tiny model's toy job runs, every service is SIGKILLed by PID, one after
another in a seeded order at seeded steps, and the launcher's supervisor restarts each. The job must
finish, and counted by id from the topics (`rollouts`, `scored`, `metrics`, read from the start) and from
the services' own records:

- generated once: the scheduler published each of the job's groups ``<job>/s<step>/p<k>`` (steps 0..S-1,
  prompts 0..n-1) and no other, a whole step each;
- scored: every generated group reached `scored` (a reward killed before committing its offset scores
  a group again: the same id, counted once);
- stored once: replay inserted each group once (redeliveries refused as duplicates);
- trained once: the steps the final policy is made of (the `metrics` records, each step's later record
  replacing what a killed learner made after the checkpoint it was resumed from) trained on every group
  exactly once (StepMetrics.group_ids). A learner killed mid-step gives its leased batch back to replay and
  resumes from its checkpoint of the step before; killed after pushing a step but before checkpointing it,
  the update is lost with the process and its batch comes back when the lease runs out, trained again by
  the new process (which pushes the restored weights under a newer version, so the job may take more
  learner steps than it has scheduler steps);
- no double counting in the monitor: its per-domain curve counts each scored group once (the samples of
  its `scored` series add up to every trajectory generated).

The broker is killed too: the job runs with ``[broker] storage = "s3"``, so the supervisor starts it again
on its port and every producer, consumer group and offset carries on (temper.runtime.broker).
"""

import os
import random
import signal
from collections import Counter
from functools import partial

import grpc
import pytest

from temper import jobs
from temper.client.sdk import LearnerClient, MonitorClient, ReplayClient, SchedulerClient
from temper.runtime import kafka
from temper.runtime.launcher import Launcher
from temper.reward.dataset import read_topic
from temper.runtime.rpc import check_health
from temper.scheduler.core import JobSpec
from temper.v1 import common_pb2, scheduler_pb2
from tests.conftest import wait_until

pytestmark = pytest.mark.e2e
STEPS, PROMPTS, GROUP = 30, 4, 4
VICTIMS = ["reward", "replay", "learner", "scheduler", "monitor", "inference", "broker"]
SEED = int(os.environ.get("TEMPER_CHAOS_SEED", "0"))


def _config(tmp) -> str:
    text = jobs.path("toy").read_text()
    for old, new in (("steps = 150", f"steps = {STEPS}"), ("prompts_per_step = 16", f"prompts_per_step = {PROMPTS}"),
                     ("group_size = 8", f"group_size = {GROUP}"), ("size = 100", "size = 10"),
                     ("every = 50", "every = 0"), ("[learner]\n", "[learner]\ncheckpoint_every = 1\n")):
        assert old in text, old
        text = text.replace(old, new, 1)
    path = tmp / "job.toml"
    path.write_text(text + "\n[launcher]\nbackoff_seconds = 0.2\n\n[broker]\nstorage = \"s3\"\n")
    return path


def _read_all(bootstrap: str, topic: str, message_type) -> list:
    """Every message of ``topic``, to its high watermark (from the fetches: ListOffsets is short on the s3
    engine)."""
    undecodable: list[int] = []
    out = list(read_topic(bootstrap, topic, message_type, undecodable=undecodable))
    assert not undecodable, undecodable
    return out


def _job(address: str, job_id: str) -> scheduler_pb2.JobStatus | None:
    """The job's status, or None while the scheduler is down or starting again."""
    try:
        with SchedulerClient(address, timeout=5) as s:
            return s.job(job_id)
    except grpc.RpcError as e:
        if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.NOT_FOUND):
            return None
        raise


def test_every_service_killed_mid_job_the_job_finishes_and_every_group_counts_once(tmp_path):
    rng = random.Random(SEED)
    victims = rng.sample(VICTIMS, len(VICTIMS))
    kill_at = sorted(rng.sample(range(2, STEPS - 4), len(victims)))  # the steps done when each dies
    launcher = Launcher(home=tmp_path / "home", config=_config(tmp_path))
    state = launcher.up(supervise="thread")
    try:
        address = {n: p.address for n, p in state.services.items()}
        spec = JobSpec.from_dict(launcher.config()["job"])
        with SchedulerClient(address["scheduler"]) as s:
            job_id = s.start_job(spec.to_proto()).job_id
        killed = []
        def reached(at: int) -> bool:
            j = _job(address["scheduler"], job_id)
            assert j is None or j.state != scheduler_pb2.JOB_STATE_FAILED, j.error
            return j is not None and j.steps_done >= at

        def proc(victim: str):
            state = launcher.load()
            return state.broker if victim == "broker" else state.services[victim]

        def restarted(victim: str, old_pid: int) -> bool:
            p = proc(victim)
            return p.pid != old_pid and not p.failed and (victim == "broker" or check_health(p.address) == "SERVING")

        for victim, at in zip(victims, kill_at):
            wait_until(partial(reached, at), 600, 0.1, f"step {at} before killing {victim}")
            old = proc(victim)
            os.kill(old.pid, signal.SIGKILL)
            killed.append((victim, at, old.pid))
            wait_until(partial(restarted, victim, old.pid), 300, 0.2, f"{victim} restarted")
            print(f"chaos: {victim} (pid {old.pid}) killed at step {at}; restarted", flush=True)
        done = wait_until(lambda: (j := _job(address["scheduler"], job_id)) is not None
                          and j.state in (scheduler_pb2.JOB_STATE_DONE, scheduler_pb2.JOB_STATE_FAILED) and j,
                          900, 0.2, "the job to end")
        assert done.state == scheduler_pb2.JOB_STATE_DONE, done.error
        assert (done.steps_done, done.groups_published) == (STEPS, STEPS * PROMPTS)
        for p in launcher.load().services.values():
            assert not p.failed, p.failed
        assert {v for v, _, _ in killed} == set(VICTIMS)

        expected = {f"{job_id}/s{s}/p{k}" for s in range(STEPS) for k in range(PROMPTS)}
        rollouts = _read_all(state.kafka_bootstrap, kafka.ROLLOUTS, common_pb2.RolloutGroup)
        generated = [g.group_id for g in rollouts if g.job_id == job_id]
        assert set(generated) == expected  # every step's groups and no other
        scored = _read_all(state.kafka_bootstrap, kafka.SCORED, common_pb2.RolloutGroup)
        assert {g.group_id for g in scored if g.job_id == job_id} == expected  # every group scored
        with ReplayClient(address["replay"]) as replay:
            stats = replay.stats()
        assert stats.inserts == len(expected)  # each stored once (redeliveries are duplicates)

        metrics = _read_all(state.kafka_bootstrap, kafka.METRICS, common_pb2.StepMetrics)
        mine = [m for m in metrics if m.job_id == job_id]
        lineage: list[common_pb2.StepMetrics] = []  # the steps the final policy is made of
        for m in mine:  # a learner resumed from checkpoint k: the steps after k its dead process made are gone
            lineage = [x for x in lineage if x.step < m.step] + [m]
        assert [m.step for m in lineage] == list(range(1, len(lineage) + 1))
        trained = Counter(g for m in lineage for g in m.group_ids)
        twice, missing = sorted(g for g, n in trained.items() if n > 1), sorted(expected - set(trained))
        assert not twice and not missing and set(trained) == expected, \
            (f"trained twice: {twice}; never: {missing}; steps: "
             + "; ".join(f"{m.step} v{m.policy_version} {','.join(g.split('/', 1)[1] for g in m.group_ids)}"
                         for m in mine))
        assert all(m.samples == len(m.group_ids) * GROUP for m in lineage)
        with LearnerClient(address["learner"]) as learner:
            assert learner.status().step == len(lineage)
        def on_the_curve() -> Counter:  # trajectories per scheduler step on the monitor's per-domain curves
            with MonitorClient(address["monitor"]) as monitor:
                series = monitor.list_steps(job_id, last=1000)
            per_step = Counter()
            for s in series:
                if s.source == "scored" and s.domain != "*":
                    for p in s.steps:
                        per_step[p.step] += p.samples
            return per_step

        # the restarted monitor catches up on `scored` (its consumer group takes the partition over from the
        # dead member after the session timeout): then every trajectory is on the curve once
        try:
            wait_until(lambda: sum(on_the_curve().values()) >= len(expected) * GROUP, 120, 0.5, "the monitor's curve")
        finally:
            print("monitor: trajectories per step", sorted(on_the_curve().items()), flush=True)
        assert on_the_curve() == dict.fromkeys(range(STEPS), PROMPTS * GROUP)
        print(f"chaos seed {SEED}: killed {[(v, at) for v, at, _ in killed]}; {len(generated)} groups published "
              f"({len(generated) - len(expected)} again), {len(scored)} scored records, replay duplicates "
              f"{stats.duplicates}; learner: {len(mine)} step records, {len(lineage)} steps in the final policy "
              f"for {STEPS} scheduler steps", flush=True)
    finally:
        launcher.down()
