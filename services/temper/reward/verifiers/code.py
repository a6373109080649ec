"""Code rewards: the completion's program runs against the task's tests in the sandbox service.

The task's ``reference_answer`` is its test suite, as JSON::

    {"language": "python3",                                   # optional; CodeOptions.default_language
     "tests": [{"stdin": "1 2\\n", "expected_stdout": "3\\n"},  # stdin -> expected stdout, or
               {"assertion": "assert add(1, 2) == 3"}],        # a Python assertion script
     "output_match": "trailing_whitespace",                   # or "exact"
     "wall_seconds": 2, "memory_mb": 256}                     # optional per-test limits

Each sandbox run carries its ``ExecutionOrigin`` (job, group, task and the trajectories whose
completion is that program): the sandbox copies it onto the execution trace it publishes, which
is how ``temper.reward.dataset`` and the monitor join a trace to its task and trajectories.

With ``CodeOptions.batch_size`` N > 0 the distinct programs of a group go to the sandbox in
RunTestsBatch calls of up to N programs (one gVisor sandbox per call when the sandbox runs in
execution_mode "batch"); a program the sandbox failed (SANDBOX_ERROR) is retried alone in the
next call.

Components: ``code.pass_fraction`` (tests passed / tests) and ``code.all_pass`` (1 iff every test
passed). A program that fails to compile, times out or crashes fails those tests (the program's
fault). The sandbox being unreachable or failing itself (UNAVAILABLE, DEADLINE_EXCEEDED,
RESOURCE_EXHAUSTED, a SANDBOX_ERROR verdict) is retried with backoff; if it persists, the
verifier raises ``SandboxUnavailable`` (``CodeOptions.on_unavailable = "retry"``) or returns
ERROR checks ("mark"): never a reward of 0 for a program that did not get to run.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from temper.reward.verifiers import Check, Verifier, register, short
from temper.reward.verifiers import extract
from temper.runtime.errors import InvalidArgument, TemperError, require
from temper.runtime.logs import get_logger
from temper.client.sdk import verdict_name
from temper.v1 import sandbox_pb2

_log = get_logger(component="reward.code")
LANGUAGE_FENCES = {"python3": ("python", "python3", "py"), "c": ("c",), "cpp": ("cpp", "c++", "cc"),
                   "bash": ("bash", "sh", "shell")}
_RETRY_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
                grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.ABORTED}


class SandboxUnavailable(TemperError):
    """The sandbox could not run a program after every retry: not the program's fault."""

    code = grpc.StatusCode.UNAVAILABLE


# (request, timeout seconds) -> response; raises grpc.RpcError like a stub does. A
# RunTestsBatchRequest gets a RunTestsBatchResponse.
RunTests = Callable[[sandbox_pb2.RunTestsRequest | sandbox_pb2.RunTestsBatchRequest, float],
                    sandbox_pb2.RunTestsResponse | sandbox_pb2.RunTestsBatchResponse]


def sandbox_runner(address: str) -> RunTests:
    """RunTests (or RunTestsBatch, by the request's type) through the SDK's SandboxClient at ``address``."""
    from temper.client.sdk import SandboxClient
    from temper.runtime.rpc import client

    sandbox = client(SandboxClient, address)

    def call(request, timeout):
        if isinstance(request, sandbox_pb2.RunTestsBatchRequest):
            return sandbox.stub.RunTestsBatch(request, timeout=timeout)
        return sandbox.stub.RunTests(request, timeout=timeout)

    return call


@dataclass(frozen=True)
class TestSuite:
    language: str
    tests: tuple[sandbox_pb2.TestCase, ...]
    output_match: int
    limits: sandbox_pb2.Limits


def parse_suite(text: str, field: str, default_language: str, max_tests: int, wall_seconds: float) -> TestSuite:
    """The test suite a code task carries in its reference_answer (JSON, see the module doc)."""
    try:
        spec = json.loads(text)
    except ValueError as e:
        raise InvalidArgument(f"not a JSON test suite: {e}", field=field) from None
    require(isinstance(spec, dict), field, "a JSON object with a 'tests' list is required")
    unknown = sorted(set(spec) - {"language", "tests", "output_match", "wall_seconds", "memory_mb"})
    require(not unknown, field, f"unknown key(s) {unknown}")
    language = spec.get("language", default_language)
    require(isinstance(language, str) and bool(language), f"{field}.language", "a non-empty string")
    tests = spec.get("tests")
    require(isinstance(tests, list) and len(tests) > 0, f"{field}.tests", "a non-empty list")
    require(len(tests) <= max_tests, f"{field}.tests", f"{len(tests)} tests > {max_tests}")
    cases = []
    for i, t in enumerate(tests):
        f = f"{field}.tests[{i}]"
        require(isinstance(t, dict), f, "an object")
        bad = sorted(set(t) - {"stdin", "expected_stdout", "assertion"})
        require(not bad, f, f"unknown key(s) {bad}")
        require(all(isinstance(v, str) for v in t.values()), f, "values must be strings")
        if "assertion" in t:
            require("expected_stdout" not in t, f, "either assertion or expected_stdout, not both")
            require(bool(t["assertion"].strip()), f"{f}.assertion", "empty")
            cases.append(sandbox_pb2.TestCase(stdin=t.get("stdin", "").encode(), assertion_script=t["assertion"]))
        else:
            require("expected_stdout" in t, f, "needs expected_stdout or assertion")
            cases.append(sandbox_pb2.TestCase(stdin=t.get("stdin", "").encode(),
                                              expected_stdout=t["expected_stdout"].encode()))
    match = spec.get("output_match", "trailing_whitespace")
    require(match in ("trailing_whitespace", "exact"), f"{field}.output_match", "'trailing_whitespace' or 'exact'")
    limits = {}
    for key in ("wall_seconds", "memory_mb"):
        if key in spec:
            require(isinstance(spec[key], int | float) and spec[key] > 0, f"{field}.{key}", "a positive number")
            limits[key] = spec[key]
    return TestSuite(language, tuple(cases),
                     sandbox_pb2.OUTPUT_MATCH_EXACT if match == "exact" else sandbox_pb2.OUTPUT_MATCH_TRAILING_WHITESPACE,
                     sandbox_pb2.Limits(wall_seconds=limits.get("wall_seconds", wall_seconds),
                                        memory_mb=int(limits.get("memory_mb", 0))))


@dataclass(frozen=True)
class GroupSuite:
    """A group's test suite and whose completions are checked: one trajectory id per completion."""

    suite: TestSuite
    job_id: str = ""
    group_id: str = ""
    task_id: str = ""
    trajectory_ids: tuple[str, ...] = ()


def _verdict(v: int) -> str:
    return verdict_name(v)


@register
class CodeVerifier(Verifier):
    name = "code"
    components = ("code.pass_fraction", "code.all_pass")

    def __init__(self, settings, sandbox: RunTests | None = None, **_):
        self.options = settings.code
        self._sandbox = sandbox
        self._executor = ThreadPoolExecutor(self.options.concurrency, thread_name_prefix="reward-code")

    def prepare(self, task, field):
        o = self.options
        return parse_suite(task.reference_answer, f"{field}.reference_answer", o.default_language, o.max_tests,
                           o.wall_seconds)

    def prepare_group(self, group, field):
        return GroupSuite(self.prepare(group.task, f"{field}.task"), group.job_id, group.group_id,
                          group.task.task_id, tuple(t.trajectory_id for t in group.trajectories))

    def verify(self, completions: Sequence[str], prepared: TestSuite | GroupSuite) -> list[list[Check]]:
        group = prepared if isinstance(prepared, GroupSuite) else GroupSuite(prepared)
        suite = group.suite
        if self._sandbox is None:
            raise SandboxUnavailable("no sandbox configured (set [reward] sandbox_address)")
        fences = LANGUAGE_FENCES.get(suite.language, (suite.language,))
        programs = []
        for c in completions:
            code = extract.code_block(c, fences)
            if code is None and not self.options.require_code_block:
                code = c
            programs.append(code)
        # identical programs (common in a GRPO group) run once
        distinct = {hashlib.sha256(p.encode()).hexdigest(): p for p in programs if p is not None and p.strip()}
        # the origin of each distinct program: the trajectories whose completion it is
        owners: dict[str, list[str]] = {h: [] for h in distinct}
        for i, p in enumerate(programs):
            if p is not None and p.strip() and i < len(group.trajectory_ids) and group.trajectory_ids[i]:
                owners[hashlib.sha256(p.encode()).hexdigest()].append(group.trajectory_ids[i])
        origin = {h: sandbox_pb2.ExecutionOrigin(job_id=group.job_id, group_id=group.group_id, task_id=group.task_id,
                                                 trajectory_ids=ids) for h, ids in owners.items()}
        if self.options.batch_size:
            keys = list(distinct)
            chunks = [keys[i:i + self.options.batch_size] for i in range(0, len(keys), self.options.batch_size)]
            batches = [self._executor.submit(self._run_batch, [distinct[h] for h in chunk], suite,
                                             [origin[h] for h in chunk]) for chunk in chunks]
            outcomes = {h: checks for chunk, f in zip(chunks, batches) for h, checks in zip(chunk, f.result())}
        else:
            futures = {h: self._executor.submit(self._run, p, suite, origin[h]) for h, p in distinct.items()}
            outcomes = {h: f.result() for h, f in futures.items()}  # SandboxUnavailable propagates
        checks = []
        for p in programs:
            if p is None or not p.strip():
                why = "no code block" if p is None else "empty program"
                checks.append([Check(c, 0.0, why) for c in self.components])
            else:
                checks.append(outcomes[hashlib.sha256(p.encode()).hexdigest()])
        return checks

    def _run(self, program: str, suite: TestSuite, origin: sandbox_pb2.ExecutionOrigin) -> list[Check]:
        return self._run_batch([program], suite, [origin], batched=False)[0]

    def _run_batch(self, programs: list[str], suite: TestSuite, origins: list[sandbox_pb2.ExecutionOrigin],
                   batched: bool = True) -> list[list[Check]]:
        """Checks per program: one RunTestsBatch call for all (``batched``) or one RunTests call for
        the single program; what failed for the sandbox's reasons is tried again, alone."""
        requests = [self._request(p, suite, o) for p, o in zip(programs, origins)]
        out: list[list[Check] | None] = [None] * len(programs)
        attempts = self.options.retries + 1
        backoff = self.options.retry_backoff_seconds
        why = ""
        for attempt in range(attempts):
            pending = [i for i, c in enumerate(out) if c is None]
            if not pending:
                break
            if attempt:
                time.sleep(backoff * 2 ** (attempt - 1))
            try:
                if batched:
                    batch = sandbox_pb2.RunTestsBatchRequest(programs=[requests[i] for i in pending])
                    responses = list(self._sandbox(batch, self.options.timeout_seconds * len(pending)).results)
                else:
                    responses = [self._sandbox(requests[pending[0]], self.options.timeout_seconds)]
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    # the sandbox refused the task's suite (e.g. limits above its maxima): a request error
                    raise InvalidArgument(f"sandbox refused the test suite: {e.details()}",
                                          field="group.task.reference_answer") from None
                if e.code() not in _RETRY_CODES:
                    raise
                why = f"{e.code().name}: {e.details()}"
                _log.warning("sandbox call failed; retrying", attempt=attempt + 1, attempts=attempts, error=why)
                continue
            for i, response in zip(pending, responses):
                sandbox_errors = [r.message or "SANDBOX_ERROR" for r in response.results
                                  if r.verdict == sandbox_pb2.VERDICT_SANDBOX_ERROR]
                if response.compile_verdict == sandbox_pb2.VERDICT_SANDBOX_ERROR:
                    sandbox_errors.append(response.compile.message or "SANDBOX_ERROR while compiling")
                if sandbox_errors:
                    why = f"SANDBOX_ERROR: {sandbox_errors[0]}"
                    _log.warning("sandbox failed a run; retrying", attempt=attempt + 1, attempts=attempts, error=why)
                else:
                    out[i] = self._checks(response, suite)
        if all(c is not None for c in out):
            return out
        message = f"sandbox unavailable after {attempts} attempt(s): {why}"
        if self.options.on_unavailable == "mark":
            return [c if c is not None else [Check(n, error=message) for n in self.components] for c in out]
        raise SandboxUnavailable(message)

    def _request(self, program: str, suite: TestSuite, origin: sandbox_pb2.ExecutionOrigin
                 ) -> sandbox_pb2.RunTestsRequest:
        """The RunTests request that runs ``program`` against ``suite``."""
        return sandbox_pb2.RunTestsRequest(
            program=sandbox_pb2.ExecuteRequest(language=suite.language, limits=suite.limits,
                                               files=[sandbox_pb2.SourceFile(content=program.encode())]),
            tests=suite.tests, output_match=suite.output_match, origin=origin)

    def _checks(self, response: sandbox_pb2.RunTestsResponse, suite: TestSuite) -> list[Check]:
        """The Checks of one program from the sandbox's answer (one per name in ``components``)."""
        n_tests = len(suite.tests)
        fraction, all_pass = self.components[:2]
        if response.compile_verdict not in (sandbox_pb2.VERDICT_OK, sandbox_pb2.VERDICT_UNSPECIFIED):
            first = (response.compile.stderr or b"").decode(errors="replace").strip().splitlines()[:1]
            detail = f"{_verdict(response.compile_verdict)}: {first[0] if first else response.compile.message}"
            return [Check(fraction, 0.0, short(detail)), Check(all_pass, 0.0, short(detail))]
        passed = sum(r.verdict == sandbox_pb2.VERDICT_OK for r in response.results)
        failed = [f"#{i} {_verdict(r.verdict)}" for i, r in enumerate(response.results)
                  if r.verdict != sandbox_pb2.VERDICT_OK]
        detail = f"{passed}/{n_tests} passed" + (f"; failed: {', '.join(failed[:5])}" if failed else "")
        return [Check(fraction, passed / n_tests, short(detail)), Check(all_pass, float(passed == n_tests), short(detail))]

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
