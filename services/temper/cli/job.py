"""Running one job end to end on a local stack: submit, follow the learner's metrics, report.

A job the monitor pauses (a detector's policy) ends the run early: the report then holds the
steps so far, the monitor's alerts and, for each scheduler step, a few scored samples, so what
the policy was learning can be read next to the alert.

A scheduler that is briefly down (crashed, restarted by the supervisor, resuming the job from its
saved state) does not end the follow: while GetJob answers UNAVAILABLE the loop keeps reading the
learner's metrics, for at most ``unavailable_seconds`` in a row. A scheduler the supervisor gave up
on fails the job through ``check`` (the launcher's ``raise_if_failed``), and one that comes back
without the job (``[scheduler] persist_jobs = false``) fails it naming that.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
from google.protobuf.json_format import MessageToDict

from kafka import KafkaConsumer
from kafka.structs import TopicPartition
from tqdm import tqdm

from temper.client.sdk import MonitorClient, SchedulerClient
from temper.runtime import kafka
from temper.runtime.launcher import State
from temper.scheduler.core import JobSpec, repeats_warned
from temper.v1 import common_pb2, scheduler_pb2


SAMPLES_PER_STEP = 4
UNAVAILABLE_SECONDS = 180.0  # > the supervisor's default backoffs in a row (1 + 2 + 4 + 8 + 16 s) plus start-ups
CATCH_UP_SECONDS = 60.0  # how long a finished job's report waits for the scheduler to learn the last scored groups


class JobTimedOut(TimeoutError):
    """The job did not finish within ``temper run``'s job timeout; ``followed`` holds what it did so far."""

    def __init__(self, message: str, followed: Followed):
        super().__init__(message)
        self.followed = followed


@dataclass
class Followed:
    steps: list[common_pb2.StepMetrics]
    status: scheduler_pb2.JobStatus
    alerts: list = field(default_factory=list)    # the monitor's alerts for the job (monitor_pb2.Alert)
    samples: dict = field(default_factory=dict)   # scheduler step -> a few scored samples (dicts)
    skipped: list = field(default_factory=list)   # StepMetrics of batches that trained nothing (skipped_batch)

    @property
    def paused(self) -> bool:
        return self.status.state == scheduler_pb2.JOB_STATE_PAUSED


def _sample(group: common_pb2.RolloutGroup, t: common_pb2.Trajectory) -> dict:
    return {"trajectory_id": t.trajectory_id, "domain": group.task.domain, "prompt": group.task.prompt,
            "reference": group.task.reference_answer, "completion": t.completion_text, "reward": t.reward.total,
            "components": {c.name: c.value for c in t.reward.components}}


def follow_job(state: State, spec: JobSpec, timeout: float, echo=print, check=None,
               unavailable_seconds: float = UNAVAILABLE_SECONDS) -> Followed:
    """Submit ``spec``; follow the learner's StepMetrics until the job is DONE (every step in, final evaluation
    taken) or paused; the status carries the job's evaluations. ``check()``, called every half second, may
    raise to end the job (the launcher's ``raise_if_failed``: a service the supervisor gave up on). The
    scheduler may be unavailable for up to ``unavailable_seconds`` in a row (module docstring)."""
    consumer = KafkaConsumer(bootstrap_servers=state.kafka_bootstrap, group_id=None, enable_auto_commit=False,
                             fetch_max_wait_ms=100, **kafka.client_security())
    tp, tp_scored = TopicPartition(kafka.METRICS, 0), TopicPartition(kafka.SCORED, 0)
    consumer.assign([tp, tp_scored])
    consumer.seek_to_end(tp, tp_scored)
    consumer.position(tp)  # resolve the end offsets before the job starts
    consumer.position(tp_scored)
    scheduler = SchedulerClient(state.services["scheduler"].address)
    status = scheduler.start_job(spec.to_proto())
    job_id = status.job_id
    steps: dict[int, common_pb2.StepMetrics] = {}
    skipped: dict[int, common_pb2.StepMetrics] = {}  # policy version -> a batch that trained nothing
    samples: dict[int, list[dict]] = {}
    evals_seen = 0
    scored_ids: set[str] = set()  # the job's groups with an OK reward seen on `scored` (what the scheduler learns)
    unavailable_since: float | None = None
    deadline = time.monotonic() + timeout
    bar = tqdm(total=spec.steps, desc="steps", unit="step", dynamic_ncols=True)
    try:
        while True:
            if check is not None:
                check()
            if time.monotonic() > deadline:
                done = f"{len(steps)} (+{len(skipped)} skipped)" if skipped else f"{len(steps)}"
                raise JobTimedOut(f"job {job_id}: {done} of {spec.steps} steps after {timeout:.0f}s",
                                  Followed([steps[k] for k in sorted(steps)], status, [],
                                           {k: v for k, v in sorted(samples.items()) if v},
                                           [skipped[k] for k in sorted(skipped)]))
            for part, records in consumer.poll(timeout_ms=500).items():
                for r in records:
                    if part == tp_scored:
                        g = common_pb2.RolloutGroup.FromString(r.value)
                        if _learnable(g, job_id):
                            scored_ids.add(g.group_id)
                        kept = samples.setdefault(g.step, [])
                        if g.job_id == job_id and len(kept) < SAMPLES_PER_STEP:
                            kept.extend(_sample(g, t) for t in g.trajectories[:SAMPLES_PER_STEP - len(kept)])
                        continue
                    m = common_pb2.StepMetrics.FromString(r.value)
                    if m.job_id == job_id and m.values.get("skipped_batch") and m.policy_version not in skipped:
                        # every group of the batch dropped: no update, but the version (one per step) advanced
                        skipped[m.policy_version] = m
                        bar.update(1)
                        reasons = "  ".join(f"{k[8:]} {v:.0f}" for k, v in sorted(m.values.items())
                                            if k.startswith("dropped_") and k != "dropped_groups" and v)
                        tqdm.write(f"policy v{m.policy_version}: batch skipped, all {m.values.get('dropped_groups', 0):.0f}"
                                   f" groups dropped ({reasons or 'refused'}); weights unchanged")
                        continue
                    if m.job_id != job_id or m.values.get("skipped_batch") or m.step in steps:
                        continue
                    steps[m.step] = m
                    bar.update(1)
                    lag = m.policy_version - 1 - m.mean_sample_policy_version
                    tqdm.write(f"step {m.step:4d}  reward {m.mean_reward:.3f}  policy v{m.policy_version}  "
                               f"lag {lag:.1f} (max {m.policy_version - 1 - m.min_sample_policy_version})  "
                               f"samples {m.samples}  {m.values.get('tokens_per_second', 0.0):.0f} train tok/s  "
                               f"{m.seconds:.2f}s  "
                               + "  ".join(f"{d} {v:.2f}" for d, v in sorted(m.domain_mean_reward.items())))
            try:
                job = scheduler.job(job_id)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    raise RuntimeError(f"job {job_id}: the scheduler no longer knows it (restarted without its "
                                       "saved state? [scheduler] persist_jobs)") from None
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                now = time.monotonic()
                if unavailable_since is None:
                    unavailable_since = now
                    tqdm.write(f"scheduler unavailable ({e.details()}); waiting up to {unavailable_seconds:.0f}s")
                elif now - unavailable_since > unavailable_seconds:
                    raise RuntimeError(f"job {job_id}: the scheduler has been unavailable for "
                                       f"{now - unavailable_since:.0f}s: {e.details()}") from None
                continue
            if unavailable_since is not None:
                tqdm.write(f"scheduler back after {time.monotonic() - unavailable_since:.1f}s: job {job_id} "
                           f"{scheduler_pb2.JobState.Name(job.state)} at step {job.steps_done}")
                unavailable_since = None
            status = job
            if status.state == scheduler_pb2.JOB_STATE_PAUSED:
                tqdm.write(f"job {job_id} PAUSED: {status.pause_reason}")
                break
            for ev in job.evals[evals_seen:]:
                tqdm.write(f"eval ({ev.phase}, policy v{ev.policy_version}, {ev.problems}/domain, {ev.seconds:.1f}s)  "
                           + "  ".join(f"{d} {a:.2f}" for d, a in ev.accuracy.items()))
            evals_seen = len(job.evals)
            if job.state in (scheduler_pb2.JOB_STATE_FAILED, scheduler_pb2.JOB_STATE_STOPPED):
                raise RuntimeError(f"job {job_id} {scheduler_pb2.JobState.Name(job.state)}: {job.error}")
            if len(steps) + len(skipped) >= spec.steps and job.state == scheduler_pb2.JOB_STATE_DONE:
                status = _catch_up(consumer, tp_scored, scheduler, job, scored_ids)
                break
    finally:
        bar.close()
        consumer.close()
        scheduler.close()
    alerts = []
    if "monitor" in state.services:
        with MonitorClient(state.services["monitor"].address) as monitor:
            alerts = monitor.list_alerts(job_id=job_id)
        for a in alerts:
            echo(f"ALERT {a.detector} [{a.domain}] step {a.step}: {a.message} -> {a.action_result or 'warned'}")
    return Followed([steps[k] for k in sorted(steps)][:spec.steps], status, alerts,
                    {k: v for k, v in sorted(samples.items()) if v}, [skipped[k] for k in sorted(skipped)])


def _learnable(group: common_pb2.RolloutGroup, job_id: str) -> bool:
    """A group of ``job_id`` the scheduler learns from: one with an OK reward (the scheduler skips the rest)."""
    return group.job_id == job_id and any(t.reward.status == common_pb2.REWARD_STATUS_OK for t in group.trajectories)


def _catch_up(consumer: KafkaConsumer, tp_scored: TopicPartition, scheduler: SchedulerClient,
              status: scheduler_pb2.JobStatus, scored_ids: set[str]) -> scheduler_pb2.JobStatus:
    """The finished job's status once the scheduler has learned every group of the job on `scored` so far.

    The scheduler reads `scored` on its own consumer, which may trail the learner: when the last step is in,
    the last groups' outcomes may not have reached its sampling state yet. The report waits (at most
    ``CATCH_UP_SECONDS``) until the scheduler's ``groups_scored`` covers the job's groups up to the stream's
    end, so its per-domain counts describe the whole job; on timeout it reports what the scheduler has."""
    job_id = status.job_id
    # ListOffsets is short on Tansu's s3 engine; the watermark of this consumer's own fetches is not
    end = max(consumer.end_offsets([tp_scored])[tp_scored], consumer.highwater(tp_scored) or 0)
    deadline = time.monotonic() + CATCH_UP_SECONDS
    while time.monotonic() < deadline and (consumer.position(tp_scored) < end
                                           or status.groups_scored < len(scored_ids)):
        for records in consumer.poll(timeout_ms=200, max_records=500).values():
            for r in records:
                if r.topic != tp_scored.topic:
                    continue
                g = common_pb2.RolloutGroup.FromString(r.value)
                if _learnable(g, job_id):
                    scored_ids.add(g.group_id)
        if consumer.position(tp_scored) >= end:
            try:
                status = scheduler.job(job_id)
            except grpc.RpcError as e:  # the job is done: a scheduler gone now costs the report its last counts
                tqdm.write(f"the scheduler did not answer ({e.code().name}); the report shows the counts it had")
                break
    if status.groups_scored < len(scored_ids):
        tqdm.write(f"the scheduler has learned {status.groups_scored} of the job's {len(scored_ids)} scored groups "
                   f"after {CATCH_UP_SECONDS:.0f}s; the report shows what it has")
    return status


def end_job(state: State, job_id: str) -> None:
    """Stop ``job_id`` if it is still running or paused (best effort: the scheduler may be gone). ``temper run``
    calls this before it takes its stack down, so the scheduler's saved state holds the job as ended."""
    if "scheduler" not in state.services:
        return
    try:
        with SchedulerClient(state.services["scheduler"].address, timeout=30) as scheduler:
            scheduler.stop_job(job_id)
    except grpc.RpcError:
        pass  # not found (never started), or the scheduler is down: nothing to resume it from this run


def eval_summary(evals) -> dict:
    """before/after accuracy per domain and the gain, from a job's evaluations (empty without any)."""
    if not evals:
        return {}
    first, last = evals[0], evals[-1]
    gain = {d: last.accuracy[d] - first.accuracy[d] for d in first.accuracy if d in last.accuracy}

    def point(e) -> dict:
        return {"policy_version": e.policy_version, "accuracy": dict(e.accuracy),
                "accuracy_stderr": dict(e.accuracy_stderr), "mean_reward": dict(e.mean_reward),
                "accuracy_beyond_majority": dict(e.accuracy_beyond_majority)}

    return {
        "before": point(first), "after": point(last), "gain": gain,
        "mean_gain": sum(gain.values()) / len(gain) if gain else 0.0,
        "problems_per_domain": first.problems, "samples": max(1, first.samples), "temperature": first.temperature,
        # what always giving a domain's most common answer scores; accuracy_beyond_majority is the rest's
        "majority_share": dict(first.majority_share),
        "evals": [{"phase": e.phase, "policy_version": e.policy_version, "accuracy": dict(e.accuracy),
                   "accuracy_stderr": dict(e.accuracy_stderr), "pass_at_k": dict(e.pass_at_k),
                   "mean_reward": dict(e.mean_reward), "accuracy_beyond_majority": dict(e.accuracy_beyond_majority),
                   "seconds": e.seconds, "generated_tokens": e.generated_tokens}
                  for e in evals],
    }


def sampling_summary(status: scheduler_pb2.JobStatus) -> dict:
    """What the scheduler learned per domain (counts, pass rates, weights, difficulty) and its dynamic-sampling
    counters, from the job's status."""
    return {"groups_scored": status.groups_scored, "zero_variance_groups_dropped": status.zero_variance_groups_dropped,
            "refill_groups": status.refill_groups, "unfilled_groups": status.unfilled_groups,
            "domains": [{f.name: getattr(d, f.name) for f in d.DESCRIPTOR.fields} for d in status.domains]}


def repeated_domains(sampling: dict) -> list[dict]:
    """The domains of a summary's ``sampling`` table whose training draws repeated earlier prompts as often as the
    scheduler warns of (``temper.scheduler.core.repeats_warned``)."""
    return [d for d in sampling.get("domains", []) if repeats_warned(d.get("drawn", 0), d.get("repeated_prompts", 0))]


def write_report(out_dir: Path, spec: JobSpec, config: dict, steps: list[common_pb2.StepMetrics],
                 wall_seconds: float, followed: Followed | None = None, extra: dict | None = None) -> Path:
    """Write summary.json and the report of it (temper.cli.report: report.json, reward_curve.png, training.png,
    eval_accuracy.png with evaluations, TensorBoard events in tb/) into ``out_dir``; point ``out_dir.parent/latest``
    at it."""
    from temper.cli import report

    status = followed.status if followed is not None else None
    out_dir.mkdir(parents=True, exist_ok=True)
    k = max(1, len(steps) // 5)
    first = [m.mean_reward for m in steps[:k]]
    last = [m.mean_reward for m in steps[-k:]]
    evals = list(status.evals) if status is not None else []
    summary = {
        "job": asdict(spec),
        "config": config,
        "wall_seconds": wall_seconds,
        "steps_per_minute": len(steps) / wall_seconds * 60 if wall_seconds else 0.0,
        "reward_first_steps": sum(first) / len(first) if first else 0.0,
        "reward_last_steps": sum(last) / len(last) if last else 0.0,
        "eval": eval_summary(evals),
        "eval_draws_skipped": status.eval_draws_skipped if status is not None else 0,
        **(extra or {}),
        "steps": [{"step": m.step, "mean_reward": m.mean_reward, "policy_version": m.policy_version,
                   "samples": m.samples, "seconds": m.seconds,
                   "mean_sample_policy_version": m.mean_sample_policy_version,
                   "min_sample_policy_version": m.min_sample_policy_version,
                   "max_sample_policy_version": m.max_sample_policy_version,
                   "domain_mean_reward": dict(m.domain_mean_reward), "values": dict(m.values)} for m in steps],
    }
    if followed is not None:
        summary["job_state"] = scheduler_pb2.JobState.Name(followed.status.state)
        summary["steps_done"] = followed.status.steps_done  # the scheduler's counts (a resumed job's included)
        summary["groups_published"] = followed.status.groups_published
        summary["pause_reason"] = followed.status.pause_reason
        summary["alerts"] = [MessageToDict(a, preserving_proto_field_name=True) for a in followed.alerts]
        summary["samples"] = {str(k): v for k, v in followed.samples.items()}
        summary["sampling"] = sampling_summary(followed.status)
        summary["skipped_batches"] = [{"policy_version": m.policy_version, "after_step": m.step,
                                       "values": dict(m.values)} for m in followed.skipped]
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    report.write(out_dir, report.of_summary(summary, out_dir / "summary.json"))
    latest = out_dir.parent / "latest"
    if latest.is_symlink() or latest.exists():
        latest.unlink()
    latest.symlink_to(out_dir.name)
    return out_dir

