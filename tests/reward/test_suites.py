"""A tests-folder domain scored in the real sandbox service (gVisor): the completion is written as solution.py
next to the problem's tests, each test runs under the sandbox's assertion harness, and the reward is the
fraction of tests passed, with one record per test."""

from __future__ import annotations

import random

import pytest

from temper import tasks
from temper.reward.core import Scorer
from temper.reward.settings import RewardSettings
from temper.reward.verifiers.code import sandbox_runner
from temper.reward.verifiers.suites import CASE_PREFIX
from temper.v1 import common_pb2, sandbox_pb2
from tests.reward.conftest import component

TESTS = {
    # pytest-style functions: one test each, after the file's top level
    "test_stats.py": "from solution import mean, median\nfrom helpers import close\n\n\n"
                     "def test_mean():\n    assert close(mean([1, 2, 3, 4]), 2.5)\n\n\n"
                     "def test_median_odd():\n    assert median([3, 1, 2]) == 2\n\n\n"
                     "def test_median_even():\n    assert median([4, 1, 3, 2]) == 2.5\n",
    # a plain assert file (one test), using the solution's names directly
    "test_empty.py": "try:\n    mean([])\nexcept ValueError:\n    pass\nelse:\n"
                     "    raise AssertionError('mean([]) must raise')\n",
    "helpers.py": "def close(a, b):\n    return abs(a - b) < 1e-9\n",  # support code beside the tests
}
CORRECT = """```python
def mean(xs):
    if not xs:
        raise ValueError("empty")
    return sum(xs) / len(xs)

def median(xs):
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
```"""
PARTIAL = """```python
def mean(xs):
    return sum(xs) / len(xs)   # ZeroDivisionError on [], not ValueError

def median(xs):
    return sorted(xs)[len(xs) // 2]   # wrong for even lengths
```"""
WRONG = "```python\ndef mean(xs):\n    return 0\n\ndef median(xs):\n    return 0\n```"
EXITS = "```python\nimport os\nos._exit(0)\n```"  # exit 0 before any test runs: passes nothing
IDS = ["test_empty.py", "test_stats.py::test_mean", "test_stats.py::test_median_odd", "test_stats.py::test_median_even"]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("problems") / "stats"
    (root / "tests").mkdir(parents=True)
    (root / "prompt.md").write_text("Write mean(xs) (ValueError on an empty list) and median(xs).")
    for name, text in TESTS.items():
        (root / "tests" / name).write_text(text)
    return tasks.make_task("data.stats", random.Random(0), "t", {"path": str(root), "verifier": "tests.pass_fraction"})


def test_correct_partial_wrong_and_an_early_exit(sandbox, task):
    group = common_pb2.RolloutGroup(group_id="g", job_id="j", task=task, trajectories=[
        common_pb2.Trajectory(trajectory_id=f"g/{k}", group_id="g", completion_text=t)
        for k, t in enumerate([CORRECT, PARTIAL, WRONG, EXITS, "no code here"])])
    scorer = Scorer(RewardSettings(), sandbox=sandbox_runner(sandbox.address))
    try:
        scored = scorer.score_group(group)
    finally:
        scorer.close()
    correct, partial, wrong, exits, no_code = scored.trajectories
    assert [t.reward.total for t in scored.trajectories] == pytest.approx([1.0, 0.5, 0.0, 0.0, 0.0])
    assert all(t.reward.status == common_pb2.REWARD_STATUS_OK for t in scored.trajectories)
    assert component(correct, "tests.all_pass").value == 1.0 and component(partial, "tests.all_pass").value == 0.0
    assert component(correct, "tests.pass_fraction").weight == 1.0  # the declared verifier is the reward

    def outcomes(t):
        return {c.name.removeprefix(CASE_PREFIX): c.value for c in t.reward.components if c.name.startswith(CASE_PREFIX)}

    assert outcomes(correct) == dict.fromkeys(IDS, 1.0)
    assert outcomes(partial) == {"test_empty.py": 0.0, "test_stats.py::test_mean": 1.0,
                                 "test_stats.py::test_median_odd": 1.0, "test_stats.py::test_median_even": 0.0}
    assert outcomes(wrong) == dict.fromkeys(IDS, 0.0) and outcomes(exits) == dict.fromkeys(IDS, 0.0)
    assert all(c.weight == 0 for c in partial.reward.components if c.name.startswith(CASE_PREFIX))
    details = {c.name.removeprefix(CASE_PREFIX): c.detail for c in partial.reward.components}
    assert details["test_empty.py"].startswith("RUNTIME_ERROR") and "ZeroDivisionError" in details["test_empty.py"]
    assert details["test_stats.py::test_median_even"].startswith("WRONG_ANSWER")
    assert "did not run to its end" in component(exits, f"{CASE_PREFIX}test_empty.py").detail
    assert outcomes(no_code) == {} and component(no_code, "tests.pass_fraction").detail == "no code block"


def test_the_sandboxs_python_has_no_pytest(sandbox):
    """Why the tests run as plain Python files: the sandbox sees the host's /usr read-only, whose python3 has
    no pytest. If this fails, pytest is there now: temper.tasks.suites' doc (and its refusal of
    ``import pytest``) should change with it."""
    from temper.client.sdk import SandboxClient
    from temper.runtime.rpc import client

    probe = b"import importlib.util, sys\nprint(sys.executable, importlib.util.find_spec('pytest') is not None)\n"
    with client(SandboxClient, sandbox.address) as sb:
        r = sb.stub.Execute(sandbox_pb2.ExecuteRequest(language="python3", files=[sandbox_pb2.SourceFile(content=probe)]),
                            timeout=60)
    assert r.verdict == sandbox_pb2.VERDICT_OK, r
    assert r.stdout.decode().split() == ["/usr/bin/python3", "False"]
