"""The monitor as a process between a real broker and a real scheduler (and inference, which the
scheduler's job needs): an injected reward hack in real `scored` messages raises the alert, which
is on the `alerts` topic and in ListAlerts, and its policy pauses (or stops) the job; a clean
series raises nothing; a metrics spike raises the learner-signal alert; a restarted monitor keeps
its alerts and curves without replaying the topics."""

import json
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from kafka import KafkaConsumer
from kafka.structs import TopicPartition

from temper.client.sdk import MonitorClient, SchedulerClient
from temper.runtime import kafka
from temper.runtime.launcher import Launcher, pid_alive
from temper.v1 import common_pb2, monitor_pb2, scheduler_pb2
from tests.conftest import wait_until
from tests.monitor.test_core import group

pytestmark = pytest.mark.slow  # starts processes

CONFIG = """
[job]
prompts_per_step = 2
[model]
preset = "tiny"
dir = "{model}"
hidden_size = 64
layers = 2
heads = 2
[inference]
engine = "hf"
[monitor.detectors.reward_vs_gold]
policy = "{policy}"
[monitor.detectors.training_signal]
policy = "warn"
"""
HACK = [0] * 8 + [3, 6, 7, 7, 7, 7]
CLEAN = [0, 1, 0, 0, 1, 0, 0, 1, 0, 0, 1, 0, 0, 1]


@pytest.fixture(params=["pause", "stop"])
def stack(request, tmp_path, tmp_path_factory):
    model = tmp_path_factory.getbasetemp() / "tiny-model"
    cfg = tmp_path / "job.toml"
    cfg.write_text(CONFIG.format(model=model, policy=request.param))
    launcher = Launcher(home=tmp_path / "home", config=cfg)
    state = launcher.up(["inference", "scheduler", "monitor"])
    pids = [p.pid for p in state.services.values()] + [state.broker.pid]
    yield request.param, launcher, state
    launcher.down()
    assert not [p for p in pids if pid_alive(p)], "processes left behind"


def _job(scheduler):
    # a long job that never waits for a learner (there is none here): it is what the monitor acts on
    return scheduler.start_job(scheduler_pb2.JobSpec(steps=100_000, prompts_per_step=1, group_size=2,
                                                     domains=["toy.copy"], max_policy_lag=1_000_000,
                                                     temperature=1.0, max_tokens=2)).job_id


def _read(bootstrap, topic, message_type):
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False)
    tp = TopicPartition(topic, 0)
    consumer.assign([tp])
    consumer.seek_to_beginning(tp)
    out = [message_type.FromString(r.value) for recs in consumer.poll(timeout_ms=3000).values() for r in recs]
    consumer.close()
    return out


def test_hack_alert_acts_on_the_job_clean_series_does_not(stack):
    policy, launcher, state = stack
    scheduler = SchedulerClient(state.services["scheduler"].address)
    monitor = MonitorClient(state.services["monitor"].address)
    producer = kafka.ProtoProducer(state.kafka_bootstrap, "test")
    try:
        hacked_job = _job(scheduler)
        clean_job = "clean-job"  # not the scheduler's: any action on it would fail and show in the alert
        for step, hacked in enumerate(CLEAN):  # a clean series first: same partition, so handled before the hack
            for p in range(2):
                g = group(clean_job, step, p, hacked, step_groups=2)
                producer.send(kafka.SCORED, g.group_id, g).get(10)
        for step, hacked in enumerate(HACK):
            for p in range(2):
                g = group(hacked_job, step, p, hacked, step_groups=2)
                producer.send(kafka.SCORED, g.group_id, g).get(10)
        for step in range(1, 13):  # a KL spike at learner step 12
            m = common_pb2.StepMetrics(job_id=hacked_job, step=step,
                                       values={"kl_ref": 0.5 if step == 12 else 0.02, "entropy": 2.0})
            producer.send(kafka.METRICS, hacked_job, m).get(10)
        want = scheduler_pb2.JOB_STATE_PAUSED if policy == "pause" else scheduler_pb2.JOB_STATE_STOPPED
        job = wait_until(lambda: (j := scheduler.job(hacked_job)).state == want and j, 60, what=f"job {policy}")
        alerts = monitor.list_alerts(job_id=hacked_job, detector="reward_vs_gold")
        assert len(alerts) == 1
        a = alerts[0]
        assert 8 <= a.step <= 10, a.step  # within 2 steps of the onset (step 8)
        assert a.action == (monitor_pb2.ALERT_ACTION_PAUSE if policy == "pause" else monitor_pb2.ALERT_ACTION_STOP)
        assert scheduler_pb2.JobState.Name(want) in a.action_result
        assert a.evidence.trajectory_ids and {s.name for s in a.evidence.series} == {"reward", "heldout"}
        cli = [sys.executable, "-m", "temper.cli.main", "--home", str(launcher.home)]
        shown = subprocess.run([*cli, "alerts", "--job", hacked_job, "--detector", "reward_vs_gold", "--json"],
                               capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0, shown.stderr[-2000:]
        assert [x["alert_id"] for x in json.loads(shown.stdout)] == [a.alert_id]
        if policy == "pause":
            assert a.alert_id in job.pause_reason
            resumed = subprocess.run([*cli, "resume", hacked_job], capture_output=True, text=True, timeout=60)
            assert resumed.returncode == 0 and "JOB_STATE_RUNNING" in resumed.stdout, resumed.stderr
            assert scheduler.job(hacked_job).state == scheduler_pb2.JOB_STATE_RUNNING
        assert monitor.list_alerts(job_id=clean_job) == []
        wait_until(lambda: monitor.list_alerts(job_id=hacked_job, detector="training_signal"), 30, what="KL alert")
        kl = monitor.list_alerts(job_id=hacked_job, detector="training_signal")[0]
        assert (kl.domain, kl.step, kl.action) == ("*", 12, monitor_pb2.ALERT_ACTION_WARN)
        published = wait_until(lambda: [x for x in _read(state.kafka_bootstrap, kafka.ALERTS, monitor_pb2.Alert)
                                        if x.detector in ("reward_vs_gold", "training_signal")
                                        and x.job_id == hacked_job] or None, 30, what="alerts on the topic")
        assert {x.alert_id for x in published} >= {a.alert_id, kl.alert_id}
        assert [x.action_result for x in published if x.alert_id == a.alert_id] == [a.action_result]
        # counted in Prometheus and logged (JSON lines)
        import urllib.request

        proc = state.services["monitor"]
        text = urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=10).read().decode()
        assert (f'temper_monitor_alerts_total{{action="{policy}",detector="reward_vs_gold",severity="critical"}} 1.0'
                in text), [x for x in text.splitlines() if "alerts_total" in x]
        lines = Path(proc.log).read_text().splitlines()
        logged = [json.loads(x) for x in lines if '"alert"' in x and x.startswith("{")]
        assert [x["alert_id"] for x in logged if x.get("event") == "alert" and x["detector"] == "reward_vs_gold"] \
            == [a.alert_id]
        with pytest.raises(grpc.RpcError) as e:
            monitor.list_alerts(limit=-1)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "limit" in e.value.details()

        # a restart keeps the alerts and the curve: nothing is read again from the topics
        everything, curve = monitor.list_alerts(), monitor.reward_curve()
        monitor.close()
        launcher.restart("monitor")
        monitor = MonitorClient(state.services["monitor"].address)
        assert monitor.list_alerts() == everything and monitor.reward_curve() == curve
    finally:
        producer.close()
        monitor.close()
        scheduler.close()
