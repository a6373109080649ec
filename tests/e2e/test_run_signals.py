"""`temper run` stopped by a signal (a CI timeout, `kill`, a closed terminal) stops every service it started."""

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.conftest import wait_until

pytestmark = pytest.mark.e2e


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not yet reaped) is not running
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signalled_run_stops_its_services(tmp_path, sig):
    home = tmp_path / "home"
    proc = subprocess.Popen([sys.executable, "-m", "temper.cli.main", "--home", str(home), "run", "--job", "toy",
                             "--steps", "100000", "--runs", str(tmp_path / "runs")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        for line in proc.stdout:  # "up in ...": every service is serving and recorded in state.json
            if line.startswith("up in"):
                break
        state = json.loads((home / "state.json").read_text())
        pids = [s["pid"] for s in state["services"].values()] + [state["broker"]["pid"]]
        assert pids and all(_alive(p) for p in pids)
        proc.send_signal(sig)
        proc.wait(timeout=120)
        wait_until(lambda: not any(_alive(p) for p in pids), timeout=60, what="every service stopped")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
