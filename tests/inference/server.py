"""Start one inference service as its own process on 127.0.0.1 (as the launcher does) and stop it by PID."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from temper.runtime.broker import free_port
from temper.runtime.rpc import check_health


@contextlib.contextmanager
def inference_server(model_dir, engine: str, log: Path, *flags: str, timeout: float = 240.0):
    """Yields the address of a SERVING inference service; SIGTERM (then SIGKILL) on exit."""
    port = free_port()
    args = [sys.executable, "-m", "temper.inference", "--host", "127.0.0.1", "--port", str(port),
            "--metrics-port", "-1", "--model-dir", str(model_dir), "--engine", engine, *flags]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1"}
    with open(log, "ab") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while check_health(address) != "SERVING":
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = "\n".join(Path(log).read_text(errors="replace").splitlines()[-30:])
                raise AssertionError(f"inference ({engine}) did not come up (exit {proc.poll()}):\n{tail}")
            time.sleep(0.2)
        yield address, proc
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(10)
