"""Traces linked to tasks, in unit: the code verifier tags each sandbox run with whose program it is
(a scripted sandbox records the requests), and the export joins a trace's per-test outcomes to the
scored trajectories it names."""

from __future__ import annotations

import json

import pytest

from temper.reward.core import Scorer
from temper.reward.dataset import records_from_group, per_test_outcomes
from temper.reward.settings import CodeOptions, RewardSettings
from temper.v1 import common_pb2, sandbox_pb2
from tests.builders import rollout_group

SUITE = json.dumps({"tests": [{"stdin": "1 2\n", "expected_stdout": "3\n"}, {"stdin": "5\n", "expected_stdout": "5\n"}]})
V = sandbox_pb2


class Scripted:
    """A sandbox that passes every test and keeps the requests it got."""

    def __init__(self):
        self.requests = []

    def __call__(self, request, timeout):
        if isinstance(request, V.RunTestsBatchRequest):
            return V.RunTestsBatchResponse(results=[self(r, timeout) for r in request.programs])
        self.requests.append(request)
        return V.RunTestsResponse(results=[V.ExecuteResponse(verdict=V.VERDICT_OK)] * len(request.tests),
                                  passed=len(request.tests), compile_verdict=V.VERDICT_OK)


def code(src):
    return f"```python\n{src}\n```"


@pytest.mark.parametrize("batch_size", [0, 4])
def test_each_sandbox_run_names_its_job_group_task_and_trajectories(batch_size):
    sandbox = Scripted()
    scorer = Scorer(RewardSettings(code=CodeOptions(batch_size=batch_size)), sandbox=sandbox)
    try:
        g = rollout_group("code", SUITE, [code("print(3)"), code("print(1)"), code("print(3)"), "no code"],
                          group_id="job7/s2/p0", job_id="job7", step=2)
        g.task.task_id = "sum-1"
        scorer.score_group(g)
    finally:
        scorer.close()
    origins = sorted((r.program.files[0].content.decode().strip(), r.origin) for r in sandbox.requests)
    assert [src for src, _ in origins] == ["print(1)", "print(3)"]  # identical programs ran once
    for _, o in origins:
        assert (o.job_id, o.group_id, o.task_id) == ("job7", "job7/s2/p0", "sum-1")
    assert list(origins[0][1].trajectory_ids) == ["job7/s2/p0/1"]
    assert list(origins[1][1].trajectory_ids) == ["job7/s2/p0/0", "job7/s2/p0/2"]


def trace(results, n_tests=3, compile_verdict=V.VERDICT_OK, tids=("g/0",)):
    return V.ExecutionTrace(
        execution_id="e1", method="RunTests", verdict=V.VERDICT_WRONG_ANSWER,
        run_tests_request=V.RunTestsRequest(tests=[V.TestCase(stdin=b"x", expected_stdout=b"y")] * n_tests),
        run_tests_response=V.RunTestsResponse(results=results, compile_verdict=compile_verdict,
                                              compile=V.ExecuteResponse(message="compilation failed: exit status 1")),
        origin=V.ExecutionOrigin(job_id="j", group_id="g", task_id="t", trajectory_ids=list(tids)))


def test_per_test_outcomes_of_a_trace():
    out = per_test_outcomes(trace([V.ExecuteResponse(verdict=V.VERDICT_OK),
                               V.ExecuteResponse(verdict=V.VERDICT_WRONG_ANSWER, message="output differs")]))
    assert out["test_labels"] == [1.0, 0.0, 0.0]
    assert [t["verdict"] for t in out["tests"]] == ["OK", "WRONG_ANSWER", "NOT_RUN"]  # stop_on_first_failure
    assert out["tests"][1]["message"] == "output differs" and out["execution_id"] == "e1"
    failed = per_test_outcomes(trace([], compile_verdict=V.VERDICT_COMPILE_ERROR))
    assert [t["verdict"] for t in failed["tests"]] == ["COMPILE_ERROR"] * 3 and failed["test_labels"] == [0.0] * 3
    broken = trace([])
    broken.verdict = V.VERDICT_SANDBOX_ERROR
    assert per_test_outcomes(broken) is None
    assert per_test_outcomes(V.ExecutionTrace(method="Execute")) is None


def test_a_code_trajectory_record_is_prompt_completion_and_per_test_outcomes():
    g = rollout_group("code", SUITE, [code("print(3)"), code("print(4)")], group_id="g", job_id="j", prompt="Sum them.")
    g.task.task_id = "t"
    for traj, v in zip(g.trajectories, [0.5, 0.0]):
        traj.reward.CopyFrom(common_pb2.Reward(total=v, status=common_pb2.REWARD_STATUS_OK, components=[
            common_pb2.RewardComponent(name="code.pass_fraction", value=v, weight=1.0, status=common_pb2.REWARD_STATUS_OK)]))
    outcome = per_test_outcomes(trace([V.ExecuteResponse(verdict=V.VERDICT_OK),
                                   V.ExecuteResponse(verdict=V.VERDICT_WRONG_ANSWER)], n_tests=2))
    recs = [r for r in records_from_group(g, outcomes={"g/0": outcome}) if "label" in r]
    first, second = recs
    assert first["prompt"] == "Sum them." and first["completion"] == code("print(3)") and first["label"] == 0.5
    assert (first["job_id"], first["group_id"], first["task_id"], first["trajectory_id"]) == ("j", "g", "t", "g/0")
    assert first["test_labels"] == [1.0, 0.0] and [t["passed"] for t in first["tests"]] == [True, False]
    assert "tests" not in second and second["trajectory_id"] == "g/1"  # no trace of its program: outcome only
