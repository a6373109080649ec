"""``python -m temper.cli.submit`` reads a job file as ``temper run`` does: its eval, sampling and step_labels
tables, and a mistake named before anything is submitted."""

import tomllib

import pytest

from temper.cli.submit import job_of, main
from temper.jobs import path as job_path


def test_a_shipped_job_with_eval_and_sampling_tables_becomes_its_spec(tmp_path):
    source = job_path("smollm2")
    config = tomllib.loads(source.read_text())
    config["job"]["step_labels"] = {"k": 2}  # temper prm's table: not the scheduler's
    spec = job_of(config, source, job_id="nightly-1")
    assert spec.job_id == "nightly-1" and spec.eval.size == config["job"]["eval"]["size"] > 0
    assert spec.eval.samples == config["job"]["eval"]["samples"] and spec.domains == config["job"]["domains"]
    assert job_of({"job": {"steps": 3}}, tmp_path / "job.toml").job_id.startswith("job-")


@pytest.mark.parametrize("job,key", [({"stpes": 3}, "job.stpes"), ({"eval": {"size": -1}}, "eval.size"),
                                     ({"stop": [""]}, "stop")])
def test_a_bad_job_table_is_refused_naming_the_key(tmp_path, capsys, job, key):
    config = tmp_path / "job.toml"
    config.write_text("[job]\n" + "".join(f"{k} = {v!r}\n" for k, v in job.items() if not isinstance(v, dict))
                      + "".join(f"[job.{k}]\n" + "".join(f"{a} = {b}\n" for a, b in v.items())
                                for k, v in job.items() if isinstance(v, dict)))
    rc = main(["--config", str(config), "--scheduler", "127.0.0.1:1", "--kafka-bootstrap", "127.0.0.1:1"])
    assert rc == 1 and key in capsys.readouterr().err


@pytest.mark.slow  # a whole stack (tiny model) and the submit command against it, as the Kubernetes Job runs it
def test_submit_runs_a_job_with_an_evaluation_on_a_running_stack_and_writes_its_report(tmp_path):
    import json
    import subprocess
    import sys

    from temper.runtime.launcher import Launcher

    from tests.e2e.jobfiles import edit_job

    config = tmp_path / "job.toml"
    config.write_text(edit_job(job_path("toy").read_text(), {("job", "steps"): "3", ("job.eval", "size"): "8"}))
    launcher = Launcher(home=tmp_path / "home", config=config)
    state = launcher.up(timeout=300)
    try:
        proc = subprocess.run([sys.executable, "-m", "temper.cli.submit", "--config", str(config), "--job-id", "sub-1",
                               "--scheduler", state.services["scheduler"].address, "--kafka-bootstrap",
                               state.broker.address, "--learner", state.services["learner"].address,
                               "--report-url", str(tmp_path / "reports"), "--timeout", "600"],
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        summary = json.loads((tmp_path / "reports" / "sub-1" / "summary.json").read_text())
        assert summary["job_state"] == "JOB_STATE_DONE" and len(summary["steps"]) == 3
        assert summary["eval"]["before"]["policy_version"] == 0 and summary["eval"]["after"]["policy_version"] == 3
        assert "final policy: checkpoint" in proc.stdout
    finally:
        launcher.down()
