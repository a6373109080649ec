"""Python SDK: thin typed clients for every Temper service, used by the CLI, by the services
themselves when they call each other, and by outside systems.

Each client wraps one gRPC channel and exposes the service's RPCs; errors surface as
``grpc.RpcError`` with the server's status and message. This package depends on grpcio,
protobuf and the generated code only (no torch): services pass a traced channel of their own.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc

from temper.client.transport import channel as _channel
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
    sandbox_pb2,
    sandbox_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)


class _Client:
    stub_class: type

    def __init__(self, address: str, timeout: float = 60.0, channel: grpc.Channel | None = None):
        """``channel``: an existing channel to ``address`` (e.g. one carrying trace context); it is closed by ``close``."""
        self.address = address
        self.timeout = timeout
        self._channel = channel if channel is not None else _channel(address)
        self.stub = self.stub_class(self._channel)

    def close(self) -> None:
        self._channel.close()

    def wait_ready(self, timeout: float) -> bool:
        """Wait until the channel is connected (the server started), at most ``timeout`` seconds.

        A call to a server that has bound its port but not started yet (it is loading) waits only
        for gRPC's connect timeout (20 s) and then fails UNAVAILABLE; this waits through reconnects.
        """
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
            return True
        except grpc.FutureTimeoutError:
            return False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class InferenceClient(_Client):
    stub_class = inference_pb2_grpc.InferenceServiceStub

    def generate(self, prompts: Iterable[str | list[int]], n: int = 1, temperature: float = 1.0,
                 max_tokens: int = 16, top_p: float = 1.0, top_k: int = 0, stop: Iterable[str] = (),
                 seed: int | None = None, apply_chat_template: bool = False,
                 assistant_prefix: str = "") -> inference_pb2.GenerateResponse:
        msgs = [inference_pb2.Prompt(text=p, apply_chat_template=apply_chat_template, assistant_prefix=assistant_prefix)
                if isinstance(p, str)
                else inference_pb2.Prompt(token_ids=inference_pb2.TokenIds(ids=p)) for p in prompts]
        sampling = inference_pb2.SamplingParams(n=n, temperature=temperature, max_tokens=max_tokens, top_p=top_p,
                                                top_k=top_k, stop=list(stop), seed=seed)
        return self.stub.Generate(inference_pb2.GenerateRequest(prompts=msgs, sampling=sampling),
                                  timeout=self.timeout)

    def update_weights(self, chunks: Iterable[inference_pb2.WeightChunk]) -> inference_pb2.UpdateWeightsResponse:
        """Stream one new policy version as WeightChunk messages (the first carries ``new_version``).

        The server package builds them from tensors: ``temper.inference.weights.chunks_from_tensors``.
        """
        return self.stub.UpdateWeights(iter(chunks), timeout=self.timeout)

    def policy_version(self) -> int:
        return self.stub.GetPolicyVersion(inference_pb2.GetPolicyVersionRequest(),
                                          timeout=self.timeout).policy_version


class RewardClient(_Client):
    stub_class = reward_pb2_grpc.RewardServiceStub

    def score(self, group: common_pb2.RolloutGroup) -> common_pb2.RolloutGroup:
        return self.stub.Score(reward_pb2.ScoreRequest(group=group), timeout=self.timeout).group

    def list_domains(self) -> reward_pb2.ListDomainsResponse:
        """The domains scored, each with its component weights; the verifier components; which models are loaded."""
        return self.stub.ListDomains(reward_pb2.ListDomainsRequest(), timeout=self.timeout)


class SandboxClient(_Client):
    """Run untrusted code in the sandbox service (gVisor). Limits left at 0 take the service's defaults."""

    stub_class = sandbox_pb2_grpc.SandboxServiceStub

    @staticmethod
    def request(source: str | bytes | None = None, language: str = "python3", *,
                files: dict[str, str | bytes] | None = None, command: Iterable[str] = (), stdin: str | bytes = b"",
                wall_seconds: float = 0, cpu_seconds: float = 0, memory_mb: int = 0, max_processes: int = 0,
                max_output_bytes: int = 0) -> sandbox_pb2.ExecuteRequest:
        """An ExecuteRequest: ``source`` is the language's main file; ``files`` adds others by path."""
        def raw(v):
            return v.encode() if isinstance(v, str) else v

        sources = [sandbox_pb2.SourceFile(path="", content=raw(source))] if source is not None else []
        sources += [sandbox_pb2.SourceFile(path=p, content=raw(c)) for p, c in (files or {}).items()]
        return sandbox_pb2.ExecuteRequest(
            language=language, files=sources, command=list(command), stdin=raw(stdin),
            limits=sandbox_pb2.Limits(wall_seconds=wall_seconds, cpu_seconds=cpu_seconds, memory_mb=memory_mb,
                                      max_processes=max_processes, max_output_bytes=max_output_bytes))

    def execute(self, source: str | bytes | None = None, language: str = "python3", **kw) -> sandbox_pb2.ExecuteResponse:
        """Run once; ``kw`` as for ``request``. The verdict name: ``sandbox_pb2.Verdict.Name(resp.verdict)``."""
        req = self.request(source, language, **kw)
        return self.stub.Execute(req, timeout=self.timeout + req.limits.wall_seconds)

    def run_tests(self, source: str | bytes | None, tests: Iterable[sandbox_pb2.TestCase | dict | str],
                  language: str = "python3", stop_on_first_failure: bool = False, exact_output: bool = False,
                  **kw) -> sandbox_pb2.RunTestsResponse:
        """Run against ``tests``: TestCase messages, dicts of its fields, or strings (assertion scripts)."""
        def case(t):
            if isinstance(t, str):
                return sandbox_pb2.TestCase(assertion_script=t)
            if isinstance(t, dict):
                t = {k: v.encode() if isinstance(v, str) and k != "assertion_script" else v for k, v in t.items()}
                return sandbox_pb2.TestCase(**t)
            return t

        cases = [case(t) for t in tests]
        req = sandbox_pb2.RunTestsRequest(
            program=self.request(source, language, **kw), tests=cases, stop_on_first_failure=stop_on_first_failure,
            output_match=sandbox_pb2.OUTPUT_MATCH_EXACT if exact_output else sandbox_pb2.OUTPUT_MATCH_UNSPECIFIED)
        return self.stub.RunTests(req, timeout=self.timeout + len(cases) * (req.program.limits.wall_seconds or 10))


class ReplayClient(_Client):
    stub_class = replay_pb2_grpc.ReplayServiceStub

    def insert(self, groups: Iterable[common_pb2.RolloutGroup], table: str = "default",
               priorities: Iterable[float] | None = None) -> replay_pb2.InsertResponse:
        """Stream ``groups`` into ``table``; answered once all are durable (or the rate limiter's wait ran out)."""
        groups = list(groups)
        prios = list(priorities) if priorities is not None else [None] * len(groups)
        return self.stub.Insert((replay_pb2.InsertRequest(table=table, group=g, priority=p) for g, p in zip(groups, prios)),
                                timeout=self.timeout)

    def sample_batch(self, batch_size: int, table: str = "default", timeout_ms: int = 10_000,
                     current_policy_version: int | None = None,
                     importance_sampling_exponent: float | None = None) -> replay_pb2.SampleResponse:
        """Groups with their SampleInfo (probability, importance weight, times sampled, ...)."""
        req = replay_pb2.SampleRequest(table=table, batch_size=batch_size, timeout_ms=timeout_ms,
                                       current_policy_version=current_policy_version,
                                       importance_sampling_exponent=importance_sampling_exponent)
        return self.stub.Sample(req, timeout=timeout_ms / 1000 + self.timeout)

    def sample(self, batch_size: int, table: str = "default", timeout_ms: int = 10_000,
               current_policy_version: int | None = None) -> list[common_pb2.RolloutGroup]:
        return list(self.sample_batch(batch_size, table, timeout_ms, current_policy_version).groups)

    def update_priorities(self, priorities: dict[str, float], table: str = "default"
                          ) -> replay_pb2.UpdatePrioritiesResponse:
        return self.stub.UpdatePriorities(replay_pb2.UpdatePrioritiesRequest(table=table, priorities=priorities),
                                          timeout=self.timeout)

    def stats(self, table: str = "default") -> replay_pb2.StatsResponse:
        return self.stub.Stats(replay_pb2.StatsRequest(table=table), timeout=self.timeout)

    def checkpoint(self) -> replay_pb2.ReplayCheckpointResponse:
        return self.stub.Checkpoint(replay_pb2.ReplayCheckpointRequest(), timeout=self.timeout)

    def restore(self, checkpoint_id: str) -> replay_pb2.ReplayRestoreResponse:
        return self.stub.Restore(replay_pb2.ReplayRestoreRequest(checkpoint_id=checkpoint_id), timeout=self.timeout)


class LearnerClient(_Client):
    stub_class = learner_pb2_grpc.LearnerServiceStub

    def status(self) -> learner_pb2.LearnerStatus:
        return self.stub.Status(learner_pb2.LearnerStatusRequest(), timeout=self.timeout)

    def checkpoint(self, path: str = "") -> learner_pb2.CheckpointResponse:
        """Checkpoint between steps (``path`` relative to the learner's checkpoint dir; "" = step-<N>)."""
        return self.stub.Checkpoint(learner_pb2.CheckpointRequest(path=path), timeout=self.timeout)

    def export_policy(self, path: str, dtype: str = "", timeout: float | None = None) -> learner_pb2.ExportPolicyResponse:
        """Write the current policy as an HF model folder at ``path`` (absolute, new or empty)."""
        return self.stub.ExportPolicy(learner_pb2.ExportPolicyRequest(path=path, dtype=dtype),
                                      timeout=timeout or self.timeout)

    def pause(self) -> learner_pb2.LearnerStatus:
        """Stop updates; returns once a step in flight has finished."""
        return self.stub.Pause(learner_pb2.PauseRequest(), timeout=self.timeout)

    def resume(self) -> learner_pb2.LearnerStatus:
        return self.stub.Resume(learner_pb2.ResumeRequest(), timeout=self.timeout)


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


__all__ = ["InferenceClient", "RewardClient", "SandboxClient", "ReplayClient", "LearnerClient", "SchedulerClient",
           "MonitorClient", "grpc"]
