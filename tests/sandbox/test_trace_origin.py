"""An Execute or RunTests call's origin (job, group, task, trajectory ids) goes onto its execution trace,
whole; oversized ids, or an origin on a RunTests call's program, are refused naming the field. The servicer
over a scripted executor (no sandbox)."""

import pytest

from temper.client.sdk import SandboxClient
from temper.runtime.errors import InvalidArgument
from temper.sandbox import core
from temper.sandbox.servicer import SandboxServicer, check_origin
from temper.v1 import sandbox_pb2 as V


class Scripted:
    mode = "isolated"

    def execute(self, program):
        return core.Result(core.Verdict.OK, stdout=b"y" * 10_000)

    def run_tests(self, program, tests, stop_on_first_failure, output_match):
        return core.TestsResult([core.Result(core.Verdict.OK, stdout=b"x" * 10_000)] * len(tests), len(tests),
                                core.Verdict.OK)

    def run_batch(self, items):
        return [self.run_tests(i.program, i.tests, False, None) for i in items]


def request(**origin):
    return V.RunTestsRequest(program=V.ExecuteRequest(language="python3", files=[V.SourceFile(content=b"print(1)")]),
                             tests=[V.TestCase(stdin=b"", expected_stdout=b"1\n")] * 2,
                             origin=V.ExecutionOrigin(**origin) if origin else None)


def test_the_origin_rides_on_the_trace_whole():
    published = []
    servicer = SandboxServicer(Scripted(), published.append, trace_max_bytes=64)  # outputs cut to 64 bytes
    tids = [f"job/s1/p0/{'x' * 200}{k}" for k in range(3)]
    servicer.RunTests(request(job_id="job", group_id="job/s1/p0", task_id="t", trajectory_ids=tids), None)
    servicer.RunTestsBatch(V.RunTestsBatchRequest(programs=[request(job_id="job", trajectory_ids=["a"]), request()]),
                           None)
    first, second, third = published
    assert list(first.origin.trajectory_ids) == tids and first.origin.group_id == "job/s1/p0"
    assert len(first.run_tests_response.results[0].stdout) == 64
    assert list(second.origin.trajectory_ids) == ["a"]
    assert not third.HasField("origin")  # a caller that says nothing gets no origin


def test_an_execute_calls_origin_rides_on_its_trace():
    published = []
    servicer = SandboxServicer(Scripted(), published.append, trace_max_bytes=64)
    program = SandboxClient.request("print(1)", origin={"job_id": "job", "group_id": "job/s2/p1",
                                                        "trajectory_ids": ["job/s2/p1/0"]})
    servicer.Execute(program, None)
    servicer.Execute(SandboxClient.request("print(1)"), None)
    traced, plain = published
    assert traced.method == "Execute" and len(traced.execute_response.stdout) == 64
    assert (traced.origin.group_id, list(traced.origin.trajectory_ids)) == ("job/s2/p1", ["job/s2/p1/0"])
    assert not plain.HasField("origin")
    with pytest.raises(InvalidArgument, match=r"^origin\.group_id"):
        servicer.Execute(SandboxClient.request("print(1)", origin={"group_id": "g" * 257}), None)
    req = SandboxClient.tests_request("print(1)", ["assert True"], origin={"job_id": "job"})
    assert req.origin.job_id == "job" and not req.program.HasField("origin")  # the SDK puts it on the request
    req.program.origin.job_id = "elsewhere"
    with pytest.raises(InvalidArgument, match=r"^program\.origin"):
        servicer.RunTests(req, None)
    with pytest.raises(InvalidArgument, match=r"^programs\[0\]\.program\.origin"):
        servicer.RunTestsBatch(V.RunTestsBatchRequest(programs=[req]), None)
    assert len(published) == 2  # nothing refused ran or was traced


def test_oversized_origins_are_refused_naming_the_field():
    check_origin(V.ExecutionOrigin(job_id="j", trajectory_ids=["a", "b"]), "origin")
    with pytest.raises(InvalidArgument, match=r"origin\.job_id"):
        check_origin(V.ExecutionOrigin(job_id="j" * 257), "origin")
    with pytest.raises(InvalidArgument, match=r"origin\.trajectory_ids\[1\]"):
        check_origin(V.ExecutionOrigin(trajectory_ids=["a", ""]), "origin")
    with pytest.raises(InvalidArgument, match=r"programs\[0\]\.origin\.trajectory_ids"):
        SandboxServicer(Scripted()).RunTestsBatch(
            V.RunTestsBatchRequest(programs=[request(trajectory_ids=["t"] * 1025)]), None)
