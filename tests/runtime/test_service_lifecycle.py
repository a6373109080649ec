"""The one service lifecycle (temper.runtime.service) as a real process: the port is bound and reported
before the resources open, SERVING only once they are open, and on SIGTERM the gRPC server has
stopped before the resources close, in reverse order."""

import json
import signal
import subprocess
import sys
import textwrap

import pytest

from temper.client.sdk import MonitorClient
from temper.runtime.rpc import check_health
from temper.runtime.service import read_port_file
from tests.conftest import wait_until

pytestmark = pytest.mark.slow  # runs a service as a process

PROBE = textwrap.dedent('''
    import json, sys, threading
    from pathlib import Path
    from temper.runtime.config import ServiceConfig
    from temper.runtime.rpc import check_health
    from temper.runtime.service import Service, read_port_file, run

    EVENTS = Path(sys.argv[1])
    PORT_FILE = sys.argv[3]
    opened = threading.Event()

    def note(*event):
        with EVENTS.open("a") as f:
            f.write(json.dumps(event) + "\\n")

    class ProbeConfig(ServiceConfig):
        section = "probe"

    class Probe(Service):
        name = "probe"
        config_class = ProbeConfig

        def open(self, stack):
            report = read_port_file(PORT_FILE)
            # the port is reported before anything opens; health answers nothing yet (not started)
            note("open first", report is not None, check_health(report["address"], timeout=0.5))
            stack.callback(lambda: note("close first"))
            Path(sys.argv[1] + ".go").touch()
            opened.wait(60)  # a slow resource (a model): the test lets it finish
            stack.callback(lambda: note("close second", check_health(report["address"], timeout=0.5)))
            note("open second")

        def register(self, server):
            return []

    def release():
        import time
        go = Path(sys.argv[1] + ".release")
        while not go.exists():
            time.sleep(0.02)
        opened.set()

    threading.Thread(target=release, daemon=True).start()
    run(Probe, sys.argv[2:])
''')


def test_bind_report_open_serve_then_drain_and_close_in_reverse(tmp_path):
    probe, events, port_file = tmp_path / "probe.py", tmp_path / "events.jsonl", tmp_path / "probe.port.json"
    probe.write_text(PROBE)
    proc = subprocess.Popen([sys.executable, str(probe), str(events), "--port-file", str(port_file), "--port", "0",
                             "--metrics-port", "0", "--grace-seconds", "1"], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: (tmp_path / "events.jsonl.go").exists(), 60, what="the first resource open")
        report = read_port_file(port_file)
        assert report["pid"] == proc.pid and report["metrics_port"] > 0
        address = report["address"]
        assert address.startswith("127.0.0.1:") and not address.endswith(":0")
        assert check_health(address, timeout=0.5) == "UNREACHABLE"  # bound, not serving while resources open
        dependent = MonitorClient(address)  # any SDK client: a dependent that starts while this one loads
        assert not dependent.wait_ready(0.5)
        (tmp_path / "events.jsonl.release").touch()
        assert dependent.wait_ready(30)
        dependent.close()
        wait_until(lambda: check_health(address) == "SERVING", 30, what="SERVING once every resource is open")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out.decode()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    got = [json.loads(line) for line in events.read_text().splitlines()]
    assert got == [["open first", True, "UNREACHABLE"], ["open second"],
                   ["close second", "UNREACHABLE"],  # the server had stopped before the resources closed
                   ["close first"]]
    logged = [json.loads(line)["event"] for line in out.decode().splitlines() if line.startswith("{")]
    assert logged.index("bound") < logged.index("serving") < logged.index("stopping") < logged.index("stopped")


def test_a_health_only_server_answers_probes_and_nothing_else(tmp_path):
    """``serve_health``: the port a process without calls of its own (a learner's first rank on another host)
    answers probes on: NOT_SERVING until set, then SERVING; the service's own methods are not there."""
    import grpc

    from temper.client.sdk import LearnerClient
    from temper.runtime.config import ServiceConfig
    from temper.runtime.service import serve_health

    server, health, address = serve_health(ServiceConfig(host="127.0.0.1", port=0), "learner")
    try:
        assert check_health(address, timeout=5) == "NOT_SERVING"
        health.set("", 1)  # SERVING
        assert check_health(address, timeout=5) == "SERVING"
        with pytest.raises(grpc.RpcError) as e:
            LearnerClient(address).status()
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        server.stop(0)
