"""`temper monitor` against a real job: every service as a process, the tiny model's short job. Its
`--once --json` frame, taken while the job is held (paused, everything it published trained on and
recorded) and again once it is done, shows the same figures the scheduler (JobStatus), the
monitor (ListSteps, ListAlerts), the learner and replay report; a service that is stopped shows as
such, and the rest of the view stays."""

import json
import os
import subprocess
import sys

import pytest

from temper import jobs
from temper.client.sdk import LearnerClient, MonitorClient, ReplayClient, SchedulerClient
from temper.runtime.launcher import Launcher, pid_alive
from temper.scheduler.core import JobSpec
from temper.v1 import scheduler_pb2
from tests.conftest import wait_until

pytestmark = pytest.mark.e2e
STEPS = 8
# a rule every learner step from the third on breaks (entropy "collapses" below 10 x its median): alerts to show
ALWAYS_ALERT = """
[monitor.detectors.training_signal]
spike_keys = []
collapse_keys = ["entropy"]
min_history = 2
collapse_ratio = 10.0
cooldown_steps = 1
"""


def _config(tmp) -> str:
    text = jobs.path("toy").read_text()
    for old, new in (("steps = 150", f"steps = {STEPS}"), ("prompts_per_step = 16", "prompts_per_step = 4"),
                     ("group_size = 8", "group_size = 4"), ("size = 100", "size = 10"), ("every = 50", "every = 4")):
        assert old in text
        text = text.replace(old, new, 1)
    path = tmp / "job.toml"
    path.write_text(text + ALWAYS_ALERT)
    return path


def temper_monitor(home, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "temper.cli.main", "--home", str(home), "monitor", *args],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})


def frame(home) -> dict:
    p = temper_monitor(home, "--once", "--json")
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-3000:]
    return json.loads(p.stdout)


def temper_report(home, job_id, out) -> dict:
    p = subprocess.run([sys.executable, "-m", "temper.cli.main", "--home", str(home), "report", job_id, "--out", str(out)],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0 and f"job {job_id} (done): {STEPS} learner steps" in p.stdout, p.stdout + p.stderr[-3000:]
    return json.loads((out / "report.json").read_text())


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    base = tmp_path_factory.mktemp("monview")
    launcher = Launcher(home=base / "home", config=_config(base))
    state = launcher.up()
    pids = [p.pid for p in state.services.values()] + [state.broker.pid]
    addr = {n: p.address for n, p in state.services.items()}
    with SchedulerClient(addr["scheduler"]) as s, MonitorClient(addr["monitor"]) as m, \
            LearnerClient(addr["learner"]) as lr, ReplayClient(addr["replay"]) as rp:
        yield launcher, s, m, lr, rp
    launcher.down()
    assert not [p for p in pids if pid_alive(p)], "processes left behind"


def check_against_the_services(view, job_id, scheduler, monitor, learner, replay):
    status = scheduler.job(job_id)
    assert view["services"] == dict.fromkeys(("scheduler", "monitor", "learner", "replay"), "up")
    j = view["job"]
    assert (j["job_id"], j["steps_done"], j["steps"], j["groups_published"], j["groups_scored"]) == \
        (job_id, status.steps_done, STEPS, status.groups_published, status.groups_scored)
    assert j["state"] == scheduler_pb2.JobState.Name(status.state).removeprefix("JOB_STATE_").lower()
    series = {s.domain: s.steps for s in monitor.list_steps(job_id)}
    shown = {d["domain"]: d for d in view["domains"]}
    assert list(shown) == ["toy.copy", "toy.next"]
    by_domain = {d.domain: d for d in status.domains}
    for name, d in shown.items():
        last = series[name][-1]
        assert (d["step"], d["reward"], d["length"], d["samples"]) == \
            (last.step, last.values["reward"], last.values["length"], last.samples)
        assert (d["recent_reward"], d["pass_rate"], d["weight"]) == \
            (by_domain[name].mean_reward, by_domain[name].pass_rate, by_domain[name].weight)
        assert d["accuracy"] == status.evals[-1].accuracy[name]
    assert view["eval"]["phase"] == status.evals[-1].phase
    ls = learner.status()
    assert (view["learner"]["step"], view["learner"]["policy_version"]) == (ls.step, ls.policy_version)
    assert view["learner"]["signals"]["entropy"] == ls.last.values["entropy"]
    assert view["learner"]["policy_lag"] == 0.0  # max_policy_lag 0: each step trained on the version before it
    metrics = series["*"][-10:]
    assert view["throughput"]["steps_per_minute"] == pytest.approx(
        60 * len(metrics) / sum(p.values["step_seconds"] for p in metrics))
    assert view["replay"]["size"] == replay.stats().size
    assert [a["alert_id"] for a in view["alerts"]] == [a.alert_id for a in monitor.list_alerts(job_id=job_id)][::-1][:5]
    return status


def test_monitor_view_matches_the_services_while_held_and_when_done(stack):
    launcher, scheduler, monitor, learner, replay = stack
    spec = JobSpec.from_dict(launcher.config()["job"])
    job_id = scheduler.start_job(spec.to_proto()).job_id
    wait_until(lambda: scheduler.job(job_id).steps_done >= 2, 300, 0.2, "two steps")
    scheduler.pause_job(job_id, "held by the test")

    def settled():  # the step in flight finished, trained, and both series recorded it
        s = scheduler.job(job_id)
        by = {x.source: x.steps for x in monitor.list_steps(job_id)}
        return (s.state == scheduler_pb2.JOB_STATE_PAUSED and learner.status().step == s.steps_done
                and s.groups_scored == s.groups_published and by.get("metrics")
                and by["metrics"][-1].step == s.steps_done
                and max(x.steps[-1].step for x in monitor.list_steps(job_id) if x.source == "scored") == s.steps_done - 1)

    wait_until(settled, 120, 0.2, "the paused job to settle")
    held = frame(launcher.home)  # one step after another: the one job running, picked without --job
    status = check_against_the_services(held, job_id, scheduler, monitor, learner, replay)
    assert held["job"]["state"] == "paused" and held["job"]["pause_reason"] == "held by the test"
    assert 2 <= status.steps_done < STEPS

    scheduler.resume_job(job_id)
    wait_until(lambda: scheduler.job(job_id).state == scheduler_pb2.JOB_STATE_DONE, 300, 0.2, "the job done")
    wait_until(lambda: any(x.source == "metrics" and x.steps[-1].step == STEPS for x in monitor.list_steps(job_id)),
               60, 0.2, "the last learner step recorded")
    done = frame(launcher.home)
    check_against_the_services(done, job_id, scheduler, monitor, learner, replay)
    assert done["job"]["state"] == "done" and done["job"]["steps_done"] == STEPS
    assert done["eval"]["phase"] == "final" and done["eval"]["policy_version"] == STEPS
    assert done["throughput"]["tokens_per_second"] > 0
    newest = done["alerts"][0]
    assert len(done["alerts"]) == 5 and newest["alert_id"] == f"{job_id}/*/training_signal/{STEPS}"
    assert (newest["detector"], newest["severity"], newest["policy"]) == ("training_signal", "warning", "warn")
    assert newest["evidence"].startswith(f"steps 1-{STEPS}; latest=") and "entropy collapsed" in newest["message"]

    plain = temper_monitor(launcher.home, "--once", "--job", job_id)  # not a terminal: plain text
    assert plain.returncode == 0 and "\x1b[" not in plain.stdout, plain.stderr[-2000:]
    assert f"job {job_id}  DONE  step {STEPS}/{STEPS}" in plain.stdout
    reward = f"{done['domains'][0]['reward']:.3f}"
    assert any("toy.copy" in line and reward in line for line in plain.stdout.splitlines()), plain.stdout
    assert any("training_signal" in line and "warn" in line and newest["evidence"] in line
               for line in plain.stdout.splitlines()), plain.stdout

    # `temper report JOB`: the monitor's curves and alerts and the scheduler's evaluations, as files
    out = launcher.home / "report"
    written = temper_report(launcher.home, job_id, out)
    series = monitor.list_steps(job_id, last=1000)
    learner_series = next(s.steps for s in series if s.source == "metrics")
    assert written["learner"]["entropy"] == [[p.step, p.values["entropy"]] for p in learner_series]
    assert written["learner"]["mean_reward"][-1] == [STEPS, learner_series[-1].values["mean_reward"]]
    for s in series:
        if s.source == "scored":
            assert written["scored"][s.domain]["reward"] == [[p.step, p.values["reward"]] for p in s.steps]
    assert [a["alert_id"] for a in written["alerts"]] == [a.alert_id for a in monitor.list_alerts(job_id=job_id)]
    assert [(e["phase"], e["policy_version"], e["accuracy"]) for e in written["evals"]] == \
        [(e.phase, e.policy_version, dict(e.accuracy)) for e in scheduler.job(job_id).evals]
    assert written["state"] == "done" and written["summary"]["alerts"] == {"training_signal": len(written["alerts"])}
    for png in ("reward_curve.png", "training.png", "eval_accuracy.png"):
        assert (out / png).stat().st_size > 0
    assert list((out / "tb").glob("events.out.tfevents.*"))
    launcher.restart("monitor")  # the curves and alerts are durable: the same report from a new monitor process
    again = temper_report(launcher.home, job_id, out)
    assert (again["learner"], again["scored"], again["alerts"]) == \
        (written["learner"], written["scored"], written["alerts"])

    launcher.stop_service("monitor")  # a missing service: named in the view, the rest still there
    gone = frame(launcher.home)
    assert gone["services"]["monitor"] == "stopped" and gone["alerts"] == []
    assert gone["job"]["steps_done"] == STEPS and gone["domains"][0]["reward"] is None
    assert gone["domains"][0]["recent_reward"] == done["domains"][0]["recent_reward"]
    p = temper_monitor(launcher.home, "--once")
    assert p.returncode == 0 and "Traceback" not in p.stderr and "stopped" in p.stdout, p.stdout + p.stderr
