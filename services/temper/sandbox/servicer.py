"""gRPC SandboxService: translates protobuf <-> the core, and builds the execution traces."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from prometheus_client import Counter, Histogram

from temper.runtime.errors import reject_unknown_fields, require
from temper.sandbox.core import (
    BatchItem,
    Executor,
    Limits,
    OutputMatch,
    Program,
    Result,
    SourceFile,
    TestCase,
    TestsResult,
)
from temper.v1 import sandbox_pb2, sandbox_pb2_grpc

EXECUTIONS = Counter("temper_sandbox_calls_total", "Sandbox calls by method and verdict", ["method", "verdict"])
SECONDS = Histogram("temper_sandbox_call_seconds", "Sandbox call latency, queueing included", ["method"],
                    buckets=(0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60, 120))
MAX_TRACE_BYTES = 900 << 10  # under Kafka's default 1 MiB message limit
MAX_ORIGIN_ID_CHARS = 256
MAX_ORIGIN_TRAJECTORIES = 1024


def check_origin(origin: sandbox_pb2.ExecutionOrigin, field: str) -> None:
    """A request's origin (copied onto its trace as is) is refused when an id is oversized."""
    for name in ("job_id", "group_id", "task_id"):
        value = getattr(origin, name)
        require(len(value) <= MAX_ORIGIN_ID_CHARS, f"{field}.{name}",
                f"{len(value)} characters > {MAX_ORIGIN_ID_CHARS}")
    ids = origin.trajectory_ids
    require(len(ids) <= MAX_ORIGIN_TRAJECTORIES, f"{field}.trajectory_ids",
            f"{len(ids)} ids > {MAX_ORIGIN_TRAJECTORIES}")
    for i, t in enumerate(ids):
        require(0 < len(t) <= MAX_ORIGIN_ID_CHARS, f"{field}.trajectory_ids[{i}]",
                f"must be 1 to {MAX_ORIGIN_ID_CHARS} characters, got {len(t)}")


def check_tests_origin(request: sandbox_pb2.RunTestsRequest, prefix: str) -> None:
    """A RunTests request's origin is its own; its program (an ExecuteRequest) must not carry another."""
    check_origin(request.origin, f"{prefix}origin")
    require(not request.program.HasField("origin"), f"{prefix}program.origin",
            "must be unset: a RunTests call's origin is the request's `origin`")


def program_from_proto(req: sandbox_pb2.ExecuteRequest) -> Program:
    lim = req.limits
    return Program(
        language=req.language,
        files=[SourceFile(f.path, f.content, f.executable) for f in req.files],
        command=list(req.command), stdin=req.stdin,
        limits=Limits(wall_seconds=lim.wall_seconds, cpu_seconds=lim.cpu_seconds, memory_mb=lim.memory_mb,
                      max_processes=lim.max_processes, max_output_bytes=lim.max_output_bytes))


def verdict_to_proto(name: str) -> int:
    """The core's verdict name (``OK``) -> the wire enum value (``VERDICT_OK``)."""
    return sandbox_pb2.Verdict.Value(f"VERDICT_{name}")


def batch_item_from_proto(req: sandbox_pb2.RunTestsRequest) -> BatchItem:
    tests = [TestCase(t.stdin, t.expected_stdout, t.assertion_script) for t in req.tests]
    match = OutputMatch.EXACT if req.output_match == sandbox_pb2.OUTPUT_MATCH_EXACT else OutputMatch.TRAILING_WHITESPACE
    return BatchItem(program_from_proto(req.program), tests, req.stop_on_first_failure, match)


def tests_verdict(t: TestsResult) -> str:
    """One verdict for a RunTests outcome: the compile verdict, else the first failing test's, else OK."""
    if t.compile_verdict.name != "OK":
        return t.compile_verdict.name
    return next((r.verdict.name for r in t.results if r.verdict.name != "OK"), "OK")


def result_to_proto(r: Result) -> sandbox_pb2.ExecuteResponse:
    return sandbox_pb2.ExecuteResponse(
        verdict=verdict_to_proto(r.verdict.name), exit_code=r.exit_code, signal=r.signal, stdout=r.stdout,
        stderr=r.stderr, output_truncated=r.output_truncated, wall_seconds=r.wall_seconds, cpu_seconds=r.cpu_seconds,
        peak_memory_bytes=r.peak_memory_bytes, message=r.message)


def tests_to_proto(t: TestsResult) -> sandbox_pb2.RunTestsResponse:
    resp = sandbox_pb2.RunTestsResponse(results=[result_to_proto(r) for r in t.results], passed=t.passed,
                                        compile_verdict=verdict_to_proto(t.compile_verdict.name))
    if t.compile is not None:
        resp.compile.CopyFrom(result_to_proto(t.compile))
    return resp


def truncated(message, limit: int):
    """A copy of ``message`` with every bytes/string field (recursively) cut to ``limit``."""
    out = type(message)()
    out.CopyFrom(message)
    stack = [out]
    while stack:
        m = stack.pop()
        for desc, value in m.ListFields():
            if desc.message_type is not None:
                stack.extend(value if desc.is_repeated else [value])
            elif desc.type in (desc.TYPE_BYTES, desc.TYPE_STRING) and not desc.is_repeated and len(value) > limit:
                setattr(m, desc.name, value[:limit])
    return out


class SandboxServicer(sandbox_pb2_grpc.SandboxServiceServicer):
    def __init__(self, executor: Executor, publish: Callable[[sandbox_pb2.ExecutionTrace], None] | None = None,
                 trace_max_bytes: int = 16 << 10):
        self.executor = executor
        self.publish = publish
        self.trace_max_bytes = trace_max_bytes

    def Execute(self, request, context):
        reject_unknown_fields(request, "request")
        check_origin(request.origin, "origin")
        started, t0 = time.time(), time.monotonic()
        result = self.executor.execute(program_from_proto(request))
        response = result_to_proto(result)
        self._finish("Execute", result.verdict.name, t0, started, result.queue_seconds,
                     execute_request=request, execute_response=response, origin=request.origin)
        return response

    def RunTests(self, request, context):
        reject_unknown_fields(request, "request")
        check_tests_origin(request, "")
        started, t0 = time.time(), time.monotonic()
        item = batch_item_from_proto(request)
        out = self.executor.run_tests(item.program, item.tests, item.stop_on_first_failure, item.output_match)
        response = tests_to_proto(out)
        self._finish("RunTests", tests_verdict(out), t0, started, out.queue_seconds,
                     run_tests_request=request, run_tests_response=response, origin=request.origin)
        return response

    def RunTestsBatch(self, request, context):
        reject_unknown_fields(request, "request")
        for i, program in enumerate(request.programs):
            check_tests_origin(program, f"programs[{i}].")
        started, t0 = time.time(), time.monotonic()
        outs = self.executor.run_batch([batch_item_from_proto(r) for r in request.programs])
        response = sandbox_pb2.RunTestsBatchResponse(results=[tests_to_proto(o) for o in outs],
                                                     execution_mode=self.executor.mode)
        verdicts = [tests_verdict(o) for o in outs]
        self._count("RunTestsBatch", next((v for v in verdicts if v != "OK"), "OK"), t0)
        for req, resp, out, verdict in zip(request.programs, response.results, outs, verdicts):
            self._publish("RunTests", verdict, time.monotonic() - t0, started, out.queue_seconds,
                          run_tests_request=req, run_tests_response=resp, origin=req.origin)
        return response

    def _count(self, method: str, verdict: str, t0: float) -> float:
        seconds = time.monotonic() - t0
        EXECUTIONS.labels(method, verdict).inc()
        SECONDS.labels(method).observe(seconds)
        return seconds

    def _finish(self, method: str, verdict: str, t0: float, started: float, queued: float, **call) -> None:
        self._publish(method, verdict, self._count(method, verdict, t0), started, queued, **call)

    def _publish(self, method: str, verdict: str, seconds: float, started: float, queued: float, **call) -> None:
        if self.publish is None:
            return
        limit = self.trace_max_bytes
        while True:  # fields cut shorter until the whole trace fits one Kafka message
            trace = sandbox_pb2.ExecutionTrace(
                execution_id=uuid.uuid4().hex, method=method, started_unix_ms=int(started * 1000),
                queue_seconds=queued, total_seconds=seconds, verdict=verdict_to_proto(verdict))
            for name, message in call.items():
                # the origin is the join key of the trace: never cut (its ids are bounded by check_origin)
                if name == "origin" and not message.ListFields():
                    continue
                getattr(trace, name).CopyFrom(message if name == "origin" else truncated(message, limit))
            if trace.ByteSize() <= MAX_TRACE_BYTES or limit <= 64:
                break
            limit //= 4
        self.publish(trace)
