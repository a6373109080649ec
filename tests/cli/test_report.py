"""`temper report` from a run folder: the data read from summary.json, report.json's figures, the PNGs, and
TensorBoard event files read back record by record (TFRecord framing, tensorboardX's Event protobuf)."""

import json
import struct

import pytest
from google.protobuf.json_format import MessageToDict
from tensorboardX.proto import event_pb2

from temper.cli import report
from temper.cli.main import main
from temper.v1 import monitor_pb2

STEPS = [{"step": s, "mean_reward": 0.1 * s, "seconds": 2.0 + s, "policy_version": s,
          "domain_mean_reward": {"rg.gcd": 0.05 * s, "rg.products": 0.15 * s},
          "values": {"kl_ref": 0.01 * s, "entropy": 2.0 - 0.1 * s, "clip_fraction": 0.02, "loss": -0.5}}
         for s in range(1, 6)]
EVALS = [{"phase": "before", "policy_version": 0, "accuracy": {"rg.gcd": 0.1, "rg.products": 0.2}},
         {"phase": "final", "policy_version": 5, "accuracy": {"rg.gcd": 0.3, "rg.products": 0.25}}]
ALERT = monitor_pb2.Alert(alert_id="job-9/rg.gcd/reward_jump/4", job_id="job-9", domain="rg.gcd", step=4,
                          detector="reward_jump", severity=monitor_pb2.ALERT_SEVERITY_WARNING,
                          action=monitor_pb2.ALERT_ACTION_WARN, message="reward jumped 0.4 above its history")


@pytest.fixture
def run(tmp_path):
    folder = tmp_path / "runs" / "20261203-0600"
    folder.mkdir(parents=True)
    summary = {"job": {"job_id": "job-9"}, "job_state": "JOB_STATE_DONE", "steps": STEPS,
               "eval": {"evals": EVALS, "samples": 4, "temperature": 0.6, "problems_per_domain": 50},
               "alerts": [MessageToDict(ALERT, preserving_proto_field_name=True)]}
    (folder / "summary.json").write_text(json.dumps(summary))
    return folder


def events(logdir) -> list[event_pb2.Event]:
    [path] = list(logdir.glob("events.out.tfevents.*"))
    data, out, at = path.read_bytes(), [], 0
    while at < len(data):
        (length,) = struct.unpack("<Q", data[at:at + 8])
        out.append(event_pb2.Event.FromString(data[at + 12:at + 12 + length]))  # after length and its crc
        at += 12 + length + 4  # the record and its crc
    return out


def scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    found: dict[str, list[tuple[int, float]]] = {}
    for e in events(logdir):
        for v in e.summary.value:
            if v.HasField("simple_value"):
                found.setdefault(v.tag, []).append((e.step, pytest.approx(v.simple_value, abs=1e-6)))
    return found


def test_a_run_folder_is_read_as_the_learner_steps_evals_and_alerts_it_recorded(run):
    data = report.from_summary(run)
    assert (data.job_id, data.state) == ("job-9", "done")
    assert data.learner["mean_reward"] == [(s, pytest.approx(0.1 * s)) for s in range(1, 6)]
    assert data.learner["step_seconds"] == [(s, 2.0 + s) for s in range(1, 6)]
    assert data.learner["kl_ref"][-1] == (5, pytest.approx(0.05))
    assert data.scored["rg.products"]["reward"][0] == (1, pytest.approx(0.15))
    assert [(e["phase"], e["policy_version"], e["samples"], e["temperature"], e["problems"]) for e in data.evals] == \
        [("before", 0, 4, 0.6, 50), ("final", 5, 4, 0.6, 50)]
    assert data.alerts == [{"alert_id": "job-9/rg.gcd/reward_jump/4", "step": 4, "domain": "rg.gcd",
                            "detector": "reward_jump", "severity": "warning", "policy": "warn",
                            "message": "reward jumped 0.4 above its history"}]


def test_summary_figures():
    s = report.summarize(report.ReportData(
        job_id="j", source="x", learner={"mean_reward": [(1, 0.0), (2, 0.2), (3, 0.4), (4, 0.6), (5, 0.8)]},
        scored={"a": {"reward": [(0, 0.5), (1, 1.0)]}},
        evals=[{"accuracy": {"a": 0.25}, "policy_version": 0}, {"accuracy": {"a": 0.5}, "policy_version": 5}],
        alerts=[{"detector": "reward_jump"}, {"detector": "reward_jump"}, {"detector": "length"}]), window=2)
    assert s["reward"] == {"steps": 5, "first": pytest.approx(0.1), "last": pytest.approx(0.7)}
    assert s["domains"]["a"] == {"steps": 2, "first": 0.75, "last": 0.75}
    assert s["eval"]["gain"] == {"a": 0.25} and (s["eval"]["before_version"], s["eval"]["after_version"]) == (0, 5)
    assert s["alerts"] == {"reward_jump": 2, "length": 1}


def test_temper_report_of_a_run_folder_writes_plots_json_and_tensorboard_events(run, capsys):
    assert main(["report", str(run)]) == 0
    printed = capsys.readouterr().out
    assert "job job-9 (done): 5 learner steps, reward 0.100 -> 0.500, held-out 0.150 -> 0.275, 1 alerts" in printed
    for png in ("reward_curve.png", "training.png", "eval_accuracy.png"):
        assert (run / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    written = json.loads((run / "report.json").read_text())
    assert written["job_id"] == "job-9" and written["summary"]["eval"]["gain"] == \
        {"rg.gcd": pytest.approx(0.2), "rg.products": pytest.approx(0.05)}
    tb = scalars(run / "tb")
    assert tb["reward/mean"] == [(s, 0.1 * s) for s in range(1, 6)]
    assert tb["reward/rg.gcd"] == [(s, 0.05 * s) for s in range(1, 6)]
    assert tb["learner/entropy"] == [(s, 2.0 - 0.1 * s) for s in range(1, 6)]
    assert tb["eval/rg.products"] == [(0, 0.2), (5, 0.25)]
    texts = [(e.step, v.tag) for e in events(run / "tb") for v in e.summary.value if v.HasField("tensor")]
    assert texts == [(4, "alerts/text_summary")]

    assert main(["report", str(run)]) == 0  # again: the events are replaced, not appended to
    assert scalars(run / "tb")["reward/mean"] == [(s, 0.1 * s) for s in range(1, 6)]


def test_a_report_of_what_is_not_there_names_the_argument(tmp_path, capsys):
    assert main(["--home", str(tmp_path / "home"), "report", "job-nothing"]) == 1
    assert "run: the monitor is not up in this home" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 1
    assert "does not exist (give a run folder" in capsys.readouterr().err
