"""Tests-folder domains (``data.<name>`` with a ``tests.*`` verifier): each problem's prompt and tests folder
become a task carrying the whole folder; every bad input is refused at validation, naming the option and the
file. The verifier's side (reading the packed folder, building the sandbox request, per-test records) is
checked here without a sandbox; tests/reward/test_suites.py runs it in the real one."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from temper import tasks
from temper.reward.settings import RewardSettings
from temper.reward.verifiers.suites import CASE_PREFIX, SuiteVerifier, parse_folder_suite
from temper.runtime.errors import InvalidArgument
from temper.scheduler.core import JobSpec
from temper.tasks import data, suites
from temper.v1 import common_pb2, sandbox_pb2

ADD_TESTS = {
    "test_add.py": "from solution import add\n\n\ndef test_small():\n    assert add(1, 2) == 3\n\n\n"
                   "def test_negative():\n    assert add(-5, 2) == -3\n",
    "test_plain.py": "assert add(10, 20) == 30\n",  # no test functions: the file is one test
    "helpers.py": "BIG = 10 ** 6\n",  # support file: copied, not a test
}


def problem(root: Path, name: str, prompt: str, tests: dict[str, str], tests_dir: str = "tests",
            prompt_file: str = "prompt.md") -> Path:
    d = root / name
    (d / tests_dir).mkdir(parents=True)
    (d / prompt_file).write_text(prompt)
    for rel, text in tests.items():
        (d / tests_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / tests_dir / rel).write_text(text)
    return d


def two_problems(root: Path) -> Path:
    problem(root, "add", "Write add(a, b).\n", ADD_TESTS)
    problem(root, "rev", "Write rev(s).", {"checks/rev_test.py": "from solution import rev\nassert rev('ab') == 'ba'\n"})
    return root


def cfg(path: Path, **over) -> dict:
    return {"path": str(path), "verifier": "tests.pass_fraction", **over}


def refused(c: dict) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as e:
        tasks.check_config("data.mine", c, field="domain_config[data.mine]")
    return e.value


def test_each_problem_folder_becomes_a_task_carrying_its_tests(tmp_path):
    root = two_problems(tmp_path / "problems")
    ds = data.load("data.mine", cfg(root))
    assert ds.format == "tests" and len(ds.train) == 2 and not ds.held_out
    by_prompt = {r.prompt.split("\n")[0]: r for r in ds.train}
    assert set(by_prompt) == {"Write add(a, b).", "Write rev(s)."}
    add = json.loads(by_prompt["Write add(a, b)."].answer)
    assert add["solution_file"] == "solution.py" and add["files"] == ADD_TESTS
    # a file with test_* functions: one test each; a file without: one test; helpers.py: no test
    assert add["tests"] == [["test_add.py", "test_small"], ["test_add.py", "test_negative"], ["test_plain.py", ""]]
    rev = json.loads(by_prompt["Write rev(s)."].answer)
    assert rev["tests"] == [["checks/rev_test.py", ""]]  # *_test.py, in a subfolder
    assert by_prompt["Write rev(s)."].where.startswith("problem rev (")
    task = tasks.make_task("data.mine", random.Random(0), "t", cfg(root))
    assert task.metadata["verifier"] == "tests.pass_fraction" and task.domain == "data.mine"
    assert task.prompt.endswith("\n\nAnswer with the complete Python file solution.py in a ```python code block.")
    assert json.loads(task.reference_answer)["tests"]
    line = tasks.describe("data.mine", cfg(root))
    assert "2 problems with 4 tests" in line and "no pytest" in line


def test_one_problem_folder_a_jsonl_of_problems_and_the_options(tmp_path):
    one = problem(tmp_path, "only", "Write add.", ADD_TESTS, tests_dir="spec", prompt_file="TASK.txt")
    ds = data.load("data.one", cfg(one, tests_dir="spec", prompt_file="TASK.txt", solution_file="impl.py",
                                    instruction="", wall_seconds=3))
    (row,) = ds.train
    assert row.prompt == "Write add."  # instruction = "" appends nothing
    packed = json.loads(row.answer)
    assert packed["solution_file"] == "impl.py" and packed["wall_seconds"] == 3
    # a JSONL row names its prompt and its tests folder (relative to the file's folder)
    two_problems(tmp_path / "p")
    listing = tmp_path / "problems.jsonl"
    listing.write_text(json.dumps({"q": "Add them.", "dir": "p/add/tests"}) + "\n\n"
                       + json.dumps({"q": "Reverse it.", "dir": str(tmp_path / "p" / "rev" / "tests")}) + "\n")
    ds = data.load("data.listed", cfg(listing, prompt_field="q", tests_field="dir", eval_fraction=0.5))
    assert len(ds.train) == 1 and len(ds.held_out) == 1 and ds.held_out_from == "eval_fraction 0.5"
    assert {r.where for r in ds.train + ds.held_out} == {"row 1 (line 1)", "row 2 (line 3)"}
    # the job's validation and sampling take it like any data domain; the relative path from the job's folder
    resolved = tasks.resolve_paths({"data.listed": {**cfg(Path("problems.jsonl")), "prompt_field": "q",
                                                    "tests_field": "dir"}}, tmp_path)
    spec = JobSpec.from_dict({"domains": ["data.listed"], "domain_config": resolved})
    spec.validate()
    assert spec.sampling_plan()


@pytest.mark.parametrize("case,option,words", [
    ("missing folder", "path", "no such file or folder"),
    ("no problems", "path", "holds no problem folders"),
    ("no prompt file", "prompt_file", "has no prompt file"),
    ("empty prompt", "prompt_file", "is empty"),
    ("no tests folder", "tests_dir", "no tests folder"),
    ("no tests", "tests_dir", "holds no tests (test_*.py or *_test.py files)"),
    ("bad verifier name", "verifier", "unknown verifier 'tests.most_pass'"),
    ("bad verifier name, format tests", "verifier", "unknown verifier 'test.pass_fraction'"),
    ("no verifier", "verifier", "required"),
    ("other verifier with format tests", "verifier", "is scored by one of"),
    ("format mismatch", "format", "format must be 'tests'"),
    ("suite option elsewhere", "tests_dir", "only for a tests-folder domain"),
    ("unknown option", "colour", "unknown option"),
    ("bad solution name", "solution_file", "a Python module file name"),
    ("solution inside tests", "tests_dir", "may not hold solution.py"),
    ("negative wall", "wall_seconds", "seconds >= 0"),
    ("imports pytest", "tests_dir", "test_x.py line 1 imports pytest: the sandbox's Python has no pytest"),
    ("fixture parameter", "tests_dir", "test_one takes parameters (pytest fixtures?)"),
    ("unittest", "tests_dir", "imports unittest"),
    ("syntax error", "tests_dir", "test_x.py line 1: not valid Python"),
    ("not text", "tests_dir", "is not UTF-8 text"),
    ("plain file", "path", "a folder of problems or a .jsonl file"),
    ("jsonl row without tests", "tests_field", "row 1 (line 1): 'tests' must name the problem's tests folder"),
    ("jsonl tests folder missing", "tests_field", "row 1 (line 1): no tests folder"),
    ("jsonl without prompt_field", "prompt_field", "required"),
])
def test_bad_input_is_refused_naming_the_option_and_the_file(tmp_path, case, option, words):
    root = two_problems(tmp_path / "problems")
    c = cfg(root)
    if case == "missing folder":
        c["path"] = str(tmp_path / "nope")
    elif case == "no problems":
        (tmp_path / "empty").mkdir()
        c["path"] = str(tmp_path / "empty")
    elif case == "no prompt file":
        (root / "add" / "prompt.md").unlink()
    elif case == "empty prompt":
        (root / "add" / "prompt.md").write_text(" \n")
    elif case == "no tests folder":
        c["tests_dir"] = "spec"
    elif case == "no tests":
        (root / "add" / "tests" / "test_add.py").unlink()
        (root / "add" / "tests" / "test_plain.py").unlink()
    elif case == "bad verifier name":
        c["verifier"] = "tests.most_pass"
    elif case == "bad verifier name, format tests":
        c.update(verifier="test.pass_fraction", format="tests")
    elif case == "no verifier":
        del c["verifier"]
    elif case == "other verifier with format tests":
        c.update(verifier="exact_answer", format="tests")
    elif case == "format mismatch":
        c["format"] = "jsonl"
    elif case == "suite option elsewhere":
        c.update(verifier="exact_answer", prompt_field="q", answer_field="a", tests_dir="x")
    elif case == "unknown option":
        c["colour"] = "blue"
    elif case == "bad solution name":
        c["solution_file"] = "my-solution.py"
    elif case == "solution inside tests":
        (root / "add" / "tests" / "solution.py").write_text("def add(a, b): return a + b\n")
    elif case == "negative wall":
        c["wall_seconds"] = -1
    elif case in ("imports pytest", "fixture parameter", "unittest", "syntax error"):
        text = {"imports pytest": "import pytest\n", "fixture parameter": "def test_one(tmp_path):\n    pass\n",
                "unittest": "import unittest\n", "syntax error": "def (:\n"}[case]
        (root / "rev" / "tests" / "test_x.py").write_text(text)
    elif case == "not text":
        (root / "rev" / "tests" / "data.bin").write_bytes(b"\xff\xfe\x00")
    elif case == "plain file":
        (tmp_path / "p.csv").write_text("a\n1\n")
        c["path"] = str(tmp_path / "p.csv")
    elif case.startswith("jsonl"):
        listing = tmp_path / "l.jsonl"
        row = {"q": "Add."} | ({"tests": "nowhere"} if case == "jsonl tests folder missing" else {})
        listing.write_text(json.dumps(row) + "\n")
        c = cfg(listing) if case == "jsonl without prompt_field" else cfg(listing, prompt_field="q")
    e = refused(c)
    assert e.field == f"domain_config[data.mine].{option}", (e.field, e.message)
    assert words in e.message, e.message


def test_the_verifier_reads_the_packed_folder_and_builds_one_sandbox_request(tmp_path):
    packed = suites.pack(problem(tmp_path, "add", "Write add.", ADD_TESTS) / "tests", {"wall_seconds": 2}, "f")
    suite = parse_folder_suite(packed, "group.task.reference_answer", max_tests=256, wall_seconds=0)
    assert suite.ids == ("test_add.py::test_small", "test_add.py::test_negative", "test_plain.py")
    # the test's script is its file, then a call of its function; a plain file is its own script
    assert suite.tests[1].assertion_script == ADD_TESTS["test_add.py"] + "\n\ntest_negative()\n"
    assert suite.tests[2].assertion_script == ADD_TESTS["test_plain.py"]
    v = SuiteVerifier(RewardSettings())
    try:
        request = v._request("def add(a, b):\n    return a + b\n", suite, sandbox_pb2.ExecutionOrigin(task_id="t"))
        files = {f.path: f.content.decode() for f in request.program.files}
        assert files == {"main.py": "from solution import *\n", "solution.py": "def add(a, b):\n    return a + b\n",
                         **ADD_TESTS}
        assert request.program.limits.wall_seconds == 2 and request.origin.task_id == "t"
        ok, wrong = sandbox_pb2.VERDICT_OK, sandbox_pb2.VERDICT_WRONG_ANSWER
        response = sandbox_pb2.RunTestsResponse(compile_verdict=ok, results=[
            sandbox_pb2.ExecuteResponse(verdict=ok),
            sandbox_pb2.ExecuteResponse(verdict=wrong, stderr=b"Traceback ...\nAssertionError: -7 != -3\n"),
            sandbox_pb2.ExecuteResponse(verdict=ok)])
        checks = v._checks(response, suite)
    finally:
        v.close()
    assert [(c.name, c.value) for c in checks] == [
        ("tests.pass_fraction", pytest.approx(2 / 3)), ("tests.all_pass", 0.0),
        (f"{CASE_PREFIX}test_add.py::test_small", 1.0), (f"{CASE_PREFIX}test_add.py::test_negative", 0.0),
        (f"{CASE_PREFIX}test_plain.py", 1.0)]
    assert checks[3].detail == "WRONG_ANSWER: AssertionError: -7 != -3"


@pytest.mark.parametrize("spec,field", [
    ("not json", "r"),
    ({"files": {}, "tests": [["a.py", ""]]}, "r.tests[0]"),
    ({"files": {"a.py": "x"}, "tests": []}, "r.tests"),
    ({"files": {"a.py": "x"}, "tests": [["a.py", "not a name"]]}, "r.tests[0]"),
    ({"files": {"a.py": "x"}, "tests": [["a.py", ""], ["a.py", ""]]}, "r.tests"),
    ({"files": {"main.py": "x"}, "tests": [["main.py", ""]]}, "r.files"),
    ({"solution_file": "../x.py", "files": {"a.py": "x"}, "tests": [["a.py", ""]]}, "r.solution_file"),
    ({"files": {"a.py": "x"}, "tests": [["a.py", ""]], "colour": 1}, "r"),
])
def test_a_bad_packed_folder_is_a_request_error_naming_the_field(spec, field):
    with pytest.raises(InvalidArgument) as e:
        parse_folder_suite(spec if isinstance(spec, str) else json.dumps(spec), "r", 256, 0)
    assert e.value.field == field, (e.value.field, e.value.message)


def test_per_test_records_are_left_out_of_the_monitors_series():
    from temper.monitor.stats import summarize
    from temper.reward.composite import compose
    from temper.reward.verifiers import Check

    reward = compose([Check("tests.pass_fraction", 0.5), Check("tests.all_pass", 0.0),
                      Check(f"{CASE_PREFIX}test_a.py", 1.0), Check(f"{CASE_PREFIX}test_b.py", 0.0)],
                     {"tests.pass_fraction": 1.0})
    group = common_pb2.RolloutGroup(group_id="g", task=common_pb2.Task(domain="data.mine"), trajectories=[
        common_pb2.Trajectory(trajectory_id="g/0", completion_text="x", reward=reward)])
    names = set(summarize(group).sums)
    assert {"component.tests.pass_fraction", "component.tests.all_pass", "correctness"} <= names
    assert not [n for n in names if CASE_PREFIX in n]
