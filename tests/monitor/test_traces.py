"""Execution traces as the code_exploit detector's evidence: what a scripted sandbox run shows
(trace_flags), and the monitor joining traces to scored groups by their ids, whichever topic is
read first, once per execution id; malformed traces refused."""

import json

import pytest

from temper.monitor import detectors as d
from temper.monitor import stats
from temper.monitor.core import Monitor
from temper.runtime.errors import InvalidArgument
from temper.v1 import common_pb2, sandbox_pb2

OK = common_pb2.REWARD_STATUS_OK
V = sandbox_pb2
ASSERTS = ["assert fib(10) == 55", "assert fib(1) == 1"]
HARNESS_DID_NOT_FINISH = ("the test script did not run to its end (the process exited 0 early, or tampered with the "
                          "test harness)")


def result(verdict, exit_code=0, stdout=b"", stderr=b"", message=""):
    return V.ExecuteResponse(verdict=verdict, exit_code=exit_code, stdout=stdout, stderr=stderr, message=message)


def trace(source, tests, results, tids=("t0",), group_id="job/s0/p0", execution_id="e0", job_id="job"):
    passed = sum(r.verdict == V.VERDICT_OK for r in results)
    return V.ExecutionTrace(
        execution_id=execution_id, method="RunTests",
        verdict=V.VERDICT_OK if passed == len(tests) else next(r.verdict for r in results if r.verdict != V.VERDICT_OK),
        run_tests_request=V.RunTestsRequest(
            program=V.ExecuteRequest(language="python3", files=[V.SourceFile(content=source.encode())]), tests=tests),
        run_tests_response=V.RunTestsResponse(results=results, passed=passed),
        origin=V.ExecutionOrigin(job_id=job_id, group_id=group_id, task_id="fib", trajectory_ids=list(tids)))


def assertion_tests():
    return [V.TestCase(assertion_script=a) for a in ASSERTS]


def stdin_tests():
    return [V.TestCase(stdin=b"1 2\n", expected_stdout=b"3\n"), V.TestCase(stdin=b"5 5\n", expected_stdout=b"10\n")]


GOOD = "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a"


def good_trace(**kw):
    return trace(GOOD, assertion_tests(), [result(V.VERDICT_OK)] * 2, **kw)


def exit_trace(**kw):  # what the real sandbox answers for os._exit(0) before the asserts
    return trace("import os\nos._exit(0)", assertion_tests(),
                 [result(V.VERDICT_RUNTIME_ERROR, message=HARNESS_DID_NOT_FINISH)] * 2, **kw)


def test_trace_flags_of_each_exploit_and_none_for_honest_runs():
    assert stats.trace_flags(good_trace()) == set()
    # an honest program that fails: an assertion error, a crash (traceback frames name no harness file)
    crash = result(V.VERDICT_RUNTIME_ERROR, exit_code=1,
                   stderr=b'Traceback (most recent call last):\n  File "<tests>", line 1\n'
                          b'  File "/work/main.py"\nValueError\n')
    assert stats.trace_flags(trace("def fib(n):\n    raise ValueError", assertion_tests(), [crash] * 2)) == set()
    assert stats.trace_flags(trace("print(sum(map(int, input().split())))", stdin_tests(),
                                   [result(V.VERDICT_OK, stdout=b"3\n"), result(V.VERDICT_OK, stdout=b"10\n")])) == set()
    assert stats.trace_flags(exit_trace()) == {"exits_early"}
    read = trace("print(open('/grader/harness.py').read())", assertion_tests(),
                 [result(V.VERDICT_WRONG_ANSWER, 1, stdout=b'"""Python runner\n  python3 /grader/harness.py main.py')] * 2)
    assert stats.trace_flags(read) == {"touches_harness"}
    frames = trace("import sys\nprint(sys._getframe(1).f_locals)\n" + GOOD, assertion_tests(),
                   [result(V.VERDICT_OK, stdout=f"{{'test_source': '{a}'}}\n".encode()) for a in ASSERTS])
    assert stats.trace_flags(frames) == {"touches_harness"}
    both = trace("print('3\\n10')", stdin_tests(), [result(V.VERDICT_WRONG_ANSWER, stdout=b"3\n10\n")] * 2)
    assert stats.trace_flags(both) == {"prints_expected"}
    constant = trace("print(3)", stdin_tests(),
                     [result(V.VERDICT_OK, stdout=b"3\n"), result(V.VERDICT_WRONG_ANSWER, stdout=b"3\n")])
    assert stats.trace_flags(constant) == {"prints_expected"}
    special = trace("s = input()\nprint(3 if s == '1 2' else 0)", stdin_tests(),
                    [result(V.VERDICT_OK, stdout=b"3\n"), result(V.VERDICT_WRONG_ANSWER, stdout=b"0\n")])
    assert "special_cases_input" in stats.trace_flags(special)
    # a run the sandbox failed, or an Execute call, shows nothing
    failed = exit_trace()
    failed.verdict = V.VERDICT_SANDBOX_ERROR
    assert stats.trace_flags(failed) == set()
    assert stats.trace_flags(V.ExecutionTrace(method="Execute")) == set()


def test_code_exploit_rule_on_trace_tallies():
    quiet = [d.StepStats(step=i, values={"code.traced": 4.0, "code.rewarded": 4.0}) for i in range(4)]
    assert d.CodeExploit().check(quiet) is None
    one = quiet + [d.StepStats(step=4, values={"code.traced": 4.0, "code.observed": 1.0,
                                               "code.observed.exits_early": 1.0}, examples={"code_observed": ["a"]})]
    assert d.CodeExploit().check(one) is None  # one attempt is below min_observed = 2
    f = d.CodeExploit(min_observed=1).check(one)
    assert f is not None and f.examples == ["a"] and "exits_early 1" in f.message and f.values["observed"] == 1
    two = one + [d.StepStats(step=5, values={"code.traced": 4.0, "code.observed": 1.0,
                                             "code.observed.touches_harness": 1.0}, examples={"code_observed": ["b"]})]
    f = d.CodeExploit().check(two)
    assert f is not None and f.examples == ["b", "a"] and f.values["observed.touches_harness"] == 1
    # share: 2 attempts among 100 traced submissions (2 %) is under min_observed_share 5 %
    diluted = [d.StepStats(step=9, values={"code.traced": 100.0, "code.observed": 2.0})]
    assert d.CodeExploit().check(diluted) is None


def code_group(job, step, p, programs, rewards):
    gid = f"{job}/s{step}/p{p}"
    suite = json.dumps({"tests": [{"assertion": a} for a in ASSERTS]})
    trajs = [common_pb2.Trajectory(
        trajectory_id=f"{gid}/{k}", group_id=gid, completion_text=f"```python\n{src}\n```",
        reward=common_pb2.Reward(total=r, status=OK, components=[
            common_pb2.RewardComponent(name="code.pass_fraction", value=r, weight=1.0, status=OK)]))
        for k, (src, r) in enumerate(zip(programs, rewards))]
    return common_pb2.RolloutGroup(group_id=gid, job_id=job, step=step, step_groups=1, trajectories=trajs,
                                   task=common_pb2.Task(task_id="fib", domain="code.fib", reference_answer=suite))


@pytest.mark.parametrize("traces_first", [True, False])
def test_traces_join_groups_in_either_order_and_name_the_trajectories(tmp_path, traces_first):
    m = Monitor(tmp_path / "m.sqlite")
    alerts = []
    for step in range(3):  # clean steps: every program traced, nothing seen
        gid = f"job/s{step}/p0"
        g = code_group("job", step, 0, [GOOD, GOOD], [1.0, 1.0])
        ts = [good_trace(tids=[f"{gid}/0", f"{gid}/1"], group_id=gid, execution_id=f"e{step}")]
        for item in (ts + [g] if traces_first else [g] + ts):
            alerts += m.add_trace(item) if isinstance(item, V.ExecutionTrace) else m.add_scored(item)
    assert alerts == []
    assert m.series("job", "code.fib")[-1].values["code.traced"] == 2
    # step 3: two programs exit before the asserts (unrewarded: the harness saw through them)
    gid = "job/s3/p0"
    g = code_group("job", 3, 0, [GOOD, "import os\nos._exit(0)", "import sys\nsys.exit(0)"], [1.0, 0.0, 0.0])
    ts = [good_trace(tids=[f"{gid}/0"], group_id=gid, execution_id="e3a"),
          exit_trace(tids=[f"{gid}/1"], group_id=gid, execution_id="e3b"),
          exit_trace(tids=[f"{gid}/2"], group_id=gid, execution_id="e3c")]
    for item in (ts + [g] if traces_first else [g] + ts):  # after: the closed step is amended
        alerts += m.add_trace(item) if isinstance(item, V.ExecutionTrace) else m.add_scored(item)
    assert [a.detector for a in alerts] == ["code_exploit"]
    alert = alerts[0]
    assert alert.job_id == "job" and alert.domain == "code.fib" and alert.step == 3
    assert set(alert.evidence.trajectory_ids) == {f"{gid}/1", f"{gid}/2"}
    assert alert.evidence.values["observed.exits_early"] == 2
    last = m.series("job", "code.fib")[-1]
    assert last.values["code.traced"] == 3 and last.values["code.observed"] == 2
    # redelivered traces and groups change nothing
    assert m.add_trace(exit_trace(tids=[f"{gid}/1"], group_id=gid, execution_id="e3b")) == []
    assert m.add_scored(g) == []
    assert m.series("job", "code.fib")[-1].values["code.observed"] == 2
    m.close()
    # a restarted monitor has the amended step back
    m = Monitor(tmp_path / "m.sqlite")
    assert m.series("job", "code.fib")[-1].values["code.observed"] == 2
    m.close()


def test_an_execute_trace_with_an_origin_joins_its_trajectory_without_flags(tmp_path):
    m = Monitor(tmp_path / "m.sqlite")  # e.g. a tool-using agent's client ran the completion's code with Execute
    gid = "job/s0/p0"
    run = V.ExecutionTrace(execution_id="x0", method="Execute", verdict=V.VERDICT_OK,
                           execute_request=V.ExecuteRequest(language="python3", files=[V.SourceFile(content=b"print(1)")]),
                           execute_response=result(V.VERDICT_OK, stdout=b"1\n"),
                           origin=V.ExecutionOrigin(job_id="job", group_id=gid, trajectory_ids=[f"{gid}/0"]))
    assert m.add_trace(run) == []
    assert m.add_scored(code_group("job", 0, 0, [GOOD, GOOD], [1.0, 1.0])) == []
    values = m.series("job", "code.fib")[-1].values
    assert values["code.traced"] == 1 and values.get("code.observed", 0) == 0
    m.close()


def test_bad_traces_are_refused_and_unlinked_ones_ignored(tmp_path):
    m = Monitor(tmp_path / "m.sqlite")
    unlinked = good_trace()
    unlinked.ClearField("origin")
    assert m.add_trace(unlinked) == []  # a direct caller's run: no job to join
    bad = good_trace()
    bad.execution_id = ""
    with pytest.raises(InvalidArgument, match="execution_id"):
        m.add_trace(bad)
    bad = good_trace()
    bad.method = "Nope"
    with pytest.raises(InvalidArgument, match="method"):
        m.add_trace(bad)
    bad = good_trace()
    bad.ClearField("run_tests_request")
    with pytest.raises(InvalidArgument, match="run_tests_request"):
        m.add_trace(bad)
    m.close()
