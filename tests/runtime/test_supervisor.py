"""Supervision of the embedded mode with real processes: kill -9 a service, it comes back on its address."""

import json
import os
import signal
import subprocess
import sys

import pytest

from temper import jobs
from temper.runtime.launcher import Launcher, pid_alive
from temper.runtime.rpc import check_health
from temper.runtime.supervisor import Exit, LauncherConfig
from tests.conftest import wait_until

TEMPER = [sys.executable, "-m", "temper.cli.main"]


def _temper(home, *args, check=True, timeout=300):
    return subprocess.run([*TEMPER, "--home", str(home), *args], capture_output=True, text=True, timeout=timeout,
                          check=check)


def _status(home) -> dict[str, dict]:
    return {r["name"]: r for r in json.loads(_temper(home, "status", "--json", check=False).stdout or "[]")}


def _config(tmp_path, launcher_table: str, base: str = "") -> str:
    path = tmp_path / "job.toml"
    path.write_text(base + f"\n[launcher]\n{launcher_table}\n")
    return str(path)


# -- the policy alone -------------------------------------------------------------------------
def test_backoff_doubles_up_to_its_cap():
    policy = LauncherConfig(backoff_seconds=0.5, max_backoff_seconds=3.0)
    assert [policy.delay(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_which_exits_restart():
    killed, crashed, clean, unknown = Exit(signal=signal.SIGKILL), Exit(code=1), Exit(code=0), Exit()
    on_failure = LauncherConfig()
    assert [on_failure.restarts(e) for e in (killed, crashed, clean, unknown)] == [True, True, False, True]
    assert LauncherConfig(restart="always").restarts(clean)
    assert not LauncherConfig(restart="never").restarts(killed)
    assert killed.describe() == "killed by SIGKILL" and crashed.describe() == "exited with code 1"


def test_a_bad_launcher_table_names_the_key():
    with pytest.raises(ValueError, match=r"launcher\.restart"):
        LauncherConfig.from_config({"launcher": {"restart": "sometimes"}}, "job.toml")
    with pytest.raises(ValueError, match=r"launcher\.max_restart\b"):
        LauncherConfig.from_config({"launcher": {"max_restart": 3}}, "job.toml")  # a typo of max_restarts
    assert LauncherConfig.from_config({}, "job.toml") == LauncherConfig()


# -- real processes ---------------------------------------------------------------------------
@pytest.mark.slow
def test_a_crashed_service_is_restarted_on_its_address_and_status_shows_it(tmp_path):
    """`temper up` leaves a detached supervisor; kill -9 of replay: back on the same address, restarts 1."""
    home = tmp_path / "home"
    config = _config(tmp_path, "backoff_seconds = 0.2")
    assert _temper(home, "--config", config, "up", "replay").returncode == 0
    try:
        before = _status(home)["replay"]
        supervisor = json.loads((home / "state.json").read_text())["supervisor_pid"]
        assert pid_alive(supervisor)
        os.kill(before["pid"], signal.SIGKILL)
        after = wait_until(lambda: (r := _status(home)["replay"])["restarts"] == 1 and r["health"] == "SERVING" and r,
                           120, interval=0.2, what="replay restarted")
        assert after["pid"] != before["pid"] and after["address"] == before["address"]
        assert "(last: exited" in _temper(home, "status").stdout  # not our child: its status is unknown
    finally:
        _temper(home, "down")
    assert not pid_alive(supervisor) and not pid_alive(after["pid"])


@pytest.mark.slow
def test_temper_restart_works_on_a_crashed_service(tmp_path):
    """The issue's case: the dead child of the process that ran `up` (a zombie until reaped) must not look alive;
    with restart = "never" the supervisor marks it FAILED, and `temper restart` brings it back."""
    home = tmp_path / "home"
    launcher = Launcher(home=home, config=_config(tmp_path, 'restart = "never"'))
    state = launcher.up(["replay"])
    try:
        old = state.services["replay"]
        os.kill(old.pid, signal.SIGKILL)
        failed = wait_until(lambda: (r := _status(home)["replay"])["health"] == "FAILED" and r, 60,
                            interval=0.2, what="replay marked failed")
        assert "killed by SIGKILL" in failed["failed"] and 'restart = "never"' in failed["failed"]
        with pytest.raises(RuntimeError, match="replay killed by SIGKILL"):
            launcher.raise_if_failed()  # what `temper run` calls while it follows a job
        r = _temper(home, "restart", "replay")
        assert r.returncode == 0, r.stderr
        row = _status(home)["replay"]
        assert row["health"] == "SERVING" and row["address"] == old.address and row["pid"] != old.pid
        assert not row["failed"] and check_health(old.address) == "SERVING"
        launcher.raise_if_failed()
    finally:
        launcher.down()


def _kill_mid_job(tmp_path, service: str, launcher_table: str, steps: int):
    """`temper run` of the toy job for ``steps`` steps; ``service`` SIGKILLed by PID at step 3. Returns home, the
    run's summary.json (the run must exit 0)."""
    home, runs = tmp_path / "home", tmp_path / "runs"
    config = _config(tmp_path, launcher_table, base=jobs.path("toy").read_text())
    with open(tmp_path / "run.out", "w") as out:
        run = subprocess.Popen([*TEMPER, "--home", str(home), "--config", config, "run", "--steps", str(steps),
                                "--runs", str(runs)], stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: "step    3" in (tmp_path / "run.out").read_text() or run.poll() is not None, 300,
                   interval=0.2, what="step 3")
        victim = _status(home)[service]
        os.kill(victim["pid"], signal.SIGKILL)
        restarted = wait_until(lambda: (r := _status(home).get(service, {})).get("restarts") == 1 and r
                               or run.poll() is not None, 300, interval=0.2, what=f"{service} restarted")
        assert run.wait(600) == 0, (tmp_path / "run.out").read_text()[-3000:]
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
            Launcher(home=home).down()
    assert restarted is not True, "the job ended before status showed the restart"
    assert restarted["last_exit"] == "killed by SIGKILL" and restarted["pid"] != victim["pid"]
    return home, json.loads((runs / "latest" / "summary.json").read_text())


@pytest.mark.e2e
def test_kill_9_of_reward_mid_job_the_job_finishes_every_step(tmp_path):
    """A real job on the tiny model; reward is SIGKILLed at step 3. The supervisor restarts it (status shows it);
    the rollouts it had not committed are redelivered to its successor, so every step still trains on all its
    groups (with max_policy_lag = 0 a single lost group would stall the job for good).

    The stack runs with [auth] mode = "token" (one job run serves both checks): every service-to-service call
    of the loop authenticates, the restarted reward included."""
    steps = 12
    home, summary = _kill_mid_job(tmp_path, "reward", 'backoff_seconds = 0.2\n\n[auth]\nmode = "token"', steps)
    job = summary["job"]
    assert [s["policy_version"] for s in summary["steps"]] == list(range(1, steps + 1))
    assert all(s["samples"] == job["prompts_per_step"] * job["group_size"] for s in summary["steps"])
    assert "reward (pid" in (home / "logs" / "supervisor.log").read_text()
    assert '"auth": "token"' in (home / "logs" / "reward.log").read_text()


@pytest.mark.e2e
def test_kill_9_of_the_scheduler_mid_job_the_job_resumes_and_trains_every_version_once(tmp_path):
    """A real job on the tiny model; the scheduler is SIGKILLed at step 3. The supervisor restarts it; the new
    scheduler resumes the job from its saved state (jobs.sqlite), the CLI's follow loop waits out the minutes
    the scheduler was unavailable, and the job finishes: every policy version 1..N trained exactly once on a
    whole step's samples, no step generated twice, no evaluation repeated, nothing counted twice."""
    steps = 12
    home, summary = _kill_mid_job(tmp_path, "scheduler", "backoff_seconds = 0.2", steps)
    assert "job resumed from its saved state" in (home / "logs" / "scheduler.log").read_text()
    job = summary["job"]
    n = job["prompts_per_step"]
    assert [s["policy_version"] for s in summary["steps"]] == list(range(1, steps + 1))
    assert all(s["samples"] == n * job["group_size"] for s in summary["steps"])
    assert summary["job_state"] == "JOB_STATE_DONE"
    assert (summary["steps_done"], summary["groups_published"]) == (steps, steps * n)
    sampling = summary["sampling"]
    assert sum(d["drawn"] for d in sampling["domains"]) == steps * n  # the interrupted step's draws count once
    assert sum(d["groups"] for d in sampling["domains"]) == sampling["groups_scored"] <= steps * n
    assert [e["phase"] for e in summary["eval"]["evals"]] == ["before", "final"]


@pytest.mark.slow
def test_temper_restart_sees_an_unreaped_dead_child_as_dead(tmp_path):
    """Without supervision the killed child stays a zombie of the process that ran `up`: `temper restart` from
    another process used to refuse with "still running"."""
    launcher = Launcher(home=tmp_path / "home", config=_config(tmp_path, ""))
    state = launcher.up(["replay"], supervise="off")
    try:
        old = state.services["replay"]
        os.kill(old.pid, signal.SIGKILL)
        wait_until(lambda: not pid_alive(old.pid), 30, what="replay gone (a zombie)")
        r = _temper(tmp_path / "home", "restart", "replay")
        assert r.returncode == 0, r.stderr
        assert check_health(old.address) == "SERVING"
    finally:
        launcher.down()
