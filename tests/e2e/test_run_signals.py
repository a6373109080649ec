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


def test_a_run_past_its_job_timeout_reports_what_it_did_and_fails(tmp_path):
    """The job timeout ends the run with an error, a report of the steps so far (marked incomplete), and every
    service stopped."""
    home, runs = tmp_path / "home", tmp_path / "runs"
    proc = subprocess.run([sys.executable, "-m", "temper.cli.main", "--home", str(home), "run", "--job", "toy",
                           "--steps", "100000", "--job-timeout", "20", "--runs", str(runs)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "of 100000 steps after 20s" in proc.stderr and "partial report" in proc.stdout
    summary = json.loads((runs / "latest" / "summary.json").read_text())
    assert summary["incomplete"].endswith("of 100000 steps after 20s")
    assert summary["job"]["steps"] == 100000 and summary["job_state"] in ("JOB_STATE_RUNNING", "JOB_STATE_STOPPED")
    assert [s["step"] for s in summary["steps"]] == sorted(s["step"] for s in summary["steps"])
    assert (runs / "latest" / "reward_curve.png").stat().st_size > 0
    assert not (home / "state.json").exists()  # the run took its stack down (down() removes it last)
