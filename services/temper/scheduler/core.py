"""The scheduler's core: a job's rollout loop with bounded off-policy lag. No gRPC server code.

Step s (0-based) is generated only once the serving policy version is >= s - max_policy_lag,
so generation never runs more than ``max_policy_lag`` learner updates ahead. Every group gets
a stable id ``<job>/s<step>/p<prompt>`` and each trajectory ``<group>/<k>``, so a redelivery
downstream is recognised.
"""

from __future__ import annotations

import functools
import random
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from temper import tasks
from temper.runtime.errors import FailedPrecondition, require
from temper.runtime.logs import get_logger
from temper.runtime.tracing import current_context_carrier, tracer
from temper.v1 import common_pb2, inference_pb2, scheduler_pb2

_log = get_logger(component="scheduler")


@functools.cache
def known_domains() -> frozenset[str]:
    return frozenset(tasks.domains())
MAX_STEPS = 1_000_000
MAX_GROUPS_PER_STEP = 4096
MAX_GROUP_SIZE = 1024


@dataclass
class JobSpec:
    job_id: str = ""
    steps: int = 150
    prompts_per_step: int = 16
    group_size: int = 8
    domains: list[str] = field(default_factory=lambda: ["toy.copy", "toy.next"])
    max_policy_lag: int = 0
    temperature: float = 1.0
    max_tokens: int = 2
    seed: int = 0

    @classmethod
    def from_proto(cls, p: scheduler_pb2.JobSpec) -> JobSpec:
        spec = cls(job_id=p.job_id or f"job-{uuid.uuid4().hex[:8]}", steps=p.steps, prompts_per_step=p.prompts_per_step,
                   group_size=p.group_size, domains=list(p.domains) or ["toy.copy", "toy.next"],
                   max_policy_lag=p.max_policy_lag, temperature=p.temperature, max_tokens=p.max_tokens, seed=p.seed)
        spec.validate()
        return spec

    def validate(self) -> None:
        require(1 <= self.steps <= MAX_STEPS, "steps", f"must be in [1, {MAX_STEPS}], got {self.steps}")
        require(1 <= self.prompts_per_step <= MAX_GROUPS_PER_STEP, "prompts_per_step",
                f"must be in [1, {MAX_GROUPS_PER_STEP}], got {self.prompts_per_step}")
        require(1 <= self.group_size <= MAX_GROUP_SIZE, "group_size",
                f"must be in [1, {MAX_GROUP_SIZE}], got {self.group_size}")
        require(self.max_policy_lag >= 0, "max_policy_lag", f"must be >= 0, got {self.max_policy_lag}")
        require(self.temperature > 0, "temperature", f"must be > 0, got {self.temperature}")
        require(self.max_tokens >= 1, "max_tokens", f"must be >= 1, got {self.max_tokens}")
        for d in self.domains:
            require(d in known_domains(), "domains",
                    f"unknown domain {d!r}; families: toy.*, math.*, code.*, rg.<reasoning-gym family>")

    def to_proto(self) -> scheduler_pb2.JobSpec:
        return scheduler_pb2.JobSpec(job_id=self.job_id, steps=self.steps, prompts_per_step=self.prompts_per_step,
                                     group_size=self.group_size, domains=self.domains,
                                     max_policy_lag=self.max_policy_lag, temperature=self.temperature,
                                     max_tokens=self.max_tokens, seed=self.seed)


class Job:
    """Runs one job on a thread of its own.

    ``generate(prompts, spec, seed) -> GenerateResponse`` calls inference; ``publish(group)`` returns once
    the group is durably in the `rollouts` topic; ``policy_version()`` reads the serving version.
    """

    def __init__(self, spec: JobSpec, generate: Callable[[list[str], JobSpec, int], inference_pb2.GenerateResponse],
                 publish: Callable[[common_pb2.RolloutGroup], None], policy_version: Callable[[], int]):
        self.spec = spec
        self._generate = generate
        self._publish = publish
        self._policy_version = policy_version
        self.state = scheduler_pb2.JOB_STATE_RUNNING
        self.steps_done = 0
        self.groups_published = 0
        self.error = ""
        self.pause_reason = ""
        self._stop = threading.Event()
        self._resume = threading.Event()  # clear while paused: the loop holds before its next step
        self._resume.set()
        self._rng = random.Random(spec.seed)
        self._thread = threading.Thread(target=self._run, name=f"job-{spec.job_id}", daemon=True)
        self._tracer = tracer("temper.scheduler")

    def start(self) -> Job:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._resume.set()
        self._thread.join(30)
        if self.state in (scheduler_pb2.JOB_STATE_RUNNING, scheduler_pb2.JOB_STATE_PAUSED):
            self.state = scheduler_pb2.JOB_STATE_STOPPED

    def pause(self, reason: str = "") -> None:
        """Hold the job before its next step; the step in flight (if any) finishes and is published."""
        if self.state not in (scheduler_pb2.JOB_STATE_RUNNING, scheduler_pb2.JOB_STATE_PAUSED):
            raise FailedPrecondition(f"job {self.spec.job_id} is {scheduler_pb2.JobState.Name(self.state)}",
                                     field="job_id")
        self._resume.clear()
        self.state = scheduler_pb2.JOB_STATE_PAUSED
        self.pause_reason = reason
        _log.warning("job paused", job_id=self.spec.job_id, reason=reason)

    def resume(self) -> None:
        if self.state not in (scheduler_pb2.JOB_STATE_RUNNING, scheduler_pb2.JOB_STATE_PAUSED):
            raise FailedPrecondition(f"job {self.spec.job_id} is {scheduler_pb2.JobState.Name(self.state)}",
                                     field="job_id")
        self.state = scheduler_pb2.JOB_STATE_RUNNING
        self.pause_reason = ""
        self._resume.set()
        _log.info("job resumed", job_id=self.spec.job_id)

    def status(self) -> scheduler_pb2.JobStatus:
        return scheduler_pb2.JobStatus(job_id=self.spec.job_id, state=self.state, steps_done=self.steps_done,
                                       steps=self.spec.steps, groups_published=self.groups_published, error=self.error,
                                       spec=self.spec.to_proto(), pause_reason=self.pause_reason)

    def _run(self) -> None:
        try:
            for step in range(self.spec.steps):
                self._resume.wait()
                if self._stop.is_set():
                    return
                if not self._wait_for_policy(step - self.spec.max_policy_lag):
                    return
                self.run_step(step)
                self.steps_done = step + 1
            self.state = scheduler_pb2.JOB_STATE_DONE
        except Exception as e:  # noqa: BLE001 - the job fails, the service keeps serving
            _log.exception("job failed", job_id=self.spec.job_id)
            self.error = f"{type(e).__name__}: {e}"
            self.state = scheduler_pb2.JOB_STATE_FAILED

    def _wait_for_policy(self, version: int) -> bool:
        while not self._stop.is_set():
            if version <= 0 or self._policy_version() >= version:
                return True
            self._stop.wait(0.02)
        return False

    def run_step(self, step: int) -> None:
        spec = self.spec
        with self._tracer.start_as_current_span("scheduler.step", attributes={"temper.job_id": spec.job_id,
                                                                               "temper.step": step}):
            step_tasks = [tasks.make_task(self._rng.choice(spec.domains), self._rng, f"{spec.job_id}/s{step}/p{i}")
                          for i in range(spec.prompts_per_step)]
            # a seed per step: a job's sampling is reproducible given the weights
            response = self._generate([t.prompt for t in step_tasks], spec, spec.seed * 1_000_003 + step)
            trace_context = current_context_carrier()  # the learner step that trains on these groups links here
            for i, (task, result) in enumerate(zip(step_tasks, response.results)):
                group_id = f"{spec.job_id}/s{step}/p{i}"
                group = common_pb2.RolloutGroup(
                    group_id=group_id, job_id=spec.job_id, step=step, task=task, created_unix_ms=int(time.time() * 1000),
                    trace_context=trace_context, step_groups=len(step_tasks),
                    trajectories=[common_pb2.Trajectory(
                        trajectory_id=f"{group_id}/{k}", group_id=group_id,
                        prompt_token_ids=result.prompt_token_ids, completion_token_ids=c.token_ids,
                        completion_logprobs=c.logprobs, policy_version=response.policy_version,
                        completion_text=c.text, finish_reason=c.finish_reason,
                        sampling_temperature=spec.temperature) for k, c in enumerate(result.completions)])
                self._publish(group)
                self.groups_published += 1
