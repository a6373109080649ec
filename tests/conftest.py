"""Shared fixtures: a real broker, a real local stack of services, all on 127.0.0.1.

Everything a fixture starts it stops, by PID (the launcher records them).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from temper.runtime.broker import free_port, start_broker
from temper.runtime.launcher import Launcher, pid_alive

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def broker(tmp_path):
    """A fresh embedded Kafka-compatible broker; yields its bootstrap address."""
    port = free_port()
    proc = start_broker(port, tmp_path / "broker.log")
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
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
