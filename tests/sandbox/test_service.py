"""The service around the sandboxes: bad requests, backpressure, Kafka traces, CLI, start-up errors."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

import grpc
import pytest
from kafka import KafkaConsumer

from temper import jobs
from temper.client.sdk import SandboxClient
from temper.runtime import kafka
from temper.runtime.launcher import Proc, State, pid_alive
from temper.v1 import sandbox_pb2
from tests.sandbox.helpers import REPO, assert_clean, cgroup_dirs, sandbox_pids, start_sandbox, verdict
from tests.sandbox.helpers import client as sandbox_client

pytestmark = pytest.mark.slow  # starts sandbox services

OK_SOURCE = "print('ok')\n"


def execute_request(**overrides) -> sandbox_pb2.ExecuteRequest:
    req = SandboxClient.request(OK_SOURCE, "python3")
    for key, value in overrides.items():
        if key == "limits":
            req.limits.CopyFrom(sandbox_pb2.Limits(**value))
        elif key == "files":
            del req.files[:]
            req.files.extend(value)
        else:
            setattr(req, key, value)
    return req


BAD_EXECUTE = {
    "unknown language": (dict(language="cobol"), "language"),
    "neither language nor command": (dict(language=""), "language"),
    "negative wall time": (dict(limits={"wall_seconds": -1}), "limits.wall_seconds"),
    "negative memory": (dict(limits={"memory_mb": -5}), "limits.memory_mb"),
    "negative processes": (dict(limits={"max_processes": -1}), "limits.max_processes"),
    "NaN cpu time": (dict(limits={"cpu_seconds": math.nan}), "limits.cpu_seconds"),
    "wall time above the maximum": (dict(limits={"wall_seconds": 10_000}), "limits.wall_seconds"),
    "memory above the maximum": (dict(limits={"memory_mb": 1 << 20}), "limits.memory_mb"),
    "output above the maximum": (dict(limits={"max_output_bytes": 1 << 40}), "limits.max_output_bytes"),
    "no source": (dict(files=[]), "files"),
    "empty source": (dict(files=[sandbox_pb2.SourceFile(content=b"  \n")]), "files"),
    "oversized source": (dict(files=[sandbox_pb2.SourceFile(content=b"#" * (2 << 20))]), "files"),
    "oversized stdin": (dict(stdin=b"x" * (17 << 20)), "stdin"),
    "path escaping the workdir": (dict(files=[sandbox_pb2.SourceFile(path="../evil.py", content=b"x")]),
                                  "files[0].path"),
    "absolute path": (dict(files=[sandbox_pb2.SourceFile(path="/etc/evil", content=b"x")]), "files[0].path"),
    "duplicate path": (dict(files=[sandbox_pb2.SourceFile(content=b"x"), sandbox_pb2.SourceFile(path="main.py",
                                                                                              content=b"y")]),
                       "files[1].path"),
}


@pytest.mark.parametrize("overrides, field", BAD_EXECUTE.values(), ids=BAD_EXECUTE.keys())
def test_bad_execute_request(client, overrides, field):
    with pytest.raises(grpc.RpcError) as e:
        client.stub.Execute(execute_request(**overrides), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(f"{field}:"), e.value.details()


def run_tests_request(tests, **program) -> sandbox_pb2.RunTestsRequest:
    return sandbox_pb2.RunTestsRequest(program=execute_request(**program), tests=tests)


BAD_RUN_TESTS = {
    "no tests": (run_tests_request([]), "tests"),
    "too many tests": (run_tests_request([sandbox_pb2.TestCase()] * 1001), "tests"),
    "assertion with expected stdout": (
        run_tests_request([sandbox_pb2.TestCase(assertion_script="assert True", expected_stdout=b"x")]),
        "tests[0].expected_stdout"),
    "assertion for a language without harness": (
        run_tests_request([sandbox_pb2.TestCase(assertion_script="assert True")], language="c"),
        "tests[0].assertion_script"),
    "unknown language": (run_tests_request([sandbox_pb2.TestCase()], language="cobol"), "program.language"),
    "negative limit": (run_tests_request([sandbox_pb2.TestCase()], limits={"wall_seconds": -2}),
                       "program.limits.wall_seconds"),
    "oversized test stdin": (run_tests_request([sandbox_pb2.TestCase(stdin=b"x" * (17 << 20))]), "tests[0].stdin"),
}


@pytest.mark.parametrize("request_, field", BAD_RUN_TESTS.values(), ids=BAD_RUN_TESTS.keys())
def test_bad_run_tests_request(client, request_, field):
    with pytest.raises(grpc.RpcError) as e:
        client.stub.RunTests(request_, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(f"{field}:"), e.value.details()


def test_unknown_fields_are_refused(client):
    raw = execute_request().SerializeToString() + b"\x98\x06\x01"  # field 99, unknown to this schema
    with pytest.raises(grpc.RpcError) as e:
        client.stub.Execute(sandbox_pb2.ExecuteRequest.FromString(raw), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("request:")


def test_still_serving_after_bad_requests(client):
    resp = client.execute(OK_SOURCE)
    assert verdict(resp) == "OK" and resp.stdout == b"ok\n"


def test_queue_full_is_resource_exhausted(service):
    """2 run, 2 wait, the rest are refused at once, with retry advice. (A channel without the SDK's retry
    policy, which would retry the refused calls after the advised delay.)"""
    def call(_):
        with SandboxClient(service.address, channel=grpc.insecure_channel(service.address)) as c:
            try:
                return verdict(c.execute("import time\ntime.sleep(2)\n", wall_seconds=10))
            except grpc.RpcError as e:
                advice = dict(e.trailing_metadata() or ()).get("grpc-retry-pushback-ms")
                return f"{e.code().name} {advice} {'max_queue=2' in e.details()}"

    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(call, range(8)))
    assert sorted(outcomes) == ["OK"] * 4 + ["RESOURCE_EXHAUSTED 500 True"] * 4, outcomes


def test_traces_are_published_to_kafka(broker, tmp_path):
    svc = start_sandbox(tmp_path, "--max-concurrency", "1", "--pool-size", "1", "--trace-max-bytes", "100",
                        kafka_bootstrap=broker)
    try:
        with sandbox_client(svc) as c:
            executed = c.execute("print('x' * 1000)")
            tested = c.run_tests("def add(a, b):\n    return a + b\n", ["assert add(1, 1) == 2", "assert add(1, 1) == 3"])
        assert verdict(executed) == "OK" and tested.passed == 1
    finally:
        svc.stop()
    assert_clean(svc)
    consumer = KafkaConsumer(kafka.SANDBOX_TRACES, bootstrap_servers=broker, auto_offset_reset="earliest",
                             consumer_timeout_ms=10_000)
    records = []
    for record in consumer:
        records.append(record)
        if len(records) == 2:
            break
    consumer.close()
    traces = [sandbox_pb2.ExecutionTrace.FromString(r.value) for r in records]
    assert [t.method for t in traces] == ["Execute", "RunTests"]
    first, second = traces
    assert first.verdict == sandbox_pb2.VERDICT_OK and first.execute_request.files[0].content == b"print('x' * 1000)"
    assert first.execute_response.stdout == b"x" * 100  # truncated to the trace limit
    assert first.total_seconds > 0 and first.started_unix_ms > 0 and first.execution_id
    assert second.verdict == sandbox_pb2.VERDICT_WRONG_ANSWER and second.run_tests_response.passed == 1
    assert len(second.run_tests_request.tests) == 2
    assert any(k == "traceparent" for k, _ in records[0].headers)


def test_service_refuses_to_start_without_runsc(tmp_path):
    p = subprocess.run([sys.executable, "-m", "temper.sandbox", "--port", "0", "--metrics-port", "-1",
                        "--no-publish-traces", "--data-dir", str(tmp_path), "--runsc", "/nonexistent/runsc"],
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert p.returncode != 0
    assert "apt-get install runsc" in p.stderr and "runsc was not found" in p.stderr


def cli(*args, home) -> tuple[int, dict]:
    p = subprocess.run([sys.executable, "-m", "temper.cli.main", "--home", str(home), "sandbox", *args],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert p.stdout, p.stderr
    return p.returncode, json.loads(p.stdout)


def test_cli_starts_a_short_lived_service_when_none_is_up(tmp_path):
    prog = tmp_path / "loop.py"
    prog.write_text("while True:\n    pass\n")
    rc, out = cli("exec", "--timeout", "1", str(prog), home=tmp_path / "home")
    assert rc == 1 and out["status"] == "TIMEOUT" and out["via"] == "a sandbox service started for this call"
    prog.write_text("print(input()[::-1])\n")
    stdin = tmp_path / "in.txt"
    stdin.write_text("olleh\n")
    rc, out = cli("exec", "--stdin", str(stdin), "--memory-mb", "128", str(prog), home=tmp_path / "home")
    assert rc == 0 and out["status"] == "OK" and out["stdout"] == "hello\n"
    assert not (tmp_path / "home" / "state.json").exists()  # nothing left running in the user's home


def test_cli_through_the_running_service(service, tmp_path):
    """With a sandbox service recorded as up (the state `temper up` writes), the CLI calls it."""
    home = tmp_path / "home"
    home.mkdir()
    state = State(home=str(home), config=str(jobs.path()),
                  services={"sandbox": Proc("sandbox", service.proc.pid, service.address, str(service.log))})
    (home / "state.json").write_text(json.dumps(asdict(state)))
    prog = tmp_path / "add.c"
    prog.write_text("#include <stdio.h>\nint main(void){int a,b;scanf(\"%d %d\",&a,&b);printf(\"%d\\n\",a+b);}\n")
    tests = tmp_path / "tests.json"
    tests.write_text(json.dumps([{"stdin": "1 2\n", "expected_stdout": "3\n"},
                                 {"stdin": "2 2\n", "expected_stdout": "5\n"}]))
    rc, out = cli("test", str(prog), str(tests), home=home)
    assert rc == 1 and out["via"] == f"service {service.address}"
    assert out["status"] == "WRONG_ANSWER" and out["passed"] == 1 and out["total"] == 2
    script = tmp_path / "test_add.py"
    script.write_text("assert add(2, 3) == 5\n")
    impl = tmp_path / "impl.py"
    impl.write_text("def add(a, b):\n    return a + b\n")
    rc, out = cli("test", str(impl), str(script), home=home)
    assert rc == 0 and out["status"] == "OK" and out["passed"] == 1
    rc, out = cli("exec", "--language", "python3", str(impl), home=home)
    assert rc == 0 and out["status"] == "OK" and out["via"] == f"service {service.address}"


def test_sandboxes_end_when_the_service_dies(tmp_path):
    """SIGKILL of the service: its sandboxes end by themselves; the next instance sweeps what is left."""
    first = start_sandbox(tmp_path, "--max-concurrency", "1", "--pool-size", "2")
    # a sandbox's cgroup exists (with an empty cgroup.procs) just before runsc enters it: wait for both
    # pooled sandboxes to have processes, not for their directories
    deadline = time.monotonic() + 120
    while len(booted := [f for f in cgroup_dirs(first)[0].glob("*/cgroup.procs") if f.read_text().split()]) < 2:
        assert time.monotonic() < deadline, f"the pool of 2 did not boot: {booted}"
        time.sleep(0.1)
    pids = sandbox_pids(first)
    assert pids
    first.proc.kill()
    first.proc.wait()
    deadline = time.monotonic() + 30
    while [p for p in pids if pid_alive(p)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if pid_alive(p)], "sandboxes outlived their service"
    second = start_sandbox(tmp_path, "--max-concurrency", "1", "--pool-size", "0")
    try:
        assert not any(d.exists() for d in cgroup_dirs(first))
        assert not (first.data_dir / f"instance-{first.proc.pid}").exists()
        with sandbox_client(second) as c:
            assert verdict(c.execute(OK_SOURCE)) == "OK"
    finally:
        second.stop()
    assert_clean(second)


def test_a_language_is_a_config_entry(tmp_path):
    from temper.runtime.config import load_config
    from temper.sandbox.config import SandboxConfig, build_executor
    from temper.sandbox.core import Program, SourceFile

    toml = tmp_path / "temper.toml"
    toml.write_text('[sandbox.languages.dash]\nsource_file = "main.sh"\nrun = ["sh", "main.sh"]\n'
                    'extensions = [".dash"]\n'
                    '[sandbox.languages.c99]\nsource_file = "prog.c"\n'
                    'compile = ["gcc", "-std=c99", "-o", "prog", "prog.c"]\nrun = ["./prog"]\n')
    config = load_config(SandboxConfig, ["--config", str(toml), "--data-dir", str(tmp_path / "data")])
    assert {"python3", "c", "cpp", "bash", "dash", "c99"} <= set(config.language_presets())
    executor, pool = build_executor(config, pool_size=0)
    try:
        r = executor.execute(Program("dash", [SourceFile("", b"echo $((6 * 7))\n")]))
        assert r.verdict.name == "OK" and r.stdout == b"42\n"
        r = executor.execute(Program("c99", [SourceFile("", b"#include <stdio.h>\nint main(void){puts(\"c99\");}\n")]))
        assert r.verdict.name == "OK" and r.stdout == b"c99\n"
    finally:
        pool.close()
