"""`temper monitor`'s two halves alone: the rendering of a fixed snapshot (what a person reads, as
plain text and as the terminal's rich tables), the JSON of it, and gathering when nothing answers."""

import io
import json

from rich.console import Console

from temper.cli import monitor
from temper.cli.monitor import AlertView, DomainView, Snapshot
from temper.runtime.launcher import Proc, State
from temper.v1 import monitor_pb2, scheduler_pb2

SNAP = Snapshot(
    taken_unix=1_700_000_000.0, home="/tmp/h",
    services={"scheduler": "up", "monitor": "up", "learner": "up", "replay": "not running"},
    job={"job_id": "job-7", "state": "paused", "steps_done": 12, "steps": 40, "groups_published": 48,
         "groups_scored": 47, "max_policy_lag": 1, "pause_reason": "monitor alert job-7/toy.copy/reward_vs_gold/11",
         "error": ""},
    domains=[DomainView("toy.copy", step=11, reward=0.625, length=5.5, samples=16, recent_reward=0.5,
                        pass_rate=0.4375, weight=0.5, accuracy=0.31),
             DomainView("toy.next", recent_reward=0.25, pass_rate=0.125, weight=0.5)],
    learner={"step": 12, "policy_version": 12, "paused": False, "job_id": "job-7", "policy_lag": 0.75,
             "policy_lag_max": 1, "signals": {"kl_ref": 0.0123, "entropy": 1.875}},
    throughput={"steps": 10, "steps_per_minute": 42.5, "tokens_per_second": 1234.4, "train_tokens_per_second": 5000.0},
    eval={"phase": "during", "policy_version": 8, "problems": 20, "accuracy": {"toy.copy": 0.31}},
    alerts=[AlertView("job-7/toy.copy/reward_vs_gold/11", 11, "toy.copy", "reward_vs_gold", "critical", "pause",
                      "job job-7 JOB_STATE_PAUSED", "reward rose 0.31 while heldout fell",
                      "steps 3-11; gold_rise=-0.02 proxy_rise=0.31; e.g. job-7/s11/p0/3")])


def _text(snap: Snapshot, terminal: bool) -> str:
    out = io.StringIO()
    console = Console(file=out, width=200, force_terminal=terminal, color_system="standard" if terminal else None)
    monitor.print_frame(snap, console)
    return out.getvalue()


def test_plain_frame_shows_every_figure_of_the_snapshot():
    text = _text(SNAP, terminal=False)
    assert "\x1b[" not in text and text.isascii()  # a pipe or a file gets plain ASCII
    lines = text.splitlines()
    assert "job job-7  PAUSED  step 12/40  groups 48 published, 47 scored" in text
    assert "paused: monitor alert job-7/toy.copy/reward_vs_gold/11" in text
    copy = next(line for line in lines if "toy.copy" in line and "0.625" in line)
    for figure in ("11", "0.625", "0.500", "0.438", "0.310", "5.5", "0.50"):
        assert figure in copy, (figure, copy)
    nxt = next(line for line in lines if "toy.next" in line)
    assert "0.250" in nxt and "0.125" in nxt and nxt.count(" - ") >= 3  # no closed step, no eval yet: shown as "-"
    assert "during eval, policy v8" in text
    training = next(line for line in lines if "0.0123" in line)
    for figure in ("v12", "0.75/1 (<= 1)", "1.875", "42.5", "1234", "5000"):
        assert figure in training, (figure, training)
    assert "replay" in text and "not running" in text  # the missing service is named, its figure is "-"
    alert = next(line for line in lines if "reward_vs_gold" in line and "critical" in line)
    assert "pause -> job job-7 JOB_STATE_PAUSED" in alert and "proxy_rise=0.31" in alert and "job-7/s11/p0/3" in alert


def test_terminal_frame_is_styled_and_lists_no_service_rows_when_all_are_up():
    snap = Snapshot(**{**SNAP.__dict__, "services": dict.fromkeys(monitor.SERVICES, "up"), "alerts": []})
    text = _text(snap, terminal=True)
    assert "\x1b[" in text
    assert "not running" not in text and "no alerts" in text and "toy.copy" in text


def test_a_job_with_adapters_shows_each_domains_adapter():
    assert "adapter" not in _text(SNAP, terminal=False)  # one shared policy: no column
    domains = [DomainView("toy.copy", weight=0.5, adapter="copying"), DomainView("toy.next", weight=0.5)]
    lines = _text(Snapshot(**{**SNAP.__dict__, "domains": domains}), terminal=False).splitlines()
    assert any("adapter" in line and "weight" in line for line in lines)
    cells = {line.split("|")[1].strip(): [c.strip() for c in line.strip(" |").split("|")] for line in lines
             if line.startswith("| toy.")}
    assert cells["toy.copy"][-2:] == ["0.50", "copying"] and cells["toy.next"][-2:] == ["0.50", "(base)"]


def test_json_is_the_snapshot():
    data = json.loads(monitor.to_json(SNAP))
    assert data["job"]["steps_done"] == 12 and data["services"]["replay"] == "not running"
    assert data["domains"][0] == {"domain": "toy.copy", "step": 11, "reward": 0.625, "length": 5.5, "samples": 16,
                                  "recent_reward": 0.5, "pass_rate": 0.4375, "weight": 0.5, "accuracy": 0.31,
                                  "adapter": ""}
    assert data["alerts"][0]["policy"] == "pause" and data["throughput"]["steps_per_minute"] == 42.5


def test_evidence_summary():
    e = monitor_pb2.AlertEvidence(first_step=3, last_step=11, steps=list(range(3, 12)),
                                  values={"proxy_rise": 0.3141, "gold_rise": -0.02},
                                  trajectory_ids=["a/1", "a/2", "a/3"])
    assert monitor.evidence_summary(e) == "steps 3-11; gold_rise=-0.02 proxy_rise=0.314; e.g. a/1, a/2"
    e = monitor_pb2.AlertEvidence(first_step=1, last_step=2, steps=[1, 2],
                                  series=[monitor_pb2.EvidenceSeries(name="kl_ref", values=[0.1, 0.9])])
    assert monitor.evidence_summary(e) == "steps 1-2; series kl_ref"


def test_throughput_over_the_window():
    points = [monitor_pb2.StepPoint(step=k, values={"step_seconds": 2.0, "tokens": 100.0, "tokens_per_second": 50.0 + k})
              for k in range(1, 6)]
    t = monitor._throughput(points, window=4)
    assert t == {"steps": 4, "steps_per_minute": 30.0, "tokens_per_second": 50.0, "train_tokens_per_second": 55.0}
    assert monitor._throughput([monitor_pb2.StepPoint(step=1, values={"loss": 1.0})], 10) == {}


def test_the_running_job_is_picked_else_the_last():
    done, running, failed = (scheduler_pb2.JobStatus(job_id=i, state=s) for i, s in (
        ("a", scheduler_pb2.JOB_STATE_DONE), ("b", scheduler_pb2.JOB_STATE_RUNNING), ("c", scheduler_pb2.JOB_STATE_FAILED)))
    assert monitor._pick_job([done, running, failed], "").job_id == "b"
    assert monitor._pick_job([done, failed], "").job_id == "c"
    assert monitor._pick_job([done, running], "a").job_id == "a"
    assert monitor._pick_job([done], "zz") is None and monitor._pick_job([], "") is None


def test_gather_without_services_names_each_as_missing(tmp_path):
    snap = monitor.gather(None)
    assert snap.services == dict.fromkeys(monitor.SERVICES, "not running")
    assert (snap.job, snap.domains, snap.alerts, snap.learner) == ({}, [], [], {})
    # recorded but gone (a dead pid), or stopped on purpose: never called, shown as such
    state = State(home=str(tmp_path), config="", services={
        "scheduler": Proc("scheduler", pid=2**22 + 12345, address="127.0.0.1:1", log=""),
        "monitor": Proc("monitor", pid=1, address="127.0.0.1:1", log="", stopped=True)})
    snap = monitor.gather(state, job_id="j1")
    assert snap.services["scheduler"] == "not running" and snap.services["monitor"] == "stopped"
    assert snap.job == {"job_id": "j1"}
    assert "the scheduler does not know it" in _text(snap, terminal=False)
