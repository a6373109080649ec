"""Helpers of the sandbox tests: the service as a subprocess (``spawn_service``), verdict names, host checks."""

from __future__ import annotations

from pathlib import Path

from temper.client.sdk import SandboxClient, verdict_name
from temper.runtime.launcher import pid_alive
from temper.sandbox.runsc import CGROUP_ROOT, _own_cgroup
from tests.conftest import REPO, ServiceHandle, spawn_service

__all__ = ["REPO", "assert_clean", "cgroup_dirs", "client", "sandbox_pids", "start_sandbox", "verdict"]


def start_sandbox(workdir: Path, *args: str, kafka_bootstrap: str = "", port: int = 0) -> ServiceHandle:
    """``python -m temper.sandbox`` on loopback; traces go to ``kafka_bootstrap`` (none if "")."""
    traces = ["--kafka-bootstrap", kafka_bootstrap] if kafka_bootstrap else ["--no-publish-traces"]
    return spawn_service("sandbox", workdir, *traces, *args, port=port)


def client(svc: ServiceHandle, timeout: float = 120.0) -> SandboxClient:
    return svc.client(SandboxClient, timeout=timeout)


def cgroup_dirs(svc: ServiceHandle) -> list[Path]:
    name = f"temper-sandbox-{svc.proc.pid}"
    return [CGROUP_ROOT / "memory" / _own_cgroup("memory") / name, CGROUP_ROOT / "cpu" / _own_cgroup("cpu") / name]


def sandbox_pids(svc: ServiceHandle) -> list[int]:
    """Every process of every sandbox of this service (runsc, gofer, sentry, stubs)."""
    return [int(p) for f in cgroup_dirs(svc)[0].glob("*/cgroup.procs") for p in f.read_text().split()]


def assert_clean(svc: ServiceHandle) -> None:
    """Nothing of the service is left on the host."""
    assert not pid_alive(svc.proc.pid)
    assert not any(d.exists() for d in cgroup_dirs(svc)), "cgroups left behind"
    assert not list(svc.data_dir.glob("instance-*")), "sandbox state left behind"


def verdict(resp) -> str:
    return verdict_name(resp.verdict)


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

