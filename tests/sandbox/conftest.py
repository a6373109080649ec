"""Fixtures of the sandbox tests: real sandbox services (real runsc, real gRPC on 127.0.0.1).

Every service a fixture starts it stops by pid, then checks that nothing of it is left: no
process in its cgroups, no cgroup, no state directory.
"""

from __future__ import annotations

import pytest

from tests.sandbox.helpers import assert_clean, start_sandbox
from tests.sandbox.helpers import client as sandbox_client


@pytest.fixture(scope="session")
def isolated_service(tmp_path_factory):
    """The shared sandbox service: isolated mode, 2 executions at once, 2 queued, 2 sandboxes kept warm."""
    svc = start_sandbox(tmp_path_factory.mktemp("sandbox"), "--max-concurrency", "2", "--max-queue", "2")
    yield svc
    svc.stop()
    assert_clean(svc)


@pytest.fixture(scope="session")
def batch_service(tmp_path_factory):
    """The same in batch mode (a sandbox per RunTestsBatch group), with a small /work and /tmp (64 MiB)
    so that filling them is quick."""
    svc = start_sandbox(tmp_path_factory.mktemp("sandbox-batch"), "--max-concurrency", "2", "--max-queue", "2",
                        "--execution-mode", "batch", "--workdir-mb", "64")
    yield svc
    svc.stop()
    assert_clean(svc)


@pytest.fixture(scope="session")
def service(isolated_service):
    return isolated_service


@pytest.fixture(scope="session")
def client(service):
    with sandbox_client(service) as c:
        yield c


@pytest.fixture(scope="session")
def batch_client(batch_service):
    with sandbox_client(batch_service) as c:
        yield c
