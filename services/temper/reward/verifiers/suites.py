"""Test-folder rewards: the completion, written next to the task's own tests folder, runs them in the sandbox.

The task's ``reference_answer`` is the packed folder of ``temper.tasks.suites``::

    {"solution_file": "solution.py",                    # the completion's code is written under this name
     "files": {"test_add.py": "...", "helpers.py": "..."},   # the tests folder, path -> text
     "tests": [["test_add.py", "test_neg"], ["test_plain.py", ""]],   # [file, function]; "" = the whole file
     "wall_seconds": 0}                                  # per test; 0: the sandbox's default

One RunTests call per distinct program (the code verifier's sandbox plumbing: retries, batching, execution
origins): the workdir holds the folder's files, ``solution_file`` (the completion's code block) and a
``main.py`` that is ``from solution import *``; each test is an assertion test of the sandbox's harness whose
script is the test file's text (followed by a call of its function), so it runs after the solution's names
are in its namespace and passes only if it runs to its end (see ``temper.sandbox.harness``). The sandbox's
Python has no pytest: each test is a plain Python run.

Components: ``tests.pass_fraction`` (tests passed / tests), ``tests.all_pass`` (1 iff every test
passed), then one record per test, ``tests.case:<file>[::<function>]`` (1 passed, 0 failed, its detail
the verdict and the failing line): not weighed (weight 0), so that a person or the monitor sees which
tests a completion passes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from temper.reward.verifiers import Check, register, short
from temper.reward.verifiers.code import CodeVerifier
from temper.runtime.errors import InvalidArgument, require
from temper.client.sdk import verdict_name
from temper.tasks.suites import MODULE_NAME
from temper.v1 import sandbox_pb2

CASE_PREFIX = "tests.case:"  # per-test records; never a weight of their own


@dataclass(frozen=True)
class FolderSuite:
    solution_file: str
    files: tuple[tuple[str, str], ...]  # (path, text) of the tests folder
    ids: tuple[str, ...]  # "test_add.py::test_neg", one per test
    tests: tuple[sandbox_pb2.TestCase, ...]
    limits: sandbox_pb2.Limits
    language: str = "python3"


def parse_folder_suite(text: str, field: str, max_tests: int, wall_seconds: float) -> FolderSuite:
    """The packed tests folder a task carries in its reference_answer; InvalidArgument naming ``field``."""
    try:
        spec = json.loads(text)
    except ValueError as e:
        raise InvalidArgument(f"not a JSON tests folder: {e}", field=field) from None
    require(isinstance(spec, dict), field, "a JSON object with solution_file, files and tests is required")
    unknown = sorted(set(spec) - {"solution_file", "files", "tests", "wall_seconds"})
    require(not unknown, field, f"unknown key(s) {unknown}")
    solution = spec.get("solution_file", "solution.py")
    require(isinstance(solution, str) and MODULE_NAME.fullmatch(solution) is not None, f"{field}.solution_file",
            f"a Python module file name such as solution.py, got {solution!r}")
    files = spec.get("files")
    require(isinstance(files, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()),
            f"{field}.files", "an object of file path -> text")
    require(solution not in files and "main.py" not in files, f"{field}.files",
            f"may not hold {solution} or main.py (the solution and its importer)")
    tests = spec.get("tests")
    require(isinstance(tests, list) and len(tests) > 0, f"{field}.tests", "a non-empty list")
    require(len(tests) <= max_tests, f"{field}.tests", f"{len(tests)} tests > {max_tests}")
    ids, cases = [], []
    for i, t in enumerate(tests):
        f = f"{field}.tests[{i}]"
        require(isinstance(t, list) and len(t) == 2 and all(isinstance(x, str) for x in t), f,
                "a [file, function] pair of strings")
        path, function = t
        require(path in files, f, f"names {path!r}, which is not in files")
        require(not function or function.isidentifier(), f, f"{function!r} is not a function name")
        ids.append(f"{path}::{function}" if function else path)
        cases.append(sandbox_pb2.TestCase(assertion_script=files[path] + (f"\n\n{function}()\n" if function else "")))
    require(len(set(ids)) == len(ids), f"{field}.tests", "a test is listed twice")
    wall = spec.get("wall_seconds", 0) or wall_seconds
    require(isinstance(wall, int | float) and wall >= 0, f"{field}.wall_seconds", "a number of seconds >= 0")
    return FolderSuite(solution, tuple(files.items()), tuple(ids), tuple(cases),
                       sandbox_pb2.Limits(wall_seconds=wall))


@register
class SuiteVerifier(CodeVerifier):
    name = "tests"
    components = ("tests.pass_fraction", "tests.all_pass")

    def prepare(self, task, field):
        return parse_folder_suite(task.reference_answer, f"{field}.reference_answer", self.options.max_tests,
                                  self.options.wall_seconds)

    def _request(self, program: str, suite: FolderSuite, origin: sandbox_pb2.ExecutionOrigin
                 ) -> sandbox_pb2.RunTestsRequest:
        module = suite.solution_file.removesuffix(".py")
        files = [sandbox_pb2.SourceFile(path="main.py", content=f"from {module} import *\n".encode()),
                 sandbox_pb2.SourceFile(path=suite.solution_file, content=program.encode())]
        files += [sandbox_pb2.SourceFile(path=p, content=text.encode()) for p, text in suite.files]
        return sandbox_pb2.RunTestsRequest(
            program=sandbox_pb2.ExecuteRequest(language="python3", limits=suite.limits, files=files),
            tests=suite.tests, origin=origin)

    def _checks(self, response: sandbox_pb2.RunTestsResponse, suite: FolderSuite) -> list[Check]:
        checks = super()._checks(response, suite)
        for test_id, r in zip(suite.ids, response.results):
            ok = r.verdict == sandbox_pb2.VERDICT_OK
            last = (r.stderr or b"").decode(errors="replace").strip().splitlines()[-1:]
            detail = "passed" if ok else f"{verdict_name(r.verdict)}: {last[0] if last else r.message}"
            checks.append(Check(f"{CASE_PREFIX}{test_id}", float(ok), short(detail)))
        return checks
