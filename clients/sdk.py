"""Python SDK: thin typed clients for every Temper service, used by the CLI, by the services
themselves when they call each other, and by outside systems.

Each client wraps one gRPC channel (trace context travels in metadata) and exposes the
service's RPCs; errors surface as ``grpc.RpcError`` with the server's status and message.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc

from temper.runtime.rpc import channel
from temper.v1 import (
    common_pb2,
    inference_pb2,
    inference_pb2_grpc,
    learner_pb2,
    learner_pb2_grpc,
    monitor_pb2,
    monitor_pb2_grpc,
    replay_pb2,
    replay_pb2_grpc,
    reward_pb2,
    reward_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)


class _Client:
    stub_class: type

    def __init__(self, address: str, timeout: float = 60.0):
        self.address = address
        self.timeout = timeout
        self._channel = channel(address)
        self.stub = self.stub_class(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class InferenceClient(_Client):
    stub_class = inference_pb2_grpc.InferenceServiceStub

    def generate(self, prompts: Iterable[str | list[int]], n: int = 1, temperature: float = 1.0,
                 max_tokens: int = 16, top_p: float = 1.0, top_k: int = 0, stop: Iterable[str] = (),
                 seed: int | None = None, apply_chat_template: bool = False) -> inference_pb2.GenerateResponse:
        msgs = [inference_pb2.Prompt(text=p, apply_chat_template=apply_chat_template) if isinstance(p, str)
                else inference_pb2.Prompt(token_ids=inference_pb2.TokenIds(ids=p)) for p in prompts]
        sampling = inference_pb2.SamplingParams(n=n, temperature=temperature, max_tokens=max_tokens, top_p=top_p,
                                                top_k=top_k, stop=list(stop), seed=seed)
        return self.stub.Generate(inference_pb2.GenerateRequest(prompts=msgs, sampling=sampling),
                                  timeout=self.timeout)

    def update_weights(self, tensors, new_version: int = 0, chunk_bytes: int | None = None
                       ) -> inference_pb2.UpdateWeightsResponse:
        """Stream ``tensors`` (name -> torch.Tensor) as one new policy version."""
        from temper.inference.weights import DEFAULT_CHUNK_BYTES, chunks_from_tensors

        return self.stub.UpdateWeights(
            chunks_from_tensors(tensors, chunk_bytes or DEFAULT_CHUNK_BYTES, new_version), timeout=self.timeout)

    def policy_version(self) -> int:
        return self.stub.GetPolicyVersion(inference_pb2.GetPolicyVersionRequest(),
                                          timeout=self.timeout).policy_version


class RewardClient(_Client):
    stub_class = reward_pb2_grpc.RewardServiceStub

    def score(self, group: common_pb2.RolloutGroup) -> common_pb2.RolloutGroup:
        return self.stub.Score(reward_pb2.ScoreRequest(group=group), timeout=self.timeout).group


class ReplayClient(_Client):
    stub_class = replay_pb2_grpc.ReplayServiceStub

    def insert(self, groups: Iterable[common_pb2.RolloutGroup], table: str = "default") -> replay_pb2.InsertResponse:
        return self.stub.Insert((replay_pb2.InsertRequest(table=table, group=g) for g in groups),
                                timeout=self.timeout)

    def sample(self, batch_size: int, table: str = "default", timeout_ms: int = 10_000) -> list[common_pb2.RolloutGroup]:
        resp = self.stub.Sample(replay_pb2.SampleRequest(table=table, batch_size=batch_size, timeout_ms=timeout_ms),
                                timeout=timeout_ms / 1000 + self.timeout)
        return list(resp.groups)

    def stats(self, table: str = "default") -> replay_pb2.StatsResponse:
        return self.stub.Stats(replay_pb2.StatsRequest(table=table), timeout=self.timeout)


class LearnerClient(_Client):
    stub_class = learner_pb2_grpc.LearnerServiceStub

    def status(self) -> learner_pb2.LearnerStatus:
        return self.stub.Status(learner_pb2.LearnerStatusRequest(), timeout=self.timeout)


class SchedulerClient(_Client):
    stub_class = scheduler_pb2_grpc.SchedulerServiceStub

    def start_job(self, spec: scheduler_pb2.JobSpec) -> scheduler_pb2.JobStatus:
        return self.stub.StartJob(spec, timeout=self.timeout)

    def job(self, job_id: str) -> scheduler_pb2.JobStatus:
        return self.stub.GetJob(scheduler_pb2.GetJobRequest(job_id=job_id), timeout=self.timeout)

    def stop_job(self, job_id: str) -> scheduler_pb2.JobStatus:
        return self.stub.StopJob(scheduler_pb2.GetJobRequest(job_id=job_id), timeout=self.timeout)


class MonitorClient(_Client):
    stub_class = monitor_pb2_grpc.MonitorServiceStub

    def reward_curve(self, domain: str = "") -> list[monitor_pb2.CurvePoint]:
        return list(self.stub.RewardCurve(monitor_pb2.RewardCurveRequest(domain=domain), timeout=self.timeout).points)


__all__ = ["InferenceClient", "RewardClient", "ReplayClient", "LearnerClient", "SchedulerClient", "MonitorClient",
           "grpc"]
