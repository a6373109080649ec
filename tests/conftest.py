"""Shared fixtures: a real broker, a real local stack of services, one service as a process; all on
127.0.0.1; the test tiers.

Everything a fixture or helper starts it stops, by PID (the launcher records them; ``spawn_service``
holds its Popen).

Tiers: a test is marked ``fast`` (``pytest -m fast``) unless it starts processes or servers:
unless it uses a fixture that does (``PROCESS_FIXTURES``), runs the vLLM engine (it compiles
kernels with g++), or its module is marked ``slow`` (it starts them itself). The marker is
checked, not trusted: while a ``fast`` test runs, starting a process or a server fails it.
"""

from __future__ import annotations

import multiprocessing.process
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc
import pytest

from temper.runtime.broker import start_broker_on_free_port
from temper.runtime.launcher import Launcher, pid_alive
from temper.runtime.rpc import check_health
from temper.runtime.service import read_port_file

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def broker(tmp_path):
    """A fresh embedded Kafka-compatible broker; yields its bootstrap address."""
    proc, port = start_broker_on_free_port(tmp_path / "broker.log")
    yield f"127.0.0.1:{port}"
    proc.kill()
    proc.wait(10)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """Every service up (as `temper up` does), shared by a test module; torn down after it."""
    home = tmp_path_factory.mktemp("temper-home")
    launcher = Launcher(home=home)
    state = launcher.up()
    pids = [p.pid for p in state.services.values()] + [state.broker.pid]
    yield launcher
    launcher.down()
    assert not [p for p in pids if pid_alive(p)], "processes left behind"


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.05, what: str = "condition"):
    """Poll ``predicate`` until it returns something true (returned) or ``timeout`` runs out (AssertionError).

    The one way tests wait: on the condition itself, never on a sleep that hopes it came true.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


C = TypeVar("C")


@dataclass
class ServiceHandle:
    """One ``python -m temper.<name>`` process that ``spawn_service`` started and saw SERVING."""

    name: str
    proc: subprocess.Popen
    address: str
    metrics_port: int
    log: Path
    data_dir: Path

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def client(self, cls: type[C], **kw) -> C:
        """An SDK client (``temper.client.sdk``) of this service."""
        return cls(self.address, **kw)

    def kill(self) -> None:
        """SIGKILL, as a crash: nothing is flushed or committed."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM (the service drains and closes), SIGKILL after ``grace`` seconds."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def spawn_service(name: str, workdir: Path, *args: str, port: int = 0, timeout: float = 120.0) -> ServiceHandle:
    """Start ``python -m temper.<name> *args`` on 127.0.0.1 and return once it is SERVING.

    The service binds ``port`` (0: the OS picks; pass a stopped service's port to restart it on the
    same address) and reports what it got in a port file; the helper then waits on its health
    check. If it exits or is not SERVING within ``timeout``, it is stopped and the error shows the
    end of its log (``workdir/<name>.log``; several spawns of one name append to it).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    log, port_file, data_dir = workdir / f"{name}.log", workdir / f"{name}.port.json", workdir / f"{name}-data"
    port_file.unlink(missing_ok=True)
    argv = [sys.executable, "-m", f"temper.{name}", "--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0",
            "--port-file", str(port_file), "--data-dir", str(data_dir), "--grace-seconds", "2", *args]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "TOKENIZERS_PARALLELISM": "false",
           "PYTHONUNBUFFERED": "1"}
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO,
                                env=env, start_new_session=True)
    handle = ServiceHandle(name, proc, "", -1, log, data_dir)
    deadline = time.monotonic() + timeout
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}")
            if not handle.address:
                report = read_port_file(port_file)
                if report is not None and report["pid"] == proc.pid:
                    handle.address, handle.metrics_port = report["address"], report["metrics_port"]
            if handle.address and check_health(handle.address, timeout=0.5) == "SERVING":
                return handle
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} not SERVING after {timeout:.0f}s")
            time.sleep(0.05)
    except BaseException as e:
        handle.stop(grace=10)
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise RuntimeError(f"{e}; its log ({log}) ends:\n{tail}") from None


def holds_for(predicate, seconds: float, interval: float = 0.05, what: str = "condition") -> None:
    """Check that ``predicate`` stays true for ``seconds`` (failing at the first time it is not).

    For the properties that are about a span of time ("nothing trains while paused"): no event
    marks that nothing happened, so the invariant is watched over the window instead.
    """
    deadline = time.monotonic() + seconds
    while True:
        assert predicate(), f"{what} stopped holding"
        if time.monotonic() >= deadline:
            return
        time.sleep(interval)


# fixtures (of any conftest) that start processes or servers: a test using one is not fast
PROCESS_FIXTURES = frozenset({
    "broker", "stack",                      # here: the embedded broker, every service
    "service", "client",                    # sandbox/inference: the service as a process
    "sandbox", "scorer",                    # reward: the sandbox service; the math verifier's worker pool
    "learner_stack", "run",                 # learner: broker + inference + replay; e2e: `temper run`
    "s3_server", "s3_env",                  # storage: a SeaweedFS S3 server
})


def _starts_processes(item) -> bool:
    if any(item.get_closest_marker(m) for m in ("slow", "e2e", "bench")):
        return True
    if PROCESS_FIXTURES & set(item.fixturenames):
        return True
    params = getattr(getattr(item, "callspec", None), "params", {})
    return params.get("engine") == "vllm"


def pytest_sessionstart(session):
    """Build matplotlib's font cache before any test runs. Its first import on a machine runs
    ``fc-list`` (a subprocess) to list the fonts; a fast test importing it (reasoning-gym does)
    on a fresh machine would otherwise be failed by the guard below for a one-off, machine-level
    cache, not for anything the test starts."""
    try:
        import matplotlib.font_manager  # noqa: F401  (loads or builds the cache)
    except ImportError:
        pass


def pytest_collection_modifyitems(config, items):
    for item in items:
        if not _starts_processes(item):
            item.add_marker(pytest.mark.fast)


def _refuse(what: str):
    def refused(*args, **kwargs):
        raise AssertionError(f"a test marked fast started {what}: mark its module slow "
                             f"(or add its fixture to tests/conftest.py PROCESS_FIXTURES)")
    return refused


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    """While a ``fast`` test sets up (its fixtures of every scope) and runs, starting a process or a
    server fails it, naming what it started. Teardown is not watched: a session fixture of another
    test may be finalised there."""
    if item.get_closest_marker("fast") is not None:
        guard = item.stash[_GUARD] = pytest.MonkeyPatch()
        guard.setattr(subprocess.Popen, "__init__", _refuse("a subprocess"))
        guard.setattr(multiprocessing.process.BaseProcess, "start", _refuse("a multiprocessing worker"))
        guard.setattr(os, "fork", _refuse("a fork"))
        guard.setattr(os, "posix_spawn", _refuse("a process"))
        guard.setattr(grpc, "server", _refuse("a gRPC server"))
        guard.setattr(socket.socket, "listen", _refuse("a listening socket"))
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    guard = item.stash.get(_GUARD, None)
    if guard is not None:
        guard.undo()
    yield


_GUARD = pytest.StashKey[pytest.MonkeyPatch]()
