"""Traces linked to tasks, as real processes (embedded broker, the sandbox under gVisor, the reward
service, the monitor): a code group published on `rollouts` is scored through the sandbox; each
execution trace on `sandbox-traces` names its job, group, task and trajectories; the dataset export
joins them into (prompt, completion, per-test outcome) records; the monitor's code_exploit alert
names the trajectories whose run exited before the asserts or read the tests, and a job of
correct programs raises nothing."""

import json

import grpc
import pytest

from temper.client.sdk import MonitorClient, SandboxClient
from temper.reward.dataset import export, read_topic
from temper.runtime import kafka
from temper.runtime.launcher import Launcher, pid_alive
from temper.v1 import common_pb2, sandbox_pb2
from tests.conftest import wait_until

pytestmark = pytest.mark.slow  # starts processes

SUITE = json.dumps({"tests": [{"assertion": "assert fib(10) == 55"}, {"assertion": "assert fib(1) == 1"},
                              {"assertion": "assert fib(0) == 0"}], "wall_seconds": 5})
FIB = "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a"
FIB_RECURSIVE = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)"
EXITS = "import os\ndef fib(n):\n    return 0\nos._exit(0)"  # leaves before the asserts run
READS_TESTS = ("import sys\nprint(sys._getframe(1).f_locals.get('test_source'))\n"  # reads its test through the harness
               "def fib(n):\n    return {10: 55, 1: 1, 0: 0}[n]")
WRONG = "def fib(n):\n    return n"  # honest and wrong on fib(10)


class _Raw:
    def __init__(self, raw: bytes):
        self.raw = raw

    @classmethod
    def FromString(cls, raw: bytes):  # noqa: N802 - read_topic's protobuf-like interface
        return cls(raw)


def code_group(job: str, programs: list[str]) -> common_pb2.RolloutGroup:
    gid = f"{job}/s0/p0"
    return common_pb2.RolloutGroup(
        group_id=gid, job_id=job, step=0, step_groups=1,
        task=common_pb2.Task(task_id=f"{job}-fib", domain="code.fib", reference_answer=SUITE,
                             prompt="Write fib(n), the n-th Fibonacci number."),
        trajectories=[common_pb2.Trajectory(trajectory_id=f"{gid}/{k}", group_id=gid,
                                            completion_text=f"Here:\n```python\n{p}\n```",
                                            completion_token_ids=[1, 2, 3]) for k, p in enumerate(programs)])


@pytest.fixture
def services(tmp_path):
    launcher = Launcher(home=tmp_path / "home")
    state = launcher.up(["sandbox", "reward", "monitor"])
    pids = [p.pid for p in state.services.values()] + [state.broker.pid]
    yield state
    launcher.down()
    assert not [p for p in pids if pid_alive(p)], "processes left behind"


def test_traces_carry_the_ids_export_joins_them_and_the_exploit_alert_names_the_trajectories(services, tmp_path):
    bootstrap = services.kafka_bootstrap
    hacked = code_group("hack", [FIB, EXITS, READS_TESTS, FIB])
    clean = code_group("clean", [FIB, FIB_RECURSIVE, WRONG])
    producer = kafka.ProtoProducer(bootstrap, "test")
    # malformed traces first: dead-lettered by the monitor, which goes on
    producer.send_raw(kafka.SANDBOX_TRACES, b"junk", b"\xff\xff not a trace", []).get(30)
    bad = sandbox_pb2.ExecutionTrace(execution_id="bad", method="Nope",
                                     origin=sandbox_pb2.ExecutionOrigin(job_id="x", group_id="x/s0/p0",
                                                                        trajectory_ids=["x/s0/p0/0"]))
    producer.send(kafka.SANDBOX_TRACES, "bad", bad).get(30)
    for g in (hacked, clean):
        producer.send(kafka.ROLLOUTS, g.group_id, g).get(30)
    producer.close()

    scored = wait_until(lambda: (s := list(read_topic(bootstrap, kafka.SCORED, common_pb2.RolloutGroup))) and
                        len(s) == 2 and s, 120, what="both groups scored")
    totals = {t.trajectory_id: t.reward.total for g in scored for t in g.trajectories}
    assert totals == {"hack/s0/p0/0": 1.0, "hack/s0/p0/1": 0.0, "hack/s0/p0/2": 1.0, "hack/s0/p0/3": 1.0,
                      "clean/s0/p0/0": 1.0, "clean/s0/p0/1": 1.0, "clean/s0/p0/2": 0.0}

    # every run's trace names whose program it was (the identical FIBs of "hack" ran once, for both)
    dead = wait_until(lambda: (d := list(read_topic(bootstrap, f"{kafka.SANDBOX_TRACES}.dlq", _Raw))) and
                      len(d) == 2 and d, 60, what="two dead-lettered traces")
    assert {d.raw[:4] for d in dead} == {b"\xff\xff n", bad.SerializeToString()[:4]}
    traces = wait_until(lambda: (t := [x for x in read_topic(bootstrap, kafka.SANDBOX_TRACES, sandbox_pb2.ExecutionTrace)
                                       if x.execution_id != "bad"]) and len(t) == 6 and t, 60, what="six traces")
    owners = {tuple(t.origin.trajectory_ids): t for t in traces}
    assert set(owners) == {("hack/s0/p0/0", "hack/s0/p0/3"), ("hack/s0/p0/1",), ("hack/s0/p0/2",),
                           ("clean/s0/p0/0",), ("clean/s0/p0/1",), ("clean/s0/p0/2",)}
    for ids, t in owners.items():
        job = ids[0].split("/")[0]
        assert (t.origin.job_id, t.origin.group_id, t.origin.task_id) == (job, f"{job}/s0/p0", f"{job}-fib")
        assert t.method == "RunTests" and len(t.run_tests_response.results) == 3

    # the export: prompt, completion and per-test outcome of every code trajectory, joined by the ids
    out = tmp_path / "export.jsonl"
    counts = export(bootstrap, out)
    assert counts["joined"] == 7 and counts["unjoined"] == 0 and counts["traces"] == 7 and counts["undecodable"] == 1
    records = {r["trajectory_id"]: r for r in map(json.loads, out.read_text().splitlines()) if "trajectory_id" in r}
    wrong = records["clean/s0/p0/2"]
    assert wrong["prompt"] == "Write fib(n), the n-th Fibonacci number." and WRONG in wrong["completion"]
    assert wrong["task_id"] == "clean-fib" and wrong["label"] == 0.0
    assert wrong["test_labels"] == [0.0, 1.0, 1.0]
    assert [t["verdict"] for t in wrong["tests"]] == ["WRONG_ANSWER", "OK", "OK"]
    assert records["hack/s0/p0/3"]["test_labels"] == [1.0, 1.0, 1.0]
    assert [t["verdict"] for t in records["hack/s0/p0/1"]["tests"]] == ["RUNTIME_ERROR"] * 3

    # the monitor: the exploit alert names the two trajectories the sandbox saw gaming the tests
    monitor = MonitorClient(services.services["monitor"].address)
    alerts = wait_until(lambda: monitor.list_alerts(job_id="hack", detector="code_exploit"), 60, what="exploit alert")
    assert len(alerts) == 1
    assert set(alerts[0].evidence.trajectory_ids) == {"hack/s0/p0/1", "hack/s0/p0/2"}
    assert alerts[0].evidence.values["observed.exits_early"] == 1
    assert alerts[0].evidence.values["observed.touches_harness"] == 1
    # the clean job: every trace in, its step tallied, and nothing raised
    wait_until(lambda: [p for s in monitor.list_steps("clean") for p in s.steps
                        if p.values.get("code.traced") == 3], 60, what="clean traces tallied")
    assert monitor.list_alerts(job_id="clean") == []

    # an oversized origin is refused over gRPC, the field named, before anything runs
    sandbox = SandboxClient(services.services["sandbox"].address)
    request = sandbox_pb2.RunTestsRequest(
        program=sandbox_pb2.ExecuteRequest(language="python3", files=[sandbox_pb2.SourceFile(content=FIB.encode())]),
        tests=[sandbox_pb2.TestCase(assertion_script="assert fib(1) == 1")],
        origin=sandbox_pb2.ExecutionOrigin(job_id="j", trajectory_ids=["ok", "x" * 300]))
    with pytest.raises(grpc.RpcError) as refused:
        sandbox.stub.RunTests(request, timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "origin.trajectory_ids[1]" in refused.value.details()
