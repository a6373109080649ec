"""The learner's service loop: replay -> trainer -> inference replicas -> metrics.

Kept apart from the trainer so the maths stays testable alone; this file holds the I/O.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import grpc

from temper.client.sdk import InferenceClient, ReplayClient
from temper.learner.trainer import Trainer, batch_from_groups
from temper.runtime import kafka
from temper.runtime.errors import InvalidArgument
from temper.runtime.logs import get_logger
from temper.runtime.tracing import tracer
from temper.v1 import common_pb2

_log = get_logger(component="learner-loop")


@dataclass
class LearnerState:
    step: int = 0
    policy_version: int = 0
    paused: bool = False
    skipped_batches: int = 0
    last: common_pb2.StepMetrics = field(default_factory=common_pb2.StepMetrics)


class LearnerLoop:
    def __init__(self, trainer: Trainer, replay: ReplayClient, replicas: list[InferenceClient],
                 producer: kafka.ProtoProducer | None, groups_per_step: int, table: str = "default",
                 sample_timeout_ms: int = 5_000):
        self.trainer = trainer
        self.replay = replay
        self.replicas = replicas
        self.producer = producer
        self.groups_per_step = groups_per_step
        self.table = table
        self.sample_timeout_ms = sample_timeout_ms
        self.state = LearnerState()
        self._stop = threading.Event()
        self._resume = threading.Event()
        self._resume.set()
        self._thread = threading.Thread(target=self._run, name="learner-loop", daemon=True)
        self._tracer = tracer("temper.learner")

    def start(self) -> LearnerLoop:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._resume.set()
        self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._resume.wait()
            if self._stop.is_set():
                return
            t0 = time.perf_counter()
            try:
                groups = self.replay.sample(self.groups_per_step, self.table, self.sample_timeout_ms)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    _log.warning("sample failed", code=e.code().name, details=e.details())
                    self._stop.wait(1.0)
                continue
            self.train_on(groups, t0)

    def train_on(self, groups: list[common_pb2.RolloutGroup], t0: float) -> common_pb2.StepMetrics | None:
        with self._tracer.start_as_current_span("learner.step") as span:
            try:
                batch = batch_from_groups(groups)
                values = self.trainer.step(batch)
            except InvalidArgument as e:
                self.state.skipped_batches += 1
                _log.error("batch skipped", error=str(e), skipped=self.state.skipped_batches)
                return None
            version = self.trainer.step_count
            weights = self.trainer.weights()
            for replica in self.replicas:
                replica.update_weights(weights, new_version=version)
            domain_rewards: dict[str, list[float]] = {}
            for d, r in zip(batch.domains, batch.rewards.tolist()):
                domain_rewards.setdefault(d, []).append(r)
            metrics = common_pb2.StepMetrics(
                job_id=batch.job_id, step=version, policy_version=version,
                mean_reward=batch.rewards.mean().item(), samples=len(batch.rewards),
                seconds=time.perf_counter() - t0, values=values,
                domain_mean_reward={d: sum(v) / len(v) for d, v in domain_rewards.items()},
                mean_sample_policy_version=batch.policy_versions.float().mean().item())
            span.set_attribute("temper.policy_version", version)
            if self.producer is not None:
                self.producer.send(kafka.METRICS, batch.job_id or "learner", metrics).get(30)
            self.state.step, self.state.policy_version, self.state.last = version, version, metrics
            _log.info("step", step=version, mean_reward=round(metrics.mean_reward, 4), loss=round(values["loss"], 4))
            return metrics

    def pause(self) -> None:
        self.state.paused = True
        self._resume.clear()

    def resume(self) -> None:
        self.state.paused = False
        self._resume.set()
