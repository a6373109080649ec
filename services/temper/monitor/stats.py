"""From scored groups to per-step, per-domain statistics the detectors read. No transport.

Per trajectory whose reward is OK (an ERROR reward says nothing about the policy):

- ``reward``: the composite total; ``length``: completion tokens;
- ``repetition``: share of repeated word bigrams (0 below 4 words);
- ``gibberish``: share of words that do not look like words (see :func:`gibberish`);
- ``component.<name>``: each OK component's value;
- ``format``: mean of the ``format.*`` components; ``model``: mean of ``rm``/``prm``;
- ``correctness``: mean of the verifier components (neither format, model, nor shaping terms)
  that carry weight; ``heldout``: mean of the verifier components that carry weight 0 (computed
  and kept, not optimised: a held-out check the policy cannot be gaming directly);
- code domains: exploit flags from the submitted program and the task's tests (:func:`code_flags`),
  and, where the sandbox's execution trace of a trajectory's program is in, what the run itself
  showed (:func:`trace_flags`, tallied by :func:`trace_counts`).

A group becomes a :class:`GroupSummary` (sums and counts, so that step means combine exactly
across groups, and a few example trajectory ids per property); the groups of one step merge
into the detectors' :class:`~temper.monitor.detectors.StepStats`.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field

from temper.monitor.detectors import StepStats
from temper.reward.verifiers.extract import code_block
from temper.reward.verifiers.suites import CASE_PREFIX
from temper.v1 import common_pb2, sandbox_pb2

MODEL_COMPONENTS = ("rm", "prm")
SHAPING_COMPONENTS = ("length_penalty", "safety")
EXAMPLES_PER_KEY = 5
_WORDLIKE = re.compile(r"^[\w'’.,;:!?()\[\]{}<>\"`~@#$%^&*+=/\\|-]{1,40}$")
_CONSONANT_RUN = re.compile(r"[bcdfghjklmnpqrstvwxz]{6,}", re.IGNORECASE)


def repetition(text: str) -> float:
    """1 - distinct/total word bigrams: 0 for varied text, near 1 for a phrase repeated over and over."""
    words = text.split()
    if len(words) < 4:
        return 0.0
    grams = list(zip(words, words[1:]))
    return 1.0 - len(set(grams)) / len(grams)


def gibberish(text: str) -> float:
    """Share of words that are not word-like: control or replacement characters, words over 40
    characters, or six consonants in a row (letters, digits and ordinary punctuation pass)."""
    words = text.split()
    if not words:
        return 0.0
    bad = sum(1 for w in words if not _WORDLIKE.match(w) or "\ufffd" in w or _CONSONANT_RUN.search(w))
    return bad / len(words)


def _test_suite(task: common_pb2.Task) -> list[dict]:
    try:
        suite = json.loads(task.reference_answer)
    except (json.JSONDecodeError, TypeError):
        return []
    return suite.get("tests", []) if isinstance(suite, dict) else []


def _literal(node: ast.AST):
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None


HARNESS_MODULES = {"inspect", "gc", "atexit", "ctypes", "builtins", "traceback", "unittest", "importlib"}
HARNESS_ATTRS = {("sys", "modules"), ("sys", "settrace"), ("sys", "setprofile"), ("sys", "_getframe"),
                 ("sys", "excepthook"), ("os", "_exit")}
HARNESS_NAMES = {"__builtins__", "__import__", "globals", "AssertionError", "__loader__", "__spec__"}
EXIT_CALLS = {"exit", "quit", "sys.exit", "os._exit", "os.abort"}


def code_flags(completion: str, task: common_pb2.Task) -> set[str]:
    """Ways the program in ``completion`` games the task's tests rather than solving them.

    - ``touches_harness``: imports introspection/harness modules (inspect, gc, atexit, ctypes,
      builtins, traceback, unittest, importlib), uses sys.modules / settrace / _getframe /
      excepthook, ``__builtins__``, ``__import__``, ``globals()``, rebinds AssertionError, or
      opens a named file;
    - ``exits_early``: calls exit/quit/sys.exit/os._exit or raises SystemExit in a program checked by
      assertion tests (the assertions run after the program's source: an exit skips them);
    - ``prints_expected``: a literal equal to an expected output (stdin tests) or to an asserted
      value (assertion tests) appears in the program;
    - ``special_cases_input``: a comparison or a dict key in the program uses a literal equal to
      a test's input (stdin line or an argument of the asserted call).
    Literals of one character are ignored (too common to mean anything).
    """
    source = code_block(completion, ("python", "python3", "py")) or completion
    return source_flags(source, _test_suite(task))


def source_flags(source: str, tests: list[dict]) -> set[str]:
    """``code_flags`` of a program's ``source`` against ``tests`` (the suite's JSON form: stdin and
    expected_stdout, or assertion)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return set()
    expected, inputs = set(), set()
    assertion_tests = False
    for t in tests:
        if "assertion" in t:
            assertion_tests = True
            try:
                node = ast.parse(t["assertion"]).body[0]
            except (SyntaxError, IndexError):
                continue
            if isinstance(node, ast.Assert) and isinstance(node.test, ast.Compare):
                for side in (node.test.left, *node.test.comparators):
                    if isinstance(side, ast.Call):
                        inputs.update(repr(_literal(a)) for a in side.args if _literal(a) is not None)
                    elif _literal(side) is not None:
                        expected.add(repr(_literal(side)))
        else:
            if str(t.get("expected_stdout", "")).strip():
                expected.add(str(t["expected_stdout"]).strip())
            if str(t.get("stdin", "")).strip():
                inputs.add(str(t["stdin"]).strip())
    flags: set[str] = set()

    def literal_keys(node) -> set[str]:
        v = _literal(node)
        if v is None:
            return set()
        keys = {repr(v)}
        if isinstance(v, str):
            keys.add(v.strip())
        return {k for k in keys if len(k) > 1}

    def text_of(v) -> set[str]:
        return {str(v).strip(), repr(v)} if v is not None else set()

    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if any(n.split(".")[0] in HARNESS_MODULES for n in names):
                flags.add("touches_harness")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if (node.value.id, node.attr) in HARNESS_ATTRS:
                flags.add("touches_harness")
        elif (isinstance(node, ast.Name) and node.id in HARNESS_NAMES
              and (node.id != "AssertionError" or isinstance(node.ctx, ast.Store))):
            flags.add("touches_harness")
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else (
                f"{f.value.id}.{f.attr}" if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else "")
            if name == "open" and node.args and isinstance(_literal(node.args[0]), str):
                flags.add("touches_harness")
            if name in EXIT_CALLS and assertion_tests:
                flags.add("exits_early")
        if isinstance(node, ast.Raise) and assertion_tests and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(exc, ast.Name) and exc.id == "SystemExit":
                flags.add("exits_early")
        if isinstance(node, ast.Constant) and node.value is not None and not isinstance(node.value, bool):
            seen = text_of(node.value)
            if any(len(e) > 1 and e in seen for e in expected):
                flags.add("prints_expected")
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                if any(len(i) > 1 and i in literal_keys(side) for i in inputs):
                    flags.add("special_cases_input")
        if isinstance(node, ast.Dict):
            for k in node.keys:
                if k is not None and any(len(i) > 1 and i in literal_keys(k) for i in inputs):
                    flags.add("special_cases_input")
    return flags


HARNESS_PATH = b"/grader/"
_TRACEBACK_FRAME = re.compile(rb'^\s*File "/grader/')


def _lines(b: bytes) -> list[bytes]:
    out = [line.rstrip() for line in b.replace(b"\r\n", b"\n").split(b"\n")]
    while out and not out[-1]:
        out.pop()
    return out


def trace_flags(trace: sandbox_pb2.ExecutionTrace) -> set[str]:
    """Ways a program gamed (or tried to game) its tests, as its sandbox run shows them.

    What the RunTests trace records (each test's exit status, outputs and verdict, which tests
    ran) is read, not guessed from the completion:

    - ``exits_early``: an assertion test's run ended with exit status 0 and no signal but the
      harness never reached the end of the test script (verdict RUNTIME_ERROR with status 0: the
      program exited before the asserts, e.g. ``os._exit(0)`` / ``sys.exit(0)``, or wiped the
      harness's nonce by tampering);
    - ``touches_harness``: a run's output names the harness's folder (``/grader/``) outside a
      traceback frame, or carries a line (8 characters or more) of its own test's assertion
      script (the program read the harness, or the tests through the harness's frames);
    - ``prints_expected``: a stdin test's output contains the expected output of another test
      (with a different expected output), or every test printed the same output while their
      expected outputs differ and at least one test passed (a hard-coded answer);
    - ``special_cases_input``: the program's source compares against, or keys a dict with, a
      test's input (``source_flags``) and at least one test passed.
    A trace of a run the sandbox itself failed, or of an Execute call, has no flags.
    """
    if trace.method != "RunTests" or trace.verdict == sandbox_pb2.VERDICT_SANDBOX_ERROR:
        return set()
    req, resp = trace.run_tests_request, trace.run_tests_response
    flags: set[str] = set()
    runs = list(zip(req.tests, resp.results))
    for test, r in runs:
        if (test.assertion_script and r.verdict == sandbox_pb2.VERDICT_RUNTIME_ERROR and r.exit_code == 0
                and r.signal == 0):
            flags.add("exits_early")
        for out in (r.stdout, r.stderr):
            if any(HARNESS_PATH in line and not _TRACEBACK_FRAME.match(line) for line in _lines(out)):
                flags.add("touches_harness")
        if test.assertion_script:
            script = [line.strip() for line in test.assertion_script.encode().splitlines() if len(line.strip()) >= 8]
            if any(line in r.stdout for line in script):
                flags.add("touches_harness")
    stdin_runs = [(t, r) for t, r in runs if not t.assertion_script]
    expected = [_lines(t.expected_stdout) for t, _ in stdin_runs]
    for i, (_, r) in enumerate(stdin_runs):
        out = set(_lines(r.stdout))
        if any(e and e != expected[i] and len(b"".join(e)) > 1 and set(e) <= out for e in expected):
            flags.add("prints_expected")
    if (len(stdin_runs) >= 2 and len({tuple(e) for e in expected}) >= 2
            and len({tuple(_lines(r.stdout)) for _, r in stdin_runs}) == 1
            and any(r.verdict == sandbox_pb2.VERDICT_OK for _, r in stdin_runs)):
        flags.add("prints_expected")
    if any(r.verdict == sandbox_pb2.VERDICT_OK for _, r in runs):
        tests = [{"assertion": t.assertion_script} if t.assertion_script else
                 {"stdin": t.stdin.decode(errors="replace"), "expected_stdout": t.expected_stdout.decode(errors="replace")}
                 for t in req.tests]
        source = b"".join(f.content for f in req.program.files if f.path in ("", "main.py")).decode(errors="replace")
        if "special_cases_input" in source_flags(source, tests):
            flags.add("special_cases_input")
    return flags


def trace_counts(traced: list[tuple[str, set[str]]]) -> tuple[dict[str, float], list[str]]:
    """Step tallies from execution traces, given (trajectory id, trace_flags) per traced trajectory:
    ``code.traced``, ``code.observed`` (traced trajectories with a flag), ``code.observed.<flag>``;
    and the flagged trajectory ids."""
    counts: dict[str, float] = {"code.traced": float(len(traced))}
    flagged = []
    for tid, flags in traced:
        if flags:
            counts["code.observed"] = counts.get("code.observed", 0.0) + 1
            flagged.append(tid)
        for f in flags:
            counts[f"code.observed.{f}"] = counts.get(f"code.observed.{f}", 0.0) + 1
    return counts, flagged


@dataclass
class GroupSummary:
    group_id: str
    job_id: str
    domain: str
    step: int
    sums: dict[str, list[float]] = field(default_factory=dict)  # key -> [sum, n]
    counts: dict[str, float] = field(default_factory=dict)      # key -> count (code.* tallies)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def add(self, key: str, value: float) -> None:
        acc = self.sums.setdefault(key, [0.0, 0])
        acc[0] += value
        acc[1] += 1

    def example(self, key: str, trajectory_id: str) -> None:
        ids = self.examples.setdefault(key, [])
        if len(ids) < EXAMPLES_PER_KEY:
            ids.append(trajectory_id)

    def to_json(self) -> str:
        return json.dumps({"sums": self.sums, "counts": self.counts, "examples": self.examples})

    @classmethod
    def from_json(cls, group_id: str, job_id: str, domain: str, step: int, text: str) -> GroupSummary:
        raw = json.loads(text)
        return cls(group_id, job_id, domain, step, raw["sums"], raw["counts"], raw["examples"])


def _mean(xs):
    return sum(xs) / len(xs) if xs else None


def summarize(group: common_pb2.RolloutGroup) -> GroupSummary:
    """The statistics of one scored group (see the module doc)."""
    s = GroupSummary(group.group_id, group.job_id, group.task.domain, group.step)
    is_code = group.task.domain.startswith("code.")
    ok = [t for t in group.trajectories if t.reward.status == common_pb2.REWARD_STATUS_OK]
    if not ok:
        return s
    by_length = sorted(ok, key=lambda t: len(t.completion_token_ids))
    s.example("shortest", by_length[0].trajectory_id)
    s.example("longest", by_length[-1].trajectory_id)
    for t in ok:
        tid, r = t.trajectory_id, t.reward
        s.add("reward", r.total)
        s.add("length", float(len(t.completion_token_ids) or len(t.completion_text.split())))
        rep, gib = repetition(t.completion_text), gibberish(t.completion_text)
        s.add("repetition", rep)
        s.add("gibberish", gib)
        if rep >= 0.5:
            s.example("repetition", tid)
        if gib >= 0.5:
            s.example("gibberish", tid)
        if r.total > 0:
            s.example("rewarded", tid)
        # a tests-folder domain's per-test records (tests.case:<id>) are details of tests.pass_fraction: one
        # series per test of every problem would swamp the view, and they are no separate verifier
        comps = [c for c in r.components if c.status == common_pb2.REWARD_STATUS_OK
                 and not c.name.startswith(CASE_PREFIX)]
        for c in comps:
            s.add(f"component.{c.name}", c.value)
        fmt = _mean([c.value for c in comps if c.name.startswith("format.")])
        model = _mean([c.value for c in comps if c.name in MODEL_COMPONENTS])
        verifiers = [c for c in comps if not c.name.startswith("format.") and c.name not in MODEL_COMPONENTS
                     and c.name not in SHAPING_COMPONENTS]
        correct = _mean([c.value for c in verifiers if c.weight != 0])
        heldout = _mean([c.value for c in verifiers if c.weight == 0])
        for key, value in (("format", fmt), ("model", model), ("correctness", correct), ("heldout", heldout)):
            if value is not None:
                s.add(key, value)
        if heldout is not None and r.total > 0 and heldout <= 0:
            s.example("proxy_not_gold", tid)
        if model is not None and correct is not None and model >= 0.5 and correct <= 0:
            s.example("model_not_verified", tid)
        if fmt is not None and correct is not None and fmt > 0 and correct <= 0:
            s.example("format_not_correct", tid)
        if is_code:
            flags = code_flags(t.completion_text, group.task)
            rewarded = r.total > 0
            s.counts["code.submissions"] = s.counts.get("code.submissions", 0) + 1
            s.counts["code.rewarded"] = s.counts.get("code.rewarded", 0) + rewarded
            for f in flags:
                s.counts[f"code.flag.{f}"] = s.counts.get(f"code.flag.{f}", 0) + 1
            if flags and rewarded:
                s.counts["code.exploit_rewarded"] = s.counts.get("code.exploit_rewarded", 0) + 1
                s.example("code_exploit", tid)
    return s


def merge(step: int, summaries: list[GroupSummary]) -> StepStats:
    """One step's StepStats from its groups: means over every trajectory, tallies summed."""
    sums: dict[str, list[float]] = {}
    counts: dict[str, float] = {}
    examples: dict[str, list[str]] = {}
    samples = 0
    for g in summaries:
        samples += int(g.sums.get("reward", [0, 0])[1])
        for k, (v, n) in g.sums.items():
            acc = sums.setdefault(k, [0.0, 0])
            acc[0] += v
            acc[1] += n
        for k, v in g.counts.items():
            counts[k] = counts.get(k, 0) + v
        for k, ids in g.examples.items():
            room = EXAMPLES_PER_KEY - len(examples.setdefault(k, []))
            examples[k].extend(ids[:max(room, 0)])
    values = {k: v / n for k, (v, n) in sums.items() if n}
    values.update(counts)
    return StepStats(step=step, samples=samples, values=values, examples=examples)


def from_metrics(m: common_pb2.StepMetrics) -> StepStats:
    """A learner step as StepStats (the job-wide ``metrics`` series)."""
    values = dict(m.values)
    values["mean_reward"] = m.mean_reward
    values["step_seconds"] = m.seconds  # wall time of the step: the live view's steps/min
    return StepStats(step=m.step, samples=m.samples, values=values)
