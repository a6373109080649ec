"""Running one job end to end on a local stack: submit, follow the learner's metrics, report."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

from kafka import KafkaConsumer
from kafka.structs import TopicPartition
from tqdm import tqdm

from temper.client.sdk import SchedulerClient
from temper.runtime import kafka
from temper.runtime.launcher import State
from temper.scheduler.core import JobSpec
from temper.v1 import common_pb2, scheduler_pb2


def follow_job(state: State, spec: JobSpec, timeout: float, echo=print) -> list[common_pb2.StepMetrics]:
    """Submit ``spec`` and return the learner's StepMetrics for each of its steps, in order."""
    consumer = KafkaConsumer(bootstrap_servers=state.kafka_bootstrap, group_id=None, enable_auto_commit=False,
                             fetch_max_wait_ms=100)
    tp = TopicPartition(kafka.METRICS, 0)
    consumer.assign([tp])
    consumer.seek_to_end(tp)
    consumer.position(tp)  # resolve the end offset before the job starts
    scheduler = SchedulerClient(state.services["scheduler"].address)
    status = scheduler.start_job(spec.to_proto())
    job_id = status.job_id
    steps: dict[int, common_pb2.StepMetrics] = {}
    deadline = time.monotonic() + timeout
    bar = tqdm(total=spec.steps, desc="steps", unit="step", dynamic_ncols=True)
    try:
        while len(steps) < spec.steps:
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id}: {len(steps)} of {spec.steps} steps after {timeout:.0f}s")
            for records in consumer.poll(timeout_ms=500).values():
                for r in records:
                    m = common_pb2.StepMetrics.FromString(r.value)
                    if m.job_id != job_id or m.step in steps:
                        continue
                    steps[m.step] = m
                    bar.update(1)
                    tqdm.write(f"step {m.step:4d}  reward {m.mean_reward:.3f}  policy v{m.policy_version}  "
                               f"samples {m.samples}  {m.seconds:.2f}s  "
                               + "  ".join(f"{d} {v:.2f}" for d, v in sorted(m.domain_mean_reward.items())))
            job = scheduler.job(job_id)
            if job.state in (scheduler_pb2.JOB_STATE_FAILED, scheduler_pb2.JOB_STATE_STOPPED):
                raise RuntimeError(f"job {job_id} {scheduler_pb2.JobState.Name(job.state)}: {job.error}")
    finally:
        bar.close()
        consumer.close()
        scheduler.close()
    return [steps[k] for k in sorted(steps)]


def write_report(out_dir: Path, spec: JobSpec, config: dict, steps: list[common_pb2.StepMetrics],
                 wall_seconds: float) -> Path:
    """Write summary.json and reward_curve.png into ``out_dir``; point ``out_dir.parent/latest`` at it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    k = max(1, len(steps) // 5)
    first = [m.mean_reward for m in steps[:k]]
    last = [m.mean_reward for m in steps[-k:]]
    summary = {
        "job": asdict(spec),
        "config": config,
        "wall_seconds": wall_seconds,
        "steps_per_minute": len(steps) / wall_seconds * 60 if wall_seconds else 0.0,
        "reward_first_steps": sum(first) / len(first) if first else 0.0,
        "reward_last_steps": sum(last) / len(last) if last else 0.0,
        "steps": [{"step": m.step, "mean_reward": m.mean_reward, "policy_version": m.policy_version,
                   "samples": m.samples, "seconds": m.seconds,
                   "mean_sample_policy_version": m.mean_sample_policy_version,
                   "domain_mean_reward": dict(m.domain_mean_reward), "values": dict(m.values)} for m in steps],
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([m.step for m in steps], [m.mean_reward for m in steps], label="all", linewidth=2)
    for d in sorted({d for m in steps for d in m.domain_mean_reward}):
        pts = [(m.step, m.domain_mean_reward[d]) for m in steps if d in m.domain_mean_reward]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=d, alpha=0.6)
    ax.set_xlabel("learner step (policy version)")
    ax.set_ylabel("mean reward")
    ax.set_ylim(-0.02, 1.02)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_dir / "reward_curve.png", dpi=100)
    plt.close(fig)
    latest = out_dir.parent / "latest"
    if latest.is_symlink() or latest.exists():
        latest.unlink()
    latest.symlink_to(out_dir.name)
    return out_dir
