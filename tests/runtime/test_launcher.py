"""`temper up` / `status` / `down` as a user runs them: real processes, real health checks."""

import json
import os
import subprocess
import sys

import pytest

from temper.runtime.launcher import SERVICES, pid_alive

pytestmark = pytest.mark.slow  # `temper up` starts every service

TEMPER = [sys.executable, "-m", "temper.cli.main"]


def _temper(home, *args, check=True):
    return subprocess.run([*TEMPER, "--home", str(home), *args], capture_output=True, text=True, timeout=300,
                          check=check)


def _sessions_alive(pids: list[int]) -> list[str]:
    """Processes still in any of the sessions the launcher created (each service leads one)."""
    left = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[3]) in pids and fields[0] != "Z":  # fields[3] = session id
                    left.append(entry)
            except (OSError, IndexError):
                pass
    return left


def test_up_status_down_leaves_nothing(tmp_path):
    up = _temper(tmp_path, "up")
    assert up.returncode == 0, up.stderr
    rows = json.loads(_temper(tmp_path, "status", "--json").stdout)
    assert {r["name"] for r in rows} == {"broker", "supervisor", *SERVICES}  # supervisor: restarts crashed ones
    assert all(r["health"] in ("SERVING", "RUNNING") for r in rows), rows
    assert _temper(tmp_path, "status").returncode == 0
    again = _temper(tmp_path, "up", check=False)  # a second `up` refuses, and harms nothing
    assert again.returncode == 1 and "already up" in again.stderr
    pids = [r["pid"] for r in rows]
    down = _temper(tmp_path, "down")
    assert "stopped" in down.stdout
    assert not [p for p in pids if pid_alive(p)]
    assert not _sessions_alive(pids)
    assert _temper(tmp_path, "status", check=False).returncode == 1  # "nothing is up"


def test_up_named_services_only(tmp_path):
    assert _temper(tmp_path, "up", "replay", "reward").returncode == 0
    rows = json.loads(_temper(tmp_path, "status", "--json").stdout)
    assert {r["name"] for r in rows} == {"broker", "supervisor", "replay", "reward"}
    pids = [r["pid"] for r in rows]
    _temper(tmp_path, "down")
    assert not [p for p in pids if pid_alive(p)]


def test_unknown_service_is_refused(tmp_path):
    r = _temper(tmp_path, "up", "nope", check=False)
    assert r.returncode != 0 and "nope" in r.stderr
    assert not (tmp_path / "state.json").exists()


def test_up_replay_builds_no_model_records_reported_ports_and_restart_keeps_them(tmp_path):
    from temper.runtime.launcher import Launcher
    from temper.runtime.rpc import check_health

    config = tmp_path / "temper.toml"
    config.write_text(f'[model]\ndir = "{tmp_path / "model"}"\n\n[replay]\n')
    launcher = Launcher(home=tmp_path / "home", config=config)
    try:
        state = launcher.up(["replay"])
        assert not (tmp_path / "model").exists()  # replay declares no model_dir: none is resolved or built
        replay = state.services["replay"]
        saved = json.loads((tmp_path / "home" / "state.json").read_text())["services"]["replay"]
        assert saved["address"] == replay.address and saved["metrics_port"] == replay.metrics_port > 0
        assert replay.address.startswith("127.0.0.1:") and "--port" in replay.args
        assert replay.args[replay.args.index("--port") + 1] == "0"  # bound by the service, reported in its port file
        restarted = launcher.restart("replay", kill=True)
        assert restarted.pid != replay.pid and restarted.address == replay.address
        assert restarted.metrics_port == replay.metrics_port and check_health(restarted.address) == "SERVING"
    finally:
        launcher.down()
