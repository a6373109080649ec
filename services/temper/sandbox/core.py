"""Sandbox domain logic: requests, limits, verdicts, test judging, admission. No gRPC, no runsc.

``Executor`` takes a fresh sandbox session per call from a backend (``runsc.SandboxPool``
implements it with gVisor), prepares the files, compiles once if the language compiles, runs
every test case in that session (each on a fresh copy of the workdir), and turns what the sandbox
observed (``RunFacts``: exit status, times, peak RSS, why it was killed, outputs) into verdicts.
If a sandbox dies under a test (memory limit), the next test gets a fresh one.

Modes (``Executor(batch=...)``): isolated, one session per program (``run_batch`` runs each
program of a group in its own); batch, one session per call, shared by the programs of a
``run_batch`` group one after the other, each announced with ``Session.begin(i)`` (the backend
gives program i its own uid and wipes what the previous one left).

Pass criteria:
- stdin/stdout test: the run is OK and its stdout matches the expected stdout;
- assertion test: the run is OK and the harness's report is the per-run nonce, which only the
  harness can write, and only after the whole script ran (see harness.py).
"""

from __future__ import annotations

import enum
import math
import os
import posixpath
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Protocol

from temper.runtime.errors import ResourceExhausted, require

MiB = 1 << 20
NONCE_BYTES = 32
RUN_MODE, TEST_MODE = b"run ", b"test"  # the harness's control pipe starts with one of these


class Verdict(enum.Enum):
    """Names equal the protobuf enum's."""

    OK = "OK"
    COMPILE_ERROR = "COMPILE_ERROR"
    RUNTIME_ERROR = "RUNTIME_ERROR"
    TIMEOUT = "TIMEOUT"
    MEMORY_LIMIT = "MEMORY_LIMIT"
    OUTPUT_LIMIT = "OUTPUT_LIMIT"
    SANDBOX_ERROR = "SANDBOX_ERROR"
    WRONG_ANSWER = "WRONG_ANSWER"


class OutputMatch(enum.Enum):
    TRAILING_WHITESPACE = "TRAILING_WHITESPACE"
    EXACT = "EXACT"


@dataclass(frozen=True)
class Limits:
    """Per run. Seconds, MiB, bytes; 0 in a request means "the service's default"."""

    wall_seconds: float = 0.0
    cpu_seconds: float = 0.0
    memory_mb: int = 0
    max_processes: int = 0
    max_output_bytes: int = 0


@dataclass(frozen=True)
class Language:
    name: str
    source_file: str
    run: tuple[str, ...]
    compile: tuple[str, ...] = ()
    test_harness: tuple[str, ...] = ()
    fork_server: tuple[str, ...] = ()  # batch mode: the harness pre-started as a fork server (see harness.py)
    harness_runs: bool = False  # plain runs go through test_harness too ("run" mode; see harness.py)
    extensions: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    aliases: tuple[str, ...] = ()  # other names a request may use ("python", "py" for python3)


@dataclass(frozen=True)
class SourceFile:
    path: str  # relative to the workdir; "" = the language's source file
    content: bytes
    executable: bool = False


@dataclass
class Program:
    language: str
    files: list[SourceFile]
    command: list[str] = field(default_factory=list)
    stdin: bytes = b""
    limits: Limits = Limits()


@dataclass(frozen=True)
class TestCase:
    stdin: bytes = b""
    expected_stdout: bytes = b""
    assertion_script: str = ""


@dataclass
class RunFacts:
    """What a sandbox observed about one run; no judgement.

    ``killed``: None, "wall" (wall-clock limit), "output" (stdout over the limit), "memory" (the
    sandbox's memory cgroup killed it) or "sandbox" (the sandbox failed; ``error`` says how).
    """

    exit_code: int = 0
    signal: int = 0
    wall_seconds: float = 0.0
    cpu_seconds: float = 0.0
    max_rss_bytes: int = 0
    killed: str | None = None
    stdout: bytes = b""
    stderr: bytes = b""
    stdout_bytes: int = 0  # produced, before truncation
    stderr_bytes: int = 0
    report: bytes = b""
    error: str = ""


@dataclass
class Result:
    verdict: Verdict
    exit_code: int = 0
    signal: int = 0
    stdout: bytes = b""
    stderr: bytes = b""
    output_truncated: bool = False
    wall_seconds: float = 0.0
    cpu_seconds: float = 0.0
    peak_memory_bytes: int = 0
    message: str = ""
    queue_seconds: float = 0.0  # Execute only: time spent waiting for a sandbox slot


@dataclass
class TestsResult:
    results: list[Result]
    passed: int
    compile_verdict: Verdict
    compile: Result | None = None
    queue_seconds: float = 0.0


@dataclass(frozen=True)
class Policy:
    """What the service allows: defaults for limits left at 0, maxima, payload caps."""

    defaults: Limits
    maxima: Limits
    compile_limits: Limits
    max_source_bytes: int = 1 * MiB
    max_stdin_bytes: int = 16 * MiB
    max_files: int = 64
    max_tests: int = 1000
    max_script_bytes: int = 1 * MiB
    max_kept_output_bytes: int = 48 * MiB  # program output kept over all runs of one call (< one gRPC message)

    def resolve(self, requested: Limits) -> Limits:
        d = self.defaults
        wall = requested.wall_seconds or d.wall_seconds
        return Limits(
            wall_seconds=wall,
            cpu_seconds=requested.cpu_seconds or min(d.cpu_seconds, wall),
            memory_mb=requested.memory_mb or d.memory_mb,
            max_processes=requested.max_processes or d.max_processes,
            max_output_bytes=requested.max_output_bytes or d.max_output_bytes,
        )


class SandboxUnavailable(Exception):
    """No sandbox could be had (runsc failing to boot, shutting down): the verdict is SANDBOX_ERROR."""


@dataclass
class BatchItem:
    """One program of a ``run_batch`` group with its tests."""

    program: Program
    tests: list[TestCase]
    stop_on_first_failure: bool = False
    output_match: OutputMatch = OutputMatch.TRAILING_WHITESPACE


class Session(Protocol):
    """One fresh sandbox, used for one program (its compilation and all its test runs), or in
    batch mode for the programs of one group, one after the other."""

    @property
    def alive(self) -> bool: ...

    def begin(self, index: int) -> None:
        """Batch mode: the following runs are program ``index`` of the group's."""

    def prepare(self, files: list[SourceFile]) -> None: ...

    def run(self, command: list[str], env: Mapping[str, str], stdin: bytes, limits: Limits,
            control: bytes = b"", stash_after: bool = False, more_runs: bool = False) -> RunFacts:
        """One run on a fresh copy of the workdir. ``more_runs``: another run will follow (a hint:
        the sandbox may prepare for it, e.g. start the next interpreter ahead)."""


# -- validation -------------------------------------------------------------------------------------
def _check_limits(limits: Limits, maxima: Limits, prefix: str) -> None:
    for name in ("wall_seconds", "cpu_seconds", "memory_mb", "max_processes", "max_output_bytes"):
        value, cap = getattr(limits, name), getattr(maxima, name)
        require(isinstance(value, int) or math.isfinite(value), f"{prefix}limits.{name}", "must be a finite number")
        require(value >= 0, f"{prefix}limits.{name}", f"must be >= 0 (0 = the default), got {value}")
        require(value <= cap, f"{prefix}limits.{name}", f"{value} is above the service's maximum {cap}")


def _check_path(path: str, where: str) -> None:
    require("\0" not in path and len(path) <= 255, where, "invalid file name")
    require(not path.startswith("/"), where, f"must be relative to the workdir, got {path!r}")
    norm = posixpath.normpath(path)
    require(norm == path and norm not in (".", "..") and not norm.startswith("../"), where,
            f"must be a normalized relative path inside the workdir, got {path!r}")


def validate(program: Program, languages: Mapping[str, Language], policy: Policy, prefix: str = "",
             tests: list[TestCase] | None = None, tests_prefix: str = "") -> None:
    """Raise InvalidArgument naming the offending field (``prefix`` + its name; ``tests_prefix``
    + ``tests...`` for the test cases)."""
    lang = languages.get(program.language) if program.language else None
    require(not program.language or lang is not None, f"{prefix}language",
            f"unknown language {program.language!r}; known: {', '.join(sorted(languages))}")
    require(bool(program.language or program.command), f"{prefix}language",
            "required unless a command is given")
    require(len(program.files) > 0, f"{prefix}files", "at least one source file is required")
    require(len(program.files) <= policy.max_files, f"{prefix}files", f"more than {policy.max_files} files")
    total = sum(len(f.content) for f in program.files)
    require(total <= policy.max_source_bytes, f"{prefix}files",
            f"{total} bytes of source, above the maximum {policy.max_source_bytes}")
    require(any(f.content.strip() for f in program.files), f"{prefix}files", "empty source")
    seen = set()
    for i, f in enumerate(program.files):
        where = f"{prefix}files[{i}].path"
        path = f.path or (lang.source_file if lang else "")
        require(bool(path), where, "required when no language is given")
        _check_path(path, where)
        require(path not in seen, where, f"duplicate file {path!r}")
        seen.add(path)
    require(len(program.command) <= 256, f"{prefix}command", "more than 256 arguments")
    for i, arg in enumerate(program.command):
        require(bool(arg) and "\0" not in arg, f"{prefix}command[{i}]", "empty or contains NUL")
    require(len(program.stdin) <= policy.max_stdin_bytes, f"{prefix}stdin",
            f"{len(program.stdin)} bytes, above the maximum {policy.max_stdin_bytes}")
    _check_limits(program.limits, policy.maxima, prefix)
    if tests is None:
        return
    tp = tests_prefix
    require(len(tests) > 0, f"{tp}tests", "at least one test case is required")
    require(len(tests) <= policy.max_tests, f"{tp}tests",
            f"{len(tests)} test cases, above the maximum {policy.max_tests}")
    for i, t in enumerate(tests):
        require(len(t.stdin) <= policy.max_stdin_bytes, f"{tp}tests[{i}].stdin",
                f"{len(t.stdin)} bytes, above the maximum {policy.max_stdin_bytes}")
        require(len(t.expected_stdout) <= policy.max_stdin_bytes, f"{tp}tests[{i}].expected_stdout",
                f"{len(t.expected_stdout)} bytes, above the maximum {policy.max_stdin_bytes}")
        if t.assertion_script:
            require(not t.expected_stdout, f"{tp}tests[{i}].expected_stdout",
                    "must be empty for an assertion test (the script is the check)")
            require(lang is not None and bool(lang.test_harness), f"{tp}tests[{i}].assertion_script",
                    f"language {program.language!r} has no assertion-test harness")
            require(len(t.assertion_script.encode()) <= policy.max_script_bytes, f"{tp}tests[{i}].assertion_script",
                    f"above the maximum {policy.max_script_bytes} bytes")


# -- judging ----------------------------------------------------------------------------------------
def _signal_name(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


def judge(facts: RunFacts, limits: Limits) -> Result:
    """The verdict of one run from its facts (no test expectation involved)."""

    def result(verdict: Verdict, message: str = "") -> Result:
        return Result(verdict, exit_code=facts.exit_code, signal=facts.signal, stdout=facts.stdout,
                      stderr=facts.stderr,
                      output_truncated=facts.stdout_bytes > len(facts.stdout) or facts.stderr_bytes > len(facts.stderr),
                      wall_seconds=facts.wall_seconds, cpu_seconds=facts.cpu_seconds,
                      peak_memory_bytes=facts.max_rss_bytes, message=message)

    if facts.killed == "sandbox":
        return result(Verdict.SANDBOX_ERROR, facts.error or "the sandbox failed")
    if facts.killed == "memory" or facts.max_rss_bytes > limits.memory_mb * MiB:
        return result(Verdict.MEMORY_LIMIT, f"memory limit of {limits.memory_mb} MiB exceeded")
    if facts.killed == "output" or facts.stdout_bytes > limits.max_output_bytes:
        return result(Verdict.OUTPUT_LIMIT, f"output limit of {limits.max_output_bytes} bytes exceeded")
    if facts.killed == "wall":
        return result(Verdict.TIMEOUT, f"wall time limit of {limits.wall_seconds:g}s exceeded")
    if facts.signal == signal.SIGXCPU or facts.cpu_seconds > limits.cpu_seconds:
        return result(Verdict.TIMEOUT, f"CPU time limit of {limits.cpu_seconds:g}s exceeded")
    if facts.signal:
        return result(Verdict.RUNTIME_ERROR, f"killed by signal {facts.signal} ({_signal_name(facts.signal)})")
    if facts.exit_code != 0:
        return result(Verdict.RUNTIME_ERROR, f"exit status {facts.exit_code}")
    return result(Verdict.OK)


def judge_compile(facts: RunFacts, limits: Limits) -> Result:
    r = judge(facts, limits)
    if r.verdict in (Verdict.OK, Verdict.SANDBOX_ERROR):
        return r
    return replace(r, verdict=Verdict.COMPILE_ERROR, message=f"compilation failed: {r.message}")


def _within(r: Result, budget: int) -> Result:
    """``r`` with its outputs cut to ``budget`` bytes in all (after judging: the verdict saw them whole)."""
    if len(r.stdout) + len(r.stderr) <= budget:
        return r
    stdout = r.stdout[:max(budget, 0)]
    return replace(r, stdout=stdout, stderr=r.stderr[:max(budget - len(stdout), 0)], output_truncated=True)


def outputs_match(actual: bytes, expected: bytes, mode: OutputMatch) -> bool:
    if mode is OutputMatch.EXACT:
        return actual == expected

    def lines(b: bytes) -> list[bytes]:
        out = [line.rstrip() for line in b.replace(b"\r\n", b"\n").split(b"\n")]
        while out and not out[-1]:
            out.pop()
        return out

    return lines(actual) == lines(expected)


def judge_stdout(r: Result, expected: bytes, mode: OutputMatch) -> Result:
    if r.verdict is not Verdict.OK or outputs_match(r.stdout, expected, mode):
        return r
    return replace(r, verdict=Verdict.WRONG_ANSWER, message="output differs from the expected output")


def judge_assertions(r: Result, report: bytes, nonce: bytes) -> Result:
    if r.verdict is Verdict.OK:
        if report == nonce:
            return r
        return replace(r, verdict=Verdict.RUNTIME_ERROR,
                       message="the test script did not run to its end (the process exited 0 early, "
                               "or tampered with the test harness)")
    if r.verdict is Verdict.RUNTIME_ERROR:
        last = r.stderr.rstrip().rsplit(b"\n", 1)[-1]
        if last.startswith(b"AssertionError"):
            return replace(r, verdict=Verdict.WRONG_ANSWER, message="an assertion failed")
    return r


# -- admission --------------------------------------------------------------------------------------
class Admission:
    """Bounded concurrency with a bounded queue, refusing at once when the queue is full.

    Invariant: running <= max_concurrency and waiting <= max_queue. A call arriving when
    ``max_concurrency`` run and ``max_queue`` wait gets ResourceExhausted: work never piles up.
    """

    def __init__(self, max_concurrency: int, max_queue: int):
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        self.running = 0
        self.waiting = 0
        self._cond = threading.Condition()

    @contextmanager
    def slot(self) -> Iterator[float]:
        """Hold one of the ``max_concurrency`` slots; yields the seconds spent queueing."""
        t0 = time.monotonic()
        with self._cond:
            if self.running >= self.max_concurrency:
                if self.waiting >= self.max_queue:
                    raise ResourceExhausted(f"sandbox busy: {self.running} executions running and {self.waiting} "
                                            f"queued (max_queue={self.max_queue}); retry later",
                                            retry_after_ms=500)
                self.waiting += 1
                try:
                    while self.running >= self.max_concurrency:
                        self._cond.wait()
                finally:
                    self.waiting -= 1
            self.running += 1
        try:
            yield time.monotonic() - t0
        finally:
            with self._cond:
                self.running -= 1
                self._cond.notify()


# -- the executor -----------------------------------------------------------------------------------
class _Sessions:
    """The session(s) of one call: the current one while alive, a fresh one when it is not.

    ``index`` >= 0 (batch mode): every session used is told which program of the group it runs.
    """

    def __init__(self, executor: Executor):
        self._executor = executor
        self.session: Session | None = None
        self.index = -1

    def get(self) -> Session:
        if self.session is None or not self.session.alive:
            self.close()
            self.session = self._executor._open()
            if self.index >= 0:
                self.session.begin(self.index)
        return self.session

    def program(self, index: int) -> None:
        self.index = index
        if self.session is not None and self.session.alive:
            self.session.begin(index)

    def close(self) -> None:
        if self.session is not None:
            self._executor._release(self.session)
            self.session = None


class Executor:
    """Runs programs and test suites in sandboxes from ``open_session``; thread-safe."""

    def __init__(self, open_session: Callable[[], Session], release_session: Callable[[Session], None],
                 languages: Mapping[str, Language], policy: Policy, max_concurrency: int, max_queue: int,
                 batch: bool = False, max_batch_programs: int = 64):
        self._open = open_session
        self._release = release_session
        self.languages = dict(languages)
        self.policy = policy
        self.admission = Admission(max_concurrency, max_queue)
        self.batch = batch
        self.max_batch_programs = max_batch_programs

    @property
    def mode(self) -> str:
        return "batch" if self.batch else "isolated"

    def execute(self, program: Program) -> Result:
        validate(program, self.languages, self.policy)
        with self.admission.slot() as queued:
            out = self._one(program, [TestCase(stdin=program.stdin)], False, None)
        result = out.compile if out.compile_verdict is not Verdict.OK else out.results[0]
        return replace(result, queue_seconds=queued)

    def run_tests(self, program: Program, tests: list[TestCase], stop_on_first_failure: bool = False,
                  output_match: OutputMatch = OutputMatch.TRAILING_WHITESPACE) -> TestsResult:
        validate(program, self.languages, self.policy, prefix="program.", tests=tests)
        with self.admission.slot() as queued:
            out = self._one(program, tests, stop_on_first_failure, output_match)
        out.queue_seconds = queued
        return out

    def run_batch(self, items: list[BatchItem]) -> list[TestsResult]:
        """A group of programs, each with its tests; one admission slot for the whole group.

        Batch mode: one sandbox for the group (a fresh one only if a program killed it), the
        programs one after the other. Isolated mode: a fresh sandbox per program.
        """
        require(len(items) > 0, "programs", "at least one program is required")
        require(len(items) <= self.max_batch_programs, "programs",
                f"{len(items)} programs, above the maximum {self.max_batch_programs}")
        for i, item in enumerate(items):
            validate(item.program, self.languages, self.policy, prefix=f"programs[{i}].program.", tests=item.tests,
                     tests_prefix=f"programs[{i}].")
        out: list[TestsResult] = []
        kept = 0  # output bytes kept so far: the whole group's answer must fit one gRPC message
        with self.admission.slot() as queued:
            sessions = _Sessions(self)
            try:
                for i, item in enumerate(items):
                    if self.batch:
                        sessions.program(i)
                    else:
                        sessions.close()
                    out.append(self._run(item.program, item.tests, item.stop_on_first_failure, item.output_match,
                                         sessions, self.policy.max_kept_output_bytes - kept))
                    kept += sum(len(r.stdout) + len(r.stderr) for r in out[-1].results)
            finally:
                sessions.close()
        for r in out:
            r.queue_seconds = queued
        return out

    def _one(self, program: Program, cases: list[TestCase], stop_on_first_failure: bool,
             output_match: OutputMatch | None) -> TestsResult:
        sessions = _Sessions(self)
        if self.batch:
            sessions.program(0)
        try:
            return self._run(program, cases, stop_on_first_failure, output_match, sessions)
        finally:
            sessions.close()

    # one program: compile once per sandbox, then every case on a fresh copy of the workdir
    def _run(self, program: Program, cases: list[TestCase], stop_on_first_failure: bool,
             output_match: OutputMatch | None, sessions: _Sessions, budget: int | None = None) -> TestsResult:
        """``budget``: output bytes this program's results may keep (default: the policy's per call)."""
        budget = self.policy.max_kept_output_bytes if budget is None else budget
        lang = self.languages.get(program.language) if program.language else None
        limits = self.policy.resolve(program.limits)
        files = [SourceFile(f.path or lang.source_file, f.content, f.executable) for f in program.files]
        env = dict(lang.env) if lang else {}
        results: list[Result] = []
        compile_result: Result | None = None
        prepared: Session | None = None  # the session holding this program's files
        try:
            for i, case in enumerate(cases):
                session = sessions.get()
                if session is not prepared:
                    session.prepare(files)
                    prepared = session
                    if lang is not None and lang.compile:
                        facts = session.run(list(lang.compile), env, b"", self.policy.compile_limits, stash_after=True,
                                            more_runs=True)
                        compiled = judge_compile(facts, self.policy.compile_limits)
                        compile_result = compile_result or compiled
                        if compiled.verdict is not Verdict.OK:
                            return TestsResult([], 0, compiled.verdict, compiled)
                result = self._run_case(session, case, program, lang, env, limits, output_match,
                                        more_runs=i + 1 < len(cases))
                kept = sum(len(r.stdout) + len(r.stderr) for r in results)
                results.append(_within(result, budget - kept))
                if stop_on_first_failure and result.verdict is not Verdict.OK:
                    break
        except SandboxUnavailable as e:
            results.append(Result(Verdict.SANDBOX_ERROR, message=str(e)))
        return TestsResult(results, sum(r.verdict is Verdict.OK for r in results), Verdict.OK, compile_result)

    def _run_case(self, session: Session, case: TestCase, program: Program, lang: Language | None,
                  env: Mapping[str, str], limits: Limits, output_match: OutputMatch | None,
                  more_runs: bool) -> Result:
        if case.assertion_script:
            nonce = os.urandom(NONCE_BYTES)
            facts = session.run(list(lang.test_harness), env, case.stdin, limits,
                                control=TEST_MODE + nonce + case.assertion_script.encode(), more_runs=more_runs)
            return judge_assertions(judge(facts, limits), facts.report, nonce)
        if program.command:
            facts = session.run(list(program.command), env, case.stdin, limits, more_runs=more_runs)
        elif lang.harness_runs:
            facts = session.run(list(lang.test_harness), env, case.stdin, limits, control=RUN_MODE,
                                more_runs=more_runs)
        else:
            facts = session.run(list(lang.run), env, case.stdin, limits, more_runs=more_runs)
        r = judge(facts, limits)
        return r if output_match is None else judge_stdout(r, case.expected_stdout, output_match)


def load_languages(tables: Mapping[str, Mapping]) -> dict[str, Language]:
    """Language presets from config tables (see languages.toml), keyed by name and by every alias.

    An alias maps to the same Language (its ``name`` stays the canonical one); a name or alias
    claimed twice is a configuration error naming both languages.
    """
    out: dict[str, Language] = {}
    owner: dict[str, str] = {}
    for name, t in tables.items():
        lang = Language(name=name, source_file=t["source_file"], run=tuple(t["run"]),
                        compile=tuple(t.get("compile", ())), test_harness=tuple(t.get("test_harness", ())),
                        fork_server=tuple(t.get("fork_server", ())), harness_runs=bool(t.get("harness_runs", False)),
                        extensions=tuple(t.get("extensions", ())),
                        env=dict(t.get("env", {})), aliases=tuple(t.get("aliases", ())))
        for key in (name, *lang.aliases):
            if key in owner and owner[key] != name:
                raise ValueError(f"languages: {key!r} names both {owner[key]!r} and {name!r}")
            owner[key] = name
            out[key] = lang
    return out
