"""Python SDK: thin typed clients for every Temper service, used by the CLI, by the services
themselves when they call each other, and by outside systems.

Each client wraps one gRPC channel and exposes the service's RPCs; errors surface as
``grpc.RpcError`` with the server's status and message. This package depends on grpcio,
protobuf and the generated code only (no torch): services pass a traced channel of their own.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import grpc

from temper.client.transport import channel as _channel
from temper.client.transport import varint, wire_bytes
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


def verdict_name(verdict: int) -> str:
    """A sandbox Verdict's short name: ``VERDICT_WRONG_ANSWER`` -> ``"WRONG_ANSWER"`` (what reports and the CLI show)."""
    return sandbox_pb2.Verdict.Name(verdict).removeprefix("VERDICT_")


class _Client:
    stub_class: type

    def __init__(self, address: str, timeout: float = 60.0, channel: grpc.Channel | None = None,
                 token: str | None = None, tls_dir: str | None = None):
        """``channel``: an existing channel to ``address`` (e.g. one carrying trace context); it is closed by ``close``.
        ``token``: the services' shared auth token (default: the file ``$TEMPER_AUTH_TOKEN_FILE`` names, if set).
        ``tls_dir``: a folder with ``ca.crt``, ``tls.crt``, ``tls.key`` for mTLS (default: ``$TEMPER_TLS_DIR``, if set)."""
        self.address = address
        self.timeout = timeout
        self._channel = channel if channel is not None else _channel(address, token=token, tls_dir=tls_dir)
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

    def __init__(self, address: str, timeout: float = 60.0, channel: grpc.Channel | None = None,
                 token: str | None = None, tls_dir: str | None = None):
        super().__init__(address, timeout, channel, token, tls_dir)
        # UpdateWeights taking chunks as messages or as their wire bytes (sent as they are)
        self._update_raw = self._channel.stream_unary(
            "/temper.v1.InferenceService/UpdateWeights", request_serializer=wire_bytes,
            response_deserializer=inference_pb2.UpdateWeightsResponse.FromString)

    def generate(self, prompts: Iterable[str | list[int]], n: int = 1, temperature: float = 1.0,
                 max_tokens: int = 16, top_p: float = 1.0, top_k: int = 0, stop: Iterable[str] = (),
                 seed: int | None = None, apply_chat_template: bool = False,
                 assistant_prefix: str = "", adapters: str | Iterable[str] = "") -> inference_pb2.GenerateResponse:
        """``adapters``: the LoRA adapter to generate with, one for every prompt or one per prompt ("": the base)."""
        prompts = list(prompts)
        names = [adapters] * len(prompts) if isinstance(adapters, str) else list(adapters)
        if len(names) != len(prompts):
            raise ValueError(f"adapters: {len(names)} names for {len(prompts)} prompts")
        msgs = [inference_pb2.Prompt(text=p, apply_chat_template=apply_chat_template, assistant_prefix=assistant_prefix,
                                     adapter=a)
                if isinstance(p, str)
                else inference_pb2.Prompt(token_ids=inference_pb2.TokenIds(ids=p), adapter=a)
                for p, a in zip(prompts, names)]
        sampling = inference_pb2.SamplingParams(n=n, temperature=temperature, max_tokens=max_tokens, top_p=top_p,
                                                top_k=top_k, stop=list(stop), seed=seed)
        return self.stub.Generate(inference_pb2.GenerateRequest(prompts=msgs, sampling=sampling),
                                  timeout=self.timeout)

    def update_weights(self, chunks: Iterable[inference_pb2.UpdateWeightsRequest | bytes]
                       ) -> inference_pb2.UpdateWeightsResponse:
        """Stream one new policy version as UpdateWeightsRequest chunks (the first carries ``new_version``),
        each a message or its wire bytes.

        The server package builds them from tensors: ``temper.inference.weights.chunks_from_tensors``
        (``encoded=True``: wire bytes, one copy of the tensors fewer than messages).
        """
        return self._update_raw(iter(chunks), timeout=self.timeout)

    def policy_version(self) -> int:
        return self.info().policy_version

    def info(self) -> inference_pb2.GetPolicyVersionResponse:
        """The serving policy version, its lineage, the model and its vocabulary size."""
        return self.stub.GetPolicyVersion(inference_pb2.GetPolicyVersionRequest(), timeout=self.timeout)


class RewardClient(_Client):
    stub_class = reward_pb2_grpc.RewardServiceStub

    def score(self, group: common_pb2.RolloutGroup) -> common_pb2.RolloutGroup:
        return self.stub.Score(reward_pb2.ScoreRequest(group=group), timeout=self.timeout).group

    def list_domains(self) -> reward_pb2.ListDomainsResponse:
        """The domains scored, each with its component weights; the verifier components; which models are loaded."""
        return self.stub.ListDomains(reward_pb2.ListDomainsRequest(), timeout=self.timeout)

    def load_model(self, model_dir: str, slot: str = "prm", timeout: float | None = None
                   ) -> reward_pb2.LoadModelResponse:
        """Load a reward model folder (on the service's host) into ``slot`` ("rm" | "prm") without a restart:
        score calls switch to it once it has loaded; if it does not load, the old model keeps serving."""
        slots = {"rm": reward_pb2.MODEL_SLOT_RM, "prm": reward_pb2.MODEL_SLOT_PRM}
        if slot not in slots:
            raise ValueError(f"slot: one of {sorted(slots)}, got {slot!r}")
        return self.stub.LoadModel(reward_pb2.LoadModelRequest(slot=slots[slot], model_dir=str(model_dir)),
                                   timeout=timeout or max(self.timeout, 300.0))


def _origin(origin: sandbox_pb2.ExecutionOrigin | dict | None) -> sandbox_pb2.ExecutionOrigin | None:
    return sandbox_pb2.ExecutionOrigin(**origin) if isinstance(origin, dict) else origin


class SandboxClient(_Client):
    """Run untrusted code in the sandbox service (gVisor). Limits left at 0 take the service's defaults."""

    stub_class = sandbox_pb2_grpc.SandboxServiceStub

    @staticmethod
    def request(source: str | bytes | None = None, language: str = "python3", *,
                files: dict[str, str | bytes] | None = None, command: Iterable[str] = (), stdin: str | bytes = b"",
                wall_seconds: float = 0, cpu_seconds: float = 0, memory_mb: int = 0, max_processes: int = 0,
                max_output_bytes: int = 0, origin: sandbox_pb2.ExecutionOrigin | dict | None = None
                ) -> sandbox_pb2.ExecuteRequest:
        """An ExecuteRequest: ``source`` is the language's main file; ``files`` adds others by path; ``origin``
        (an ExecutionOrigin or a dict of its fields: job_id, group_id, task_id, trajectory_ids) goes onto the
        execution trace, so the monitor joins what the program did to those trajectories."""
        def raw(v):
            return v.encode() if isinstance(v, str) else v

        sources = [sandbox_pb2.SourceFile(path="", content=raw(source))] if source is not None else []
        sources += [sandbox_pb2.SourceFile(path=p, content=raw(c)) for p, c in (files or {}).items()]
        return sandbox_pb2.ExecuteRequest(
            language=language, files=sources, command=list(command), stdin=raw(stdin),
            limits=sandbox_pb2.Limits(wall_seconds=wall_seconds, cpu_seconds=cpu_seconds, memory_mb=memory_mb,
                                      max_processes=max_processes, max_output_bytes=max_output_bytes),
            origin=_origin(origin))

    def execute(self, source: str | bytes | None = None, language: str = "python3", **kw) -> sandbox_pb2.ExecuteResponse:
        """Run once; ``kw`` as for ``request``. The verdict's short name: ``verdict_name(resp.verdict)``."""
        req = self.request(source, language, **kw)
        return self.stub.Execute(req, timeout=self.timeout + req.limits.wall_seconds)

    def run_tests(self, source: str | bytes | None, tests: Iterable[sandbox_pb2.TestCase | dict | str],
                  language: str = "python3", stop_on_first_failure: bool = False, exact_output: bool = False,
                  **kw) -> sandbox_pb2.RunTestsResponse:
        """Run against ``tests``: TestCase messages, dicts of its fields, or strings (assertion scripts)."""
        req = self.tests_request(source, tests, language, stop_on_first_failure, exact_output, **kw)
        return self.stub.RunTests(req, timeout=self.timeout + len(req.tests) * (req.program.limits.wall_seconds or 10))

    @classmethod
    def tests_request(cls, source: str | bytes | None, tests: Iterable[sandbox_pb2.TestCase | dict | str],
                      language: str = "python3", stop_on_first_failure: bool = False, exact_output: bool = False,
                      **kw) -> sandbox_pb2.RunTestsRequest:
        """A RunTestsRequest; arguments as for ``run_tests``."""
        def case(t):
            if isinstance(t, str):
                return sandbox_pb2.TestCase(assertion_script=t)
            if isinstance(t, dict):
                t = {k: v.encode() if isinstance(v, str) and k != "assertion_script" else v for k, v in t.items()}
                return sandbox_pb2.TestCase(**t)
            return t

        origin = _origin(kw.pop("origin", None))  # the RunTests request's, not its program's
        return sandbox_pb2.RunTestsRequest(
            program=cls.request(source, language, **kw), tests=[case(t) for t in tests], origin=origin,
            stop_on_first_failure=stop_on_first_failure,
            output_match=sandbox_pb2.OUTPUT_MATCH_EXACT if exact_output else sandbox_pb2.OUTPUT_MATCH_UNSPECIFIED)

    def run_tests_batch(self, sources: Iterable[str | bytes], tests: Iterable[sandbox_pb2.TestCase | dict | str],
                        language: str = "python3", **kw) -> sandbox_pb2.RunTestsBatchResponse:
        """Several programs against the same ``tests`` in one call (a GRPO group); ``kw`` as for ``run_tests``.

        Whether they share one sandbox is the service's execution_mode (the response says which).
        """
        tests = list(tests)
        reqs = [self.tests_request(s, tests, language, **kw) for s in sources]
        per_test = reqs[0].program.limits.wall_seconds if reqs else 0
        return self.stub.RunTestsBatch(sandbox_pb2.RunTestsBatchRequest(programs=reqs),
                                       timeout=self.timeout + len(reqs) * len(tests) * (per_test or 10))


INSERT_BATCH_BYTES = 1 << 20  # well under the servers' message limit, big enough to amortise a message's cost


def _insert_requests(groups: list[common_pb2.RolloutGroup], table: str, priorities: Iterable[float | None] | None,
                     batch_bytes: int) -> Iterable[bytes]:
    """Serialized InsertRequests of about ``batch_bytes``. Each group is serialized once and framed
    as an entry of ``groups`` (field 4) by hand: building an InsertRequest message would deep-copy
    every group first, which costs more than serializing it."""
    prios = list(priorities) if priorities is not None else [None] * len(groups)
    if len(prios) != len(groups):
        raise ValueError(f"priorities: {len(prios)} for {len(groups)} groups")
    given = [p is not None for p in prios]
    if any(given) and not all(given):  # a batch carries priorities for all its groups or for none
        for g, p in zip(groups, prios):
            yield replay_pb2.InsertRequest(table=table, group=g, priority=p).SerializeToString()
        return
    head = replay_pb2.InsertRequest(table=table).SerializeToString()
    parts, first, size = [head], 0, 0
    for k, g in enumerate(groups):
        data = g.SerializeToString()
        parts += (b"\x22", varint(len(data)), data)  # field 4 (groups), length-delimited
        size += len(data)
        if size >= batch_bytes or k == len(groups) - 1:
            if all(given):
                parts.append(replay_pb2.InsertRequest(priorities=prios[first:k + 1]).SerializeToString())
            yield b"".join(parts)
            parts, first, size = [head], k + 1, 0


class ReplayClient(_Client):
    stub_class = replay_pb2_grpc.ReplayServiceStub

    def __init__(self, address: str, timeout: float = 60.0, channel: grpc.Channel | None = None,
                 token: str | None = None, tls_dir: str | None = None):
        super().__init__(address, timeout, channel, token, tls_dir)
        # Insert with requests serialized by _insert_requests (bytes on the wire as they are)
        self._insert_raw = self._channel.stream_unary("/temper.v1.ReplayService/Insert",
                                                      request_serializer=bytes,
                                                      response_deserializer=replay_pb2.InsertResponse.FromString)
        # SampleStream's batches read as SampleResponse: the same fields and numbers
        self._sample_stream = self._channel.unary_stream(
            "/temper.v1.ReplayService/SampleStream", request_serializer=replay_pb2.SampleStreamRequest.SerializeToString,
            response_deserializer=replay_pb2.SampleResponse.FromString)

    def insert(self, groups: Iterable[common_pb2.RolloutGroup], table: str = "default",
               priorities: Iterable[float | None] | None = None,
               batch_bytes: int = INSERT_BATCH_BYTES) -> replay_pb2.InsertResponse:
        """Stream ``groups`` into ``table``; answered once all are durable (or the rate limiter's wait ran out).

        Groups travel in batch messages of about ``batch_bytes`` (far cheaper per group than a
        message each); a group with a priority of its own travels alone (``priority`` is per message).
        """
        return self._insert_raw(_insert_requests(list(groups), table, priorities, batch_bytes), timeout=self.timeout)

    def insert_future(self, groups: Iterable[common_pb2.RolloutGroup], table: str = "default",
                      priorities: Iterable[float | None] | None = None,
                      batch_bytes: int = INSERT_BATCH_BYTES) -> grpc.Future:
        """``insert`` without waiting: ``.result()`` is its InsertResponse (or raises its error).
        A writer keeps a few of these in flight so that its next groups travel while the server
        commits the previous ones (as Reverb's writers do with ``flush(block_until_num_items)``)."""
        return self._insert_raw.future(_insert_requests(list(groups), table, priorities, batch_bytes),
                                       timeout=self.timeout)

    def sample_batch(self, batch_size: int, table: str = "default", timeout_ms: int = 10_000,
                     current_policy_version: int | None = None,
                     importance_sampling_exponent: float | None = None, lease_ms: int = 0) -> replay_pb2.SampleResponse:
        """Groups with their SampleInfo (probability, importance weight, times sampled, ...). ``lease_ms`` > 0:
        the draws are held for this caller until ``ack_sample(response.lease_id)`` (or given back when the
        lease runs out), so a caller that dies before it used them loses nothing."""
        req = replay_pb2.SampleRequest(table=table, batch_size=batch_size, timeout_ms=timeout_ms,
                                       current_policy_version=current_policy_version,
                                       importance_sampling_exponent=importance_sampling_exponent, lease_ms=lease_ms)
        return self.stub.Sample(req, timeout=timeout_ms / 1000 + self.timeout)

    def ack_sample(self, lease_id: str, action: str = "ack", extend_ms: int = 0) -> replay_pb2.AckSampleResponse:
        """Settle a leased sample: "ack" (its draws final), "requeue" (its groups back now) or "extend"
        (held ``extend_ms`` more). NOT_FOUND: the lease ran out and its groups went back."""
        req = replay_pb2.AckSampleRequest
        actions = {"ack": req.ACTION_UNSPECIFIED, "requeue": req.ACTION_REQUEUE, "extend": req.ACTION_EXTEND}
        if action not in actions:
            raise ValueError(f"action must be one of {sorted(actions)}, got {action!r}")
        return self.stub.AckSample(replay_pb2.AckSampleRequest(lease_id=lease_id, action=actions[action],
                                                               extend_ms=extend_ms), timeout=self.timeout)

    def sample_batches(self, batch_size: int, table: str = "default", timeout_ms: int = 10_000,
                       count: int | None = None, lease_ms: int = 0, current_policy_version: int | None = None,
                       importance_sampling_exponent: float | None = None) -> Iterator[replay_pb2.SampleResponse]:
        """Batches as ``sample_batch`` gives them, ``count`` of them (None: until this iterator is closed),
        over one SampleStream call: the server draws the next batches while this one is used (as many as the
        connection buffers), and no batch pays a call's cost. For readers that need not see their own priority
        updates in the very next batch. A table whose draws use groups up needs ``lease_ms`` > 0 (ack each
        batch's ``lease_id``): batches drawn ahead when the iterator is closed then go back to the table."""
        req = replay_pb2.SampleStreamRequest(
            table=table, batch_size=batch_size, timeout_ms=timeout_ms, count=count or 0, lease_ms=lease_ms,
            current_policy_version=current_policy_version, importance_sampling_exponent=importance_sampling_exponent)
        call = self._sample_stream(req, timeout=None if count is None else count * (timeout_ms / 1000 + self.timeout))
        try:
            yield from call
        finally:
            call.cancel()

    def sample(self, batch_size: int, table: str = "default", timeout_ms: int = 10_000,
               current_policy_version: int | None = None) -> list[common_pb2.RolloutGroup]:
        """The groups only (their SampleInfo dropped): use ``sample_batch`` for prioritized tables."""
        return list(self.sample_batch(batch_size, table, timeout_ms, current_policy_version).groups)

    def update_priorities(self, priorities: dict[str, float], table: str = "default"
                          ) -> replay_pb2.UpdatePrioritiesResponse:
        return self.stub.UpdatePriorities(replay_pb2.UpdatePrioritiesRequest(table=table, priorities=priorities),
                                          timeout=self.timeout)

    def stats(self, table: str = "default") -> replay_pb2.StatsResponse:
        return self.stub.Stats(replay_pb2.StatsRequest(table=table), timeout=self.timeout)

    def checkpoint(self) -> replay_pb2.ReplayServiceCheckpointResponse:
        return self.stub.Checkpoint(replay_pb2.ReplayServiceCheckpointRequest(), timeout=self.timeout)

    def restore(self, checkpoint_id: str) -> replay_pb2.ReplayServiceRestoreResponse:
        return self.stub.Restore(replay_pb2.ReplayServiceRestoreRequest(checkpoint_id=checkpoint_id),
                                 timeout=self.timeout)


class LearnerClient(_Client):
    stub_class = learner_pb2_grpc.LearnerServiceStub

    def status(self) -> learner_pb2.LearnerStatus:
        return self.stub.Status(learner_pb2.StatusRequest(), timeout=self.timeout).status

    def checkpoint(self, path: str = "") -> learner_pb2.CheckpointResponse:
        """Checkpoint between steps (``path`` relative to the learner's checkpoint dir; "" = step-<N>)."""
        return self.stub.Checkpoint(learner_pb2.CheckpointRequest(path=path), timeout=self.timeout)

    def export_policy(self, path: str, dtype: str = "", timeout: float | None = None) -> learner_pb2.ExportPolicyResponse:
        """Write the current policy as an HF model folder at ``path`` (absolute, new or empty)."""
        return self.stub.ExportPolicy(learner_pb2.ExportPolicyRequest(path=path, dtype=dtype),
                                      timeout=timeout or self.timeout)

    def pause(self) -> learner_pb2.LearnerStatus:
        """Stop updates; returns once a step in flight has finished."""
        return self.stub.Pause(learner_pb2.PauseRequest(), timeout=self.timeout).status

    def resume(self) -> learner_pb2.LearnerStatus:
        return self.stub.Resume(learner_pb2.ResumeRequest(), timeout=self.timeout).status


class SchedulerClient(_Client):
    stub_class = scheduler_pb2_grpc.SchedulerServiceStub

    def start_job(self, spec: scheduler_pb2.JobSpec) -> scheduler_pb2.JobStatus:
        return self.stub.StartJob(scheduler_pb2.StartJobRequest(spec=spec), timeout=self.timeout).job

    def job(self, job_id: str) -> scheduler_pb2.JobStatus:
        return self.stub.GetJob(scheduler_pb2.GetJobRequest(job_id=job_id), timeout=self.timeout).job

    def stop_job(self, job_id: str) -> scheduler_pb2.JobStatus:
        return self.stub.StopJob(scheduler_pb2.StopJobRequest(job_id=job_id), timeout=self.timeout).job

    def pause_job(self, job_id: str, reason: str = "") -> scheduler_pb2.JobStatus:
        return self.stub.PauseJob(scheduler_pb2.PauseJobRequest(job_id=job_id, reason=reason), timeout=self.timeout).job

    def resume_job(self, job_id: str) -> scheduler_pb2.JobStatus:
        return self.stub.ResumeJob(scheduler_pb2.ResumeJobRequest(job_id=job_id), timeout=self.timeout).job

    def list_jobs(self) -> list[scheduler_pb2.JobStatus]:
        """Every job of this scheduler process, in the order started (the running one, if any, last)."""
        return list(self.stub.ListJobs(scheduler_pb2.ListJobsRequest(), timeout=self.timeout).jobs)


class MonitorClient(_Client):
    stub_class = monitor_pb2_grpc.MonitorServiceStub

    def reward_curve(self, domain: str = "") -> list[monitor_pb2.CurvePoint]:
        return list(self.stub.RewardCurve(monitor_pb2.RewardCurveRequest(domain=domain), timeout=self.timeout).points)

    def list_alerts(self, job_id: str = "", domain: str = "", detector: str = "", min_severity: int = 0,
                    since_unix_ms: int = 0, limit: int = 0) -> list[monitor_pb2.Alert]:
        return list(self.stub.ListAlerts(monitor_pb2.ListAlertsRequest(
            job_id=job_id, domain=domain, detector=detector, min_severity=min_severity, since_unix_ms=since_unix_ms,
            limit=limit), timeout=self.timeout).alerts)

    def list_steps(self, job_id: str, domain: str = "", last: int = 0) -> list[monitor_pb2.StepSeries]:
        """The job's per-step series (per domain from `scored`, ``"*"`` from the learner's metrics), newest
        ``last`` steps each (0: 100), oldest first."""
        return list(self.stub.ListSteps(monitor_pb2.ListStepsRequest(job_id=job_id, domain=domain, last=last),
                                        timeout=self.timeout).series)


__all__ = ["InferenceClient", "RewardClient", "SandboxClient", "ReplayClient", "LearnerClient", "SchedulerClient",
           "MonitorClient", "grpc", "verdict_name"]
