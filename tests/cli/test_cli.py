"""The `temper` command as a person types it: each paper cut of the first hour reproduced."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from temper.sandbox.core import load_languages

pytestmark = pytest.mark.slow  # runs the `temper` command as a process

TEMPER = [sys.executable, "-m", "temper.cli.main"]


def temper(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*TEMPER, *args], capture_output=True, text=True, timeout=timeout)


def test_version():
    p = temper("--version")
    assert p.returncode == 0 and p.stdout.startswith("temper 0.")


@pytest.mark.parametrize("where", ["before", "after"])
def test_global_options_before_or_after_the_subcommand(tmp_path, where):
    bad = tmp_path / "my.toml"
    bad.write_text("[job]\nsteps = 3\nprompt_per_step = 4\n")  # a typo a person makes
    opts = ["--config", str(bad), "--home", str(tmp_path / "home")]
    p = temper(*opts, "run") if where == "before" else temper("run", *opts)
    assert p.returncode == 1
    assert "unrecognized arguments" not in p.stderr and "Traceback" not in p.stderr
    assert "[job] has unknown key(s) job.prompt_per_step" in p.stderr and "prompts_per_step" in p.stderr
    assert not (tmp_path / "home" / "state.json").exists()  # refused before anything started


def test_job_value_error_names_table_and_key(tmp_path):
    bad = tmp_path / "my.toml"
    bad.write_text("[job]\nsteps = 0\n")
    p = temper("run", "--config", str(bad), "--home", str(tmp_path / "home"))
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert "[job] steps: must be in [1," in p.stderr


def test_status_after_subcommand(tmp_path):
    p = temper("status", "--home", str(tmp_path / "nothing"))
    assert p.returncode == 1 and p.stdout.strip() == "nothing is up"


def test_languages_lists_aliases():
    p = temper("sandbox", "languages")
    assert p.returncode == 0
    rows = {line.split()[0]: line for line in p.stdout.splitlines()}
    assert {"python3", "c", "cpp", "bash"} <= set(rows)
    assert "python, py" in rows["python3"] and "c++" in rows["cpp"] and "sh" in rows["bash"]


def test_alias_resolves_to_the_same_language_and_collisions_are_refused():
    tables = {"python3": {"source_file": "main.py", "run": ["python3", "main.py"], "aliases": ["python", "py"]}}
    langs = load_languages(tables)
    assert langs["python"] is langs["python3"] and langs["py"].name == "python3"
    tables["other"] = {"source_file": "x", "run": ["x"], "aliases": ["py"]}
    with pytest.raises(ValueError, match="'py' names both 'python3' and 'other'"):
        load_languages(tables)


def test_sandbox_exec_with_language_python(tmp_path):
    """`temper sandbox exec --language python prog.py` (the alias every other tool accepts), no stack up."""
    prog = tmp_path / "prog.txt"  # an extension that says nothing: the alias decides
    prog.write_text("print(6 * 7)\n")
    p = temper("--home", str(tmp_path / "home"), "sandbox", "exec", "--language", "python", str(prog), timeout=180)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["status"] == "OK" and out["stdout"] == "42\n"


def test_doctor_passes_here_and_names_a_missing_model(tmp_path):
    p = temper("doctor", "--home", str(tmp_path / "home"))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "everything Temper needs is here" in p.stdout
    cfg = tmp_path / "job.toml"
    cfg.write_text(f'[model]\ndir = "{tmp_path / "no-such-model"}"\n')
    p = temper("doctor", "--config", str(cfg), "--home", str(tmp_path / "home"))
    assert p.returncode == 1
    line = next(line for line in p.stdout.splitlines() if "model" in line and "FAIL" in line)
    assert "no-such-model" in line and "no config.json" in line
    assert "fix:" in p.stdout


def test_doctor_reports_a_dead_recorded_service(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (home / "state.json").write_text(json.dumps({"home": str(home), "config": "", "broker": None, "services": {
        "replay": {"name": "replay", "pid": dead.pid, "address": "127.0.0.1:1", "log": str(home / "r.log")}}}))
    p = temper("doctor", "--home", str(home))
    assert p.returncode == 1 and "replay recorded" in p.stdout and f"temper --home {home} down" in p.stdout


def test_cli_help_lists_every_command():
    p = temper("--help")
    assert p.returncode == 0
    for cmd in ("up", "status", "down", "restart", "run", "doctor", "sandbox"):
        assert cmd in p.stdout
    assert Path(TEMPER[0]).exists()
