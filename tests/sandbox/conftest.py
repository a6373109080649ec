"""Fixtures of the sandbox tests: a real sandbox service (real runsc, real gRPC on 127.0.0.1).

Every service a fixture starts it stops by pid, then checks that nothing of it is left: no
process in its cgroups, no cgroup, no state directory.
"""

from __future__ import annotations

import pytest

from tests.sandbox.helpers import assert_clean, client as sandbox_client, start_sandbox


@pytest.fixture(scope="session")
def service(tmp_path_factory):
    """The shared sandbox service: 2 executions at once, 2 queued, 2 sandboxes kept warm."""
    svc = start_sandbox(tmp_path_factory.mktemp("sandbox"), "--max-concurrency", "2", "--max-queue", "2")
    yield svc
    svc.stop()
    assert_clean(svc)


@pytest.fixture(scope="session")
def client(service):
    with sandbox_client(service) as c:
        yield c
