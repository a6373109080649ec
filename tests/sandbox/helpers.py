"""Helpers of the sandbox tests: the service as a subprocess, verdict names, host checks."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from temper.client.sdk import SandboxClient
from temper.runtime.broker import free_port
from temper.runtime.launcher import pid_alive
from temper.runtime.rpc import check_health
from temper.sandbox.runsc import CGROUP_ROOT, _own_cgroup
from temper.v1 import sandbox_pb2

REPO = Path(__file__).resolve().parents[2]


class SandboxService:
    """``python -m temper.sandbox`` as a subprocess on a free loopback port."""

    def __init__(self, workdir: Path, *args: str, kafka_bootstrap: str = ""):
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.data_dir = workdir / "data"
        self.log = workdir / "sandbox.log"
        argv = [sys.executable, "-m", "temper.sandbox", "--host", "127.0.0.1", "--port", str(self.port),
                "--metrics-port", "-1", "--data-dir", str(self.data_dir), "--grace-seconds", "2", *args]
        argv += ["--kafka-bootstrap", kafka_bootstrap] if kafka_bootstrap else ["--no-publish-traces"]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         cwd=REPO, start_new_session=True)
        deadline = time.monotonic() + 90
        while check_health(self.address, timeout=0.5) != "SERVING":
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"sandbox service did not come up; log:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.1)

    @property
    def cgroup_dirs(self) -> list[Path]:
        name = f"temper-sandbox-{self.proc.pid}"
        return [CGROUP_ROOT / "memory" / _own_cgroup("memory") / name, CGROUP_ROOT / "cpu" / _own_cgroup("cpu") / name]

    def sandbox_pids(self) -> list[int]:
        """Every process of every sandbox of this service (runsc, gofer, sentry, stubs)."""
        root = self.cgroup_dirs[0]
        return [int(p) for f in root.glob("*/cgroup.procs") for p in f.read_text().split()]

    def client(self, timeout: float = 120.0) -> SandboxClient:
        return SandboxClient(self.address, timeout=timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def assert_clean(self) -> None:
        """Nothing of the service is left on the host."""
        assert not pid_alive(self.proc.pid)
        assert not any(d.exists() for d in self.cgroup_dirs), "cgroups left behind"
        assert not list(self.data_dir.glob("instance-*")), "sandbox state left behind"


def verdict(resp) -> str:
    return sandbox_pb2.Verdict.Name(resp.verdict)


def host_sandbox_processes() -> set[int]:
    """runsc processes on the host (all services, all sandboxes)."""
    out = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if (d / "comm").read_text().startswith("runsc"):
                    out.add(int(d.name))
            except OSError:
                pass
    return out

