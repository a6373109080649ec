"""The monitor core over a real sqlite store: steps close, detectors raise alerts once, the
policy acts, redelivery changes nothing, and a restart keeps curves, series and alerts."""

import pytest

from temper.monitor.core import DetectorSet, Monitor
from temper.runtime.errors import InvalidArgument
from temper.v1 import common_pb2, monitor_pb2

OK = common_pb2.REWARD_STATUS_OK


def group(job, step, p, hacked, domain="toy.copy", n=8, step_groups=0):
    """A scored group: an exploitable verifier (weight 1) and the sound one held out (weight 0).
    ``hacked`` of the ``n`` samples spam digits: rewarded by the unsound check, wrong by the sound one."""
    trajs = []
    for k in range(n):
        gid = f"{job}/s{step}/p{p}"
        hack = k < hacked
        sound = 1.0 if k == n - 1 else 0.0
        text = "0 1 2 3 4 5 6 7" if hack else ("3" if sound else "cat")
        contains = 1.0 if hack or sound else 0.0
        trajs.append(common_pb2.Trajectory(
            trajectory_id=f"{gid}/{k}", group_id=gid, policy_version=step, completion_text=text,
            completion_token_ids=list(range(len(text.split()))),
            reward=common_pb2.Reward(total=contains, status=OK, components=[
                common_pb2.RewardComponent(name="exact_answer.contains", value=contains, weight=1.0, status=OK),
                common_pb2.RewardComponent(name="exact_answer", value=sound, weight=0.0, status=OK)])))
    return common_pb2.RolloutGroup(group_id=f"{job}/s{step}/p{p}", job_id=job, step=step, step_groups=step_groups,
                                   task=common_pb2.Task(domain=domain), trajectories=trajs)


def feed(m, job, hacked_by_step, prompts=2):
    alerts = []
    for step, hacked in enumerate(hacked_by_step):
        for p in range(prompts):
            alerts += m.add_scored(group(job, step, p, hacked))
    return alerts


DETECTORS = {"reward_vs_gold": {"policy": "pause"}}


def test_hack_raises_one_alert_with_evidence_and_pauses(tmp_path):
    acted, published = [], []
    m = Monitor(tmp_path / "m.sqlite", DetectorSet(DETECTORS), act=lambda a, p: acted.append((a, p)) or "paused",
                publish=published.append)
    onset = 8
    alerts = feed(m, "j", [0] * onset + [2, 4, 6, 7, 7, 7, 7, 7, 7, 7, 7, 7])
    fired = [a for a in alerts if a.detector == "reward_vs_gold"]
    assert len(fired) == 1, [a.alert_id for a in alerts]
    a = fired[0]
    assert onset <= a.step <= onset + 3
    assert a.action == monitor_pb2.ALERT_ACTION_PAUSE and a.action_result == "paused"
    assert a.severity == monitor_pb2.ALERT_SEVERITY_CRITICAL
    assert a.evidence.trajectory_ids and all(t.startswith(f"j/s{a.step}") or "/s" in t for t in a.evidence.trajectory_ids)
    names = {s.name for s in a.evidence.series}
    assert names == {"reward", "heldout"}
    assert all(len(s.values) == len(a.evidence.steps) for s in a.evidence.series) and a.evidence.steps[-1] == a.step
    assert [p for _, p in acted] == ["pause"] and published[0].alert_id == a.alert_id
    assert published[0].action_result == "paused"


def test_clean_series_raises_nothing(tmp_path):
    m = Monitor(tmp_path / "m.sqlite", DetectorSet(DETECTORS), act=lambda a, p: pytest.fail("acted"))
    assert feed(m, "j", [0, 1, 0, 0, 1, 0, 0, 1, 0, 0, 1, 0, 0, 0, 1, 0, 0, 1, 0, 0]) == []


def test_redelivery_and_restart_keep_everything_once(tmp_path):
    path = tmp_path / "m.sqlite"
    m = Monitor(path, DetectorSet(DETECTORS))
    feed(m, "j", [0] * 8 + [4, 7, 7, 7, 7])
    before = (m.points(), len(m.list_alerts(monitor_pb2.ListAlertsRequest())), m.series("j", "toy.copy"))
    assert m.add_scored(group("j", 3, 0, 0)) == []  # redelivered: not counted again
    assert m.points() == before[0]
    m.close()
    m2 = Monitor(path, DetectorSet(DETECTORS))
    assert m2.points() == before[0]
    assert len(m2.list_alerts(monitor_pb2.ListAlertsRequest())) == before[1]
    assert len(m2.list_alerts(monitor_pb2.ListAlertsRequest(detector="reward_vs_gold"))) == 1
    assert [s.values for s in m2.series("j", "toy.copy")] == [s.values for s in before[2]]
    # the open step (12) survived too: the next step closes it, and the latched alert stays single
    m2.add_scored(group("j", 13, 0, 7))
    assert len(m2.series("j", "toy.copy")) == 13
    assert len(m2.list_alerts(monitor_pb2.ListAlertsRequest(detector="reward_vs_gold"))) == 1


def test_pending_alert_is_flushed_after_a_crash(tmp_path):
    path = tmp_path / "m.sqlite"

    def broken(alert):
        raise ConnectionError("broker down")

    m = Monitor(path, DetectorSet(DETECTORS), publish=broken)
    with pytest.raises(ConnectionError):
        feed(m, "j", [0] * 8 + [4, 7, 7, 7, 7])
    # in the same process: the redelivered message is a duplicate, but the pending alerts go out first
    m._publish = (sent := []).append
    assert m.add_scored(group("j", 8, 1, 4)) == [] and [a.detector for a in sent] == ["reward_vs_gold"]
    m.close()
    m = Monitor(path, DetectorSet(DETECTORS), publish=broken)
    with pytest.raises(ConnectionError):
        feed(m, "k", [0] * 8 + [4, 7, 7, 7, 7])
    m.close()
    published = []
    m2 = Monitor(path, DetectorSet(DETECTORS), act=lambda a, p: "paused", publish=published.append)
    assert m2.flush_pending() == 1  # the alert of step 8; the message that raised it is redelivered
    hack = [a for a in published if a.detector == "reward_vs_gold"]
    assert len(hack) == 1 and hack[0].action_result == "paused"
    assert m2.flush_pending() == 0


def test_an_alert_in_flight_is_not_dispatched_again_by_the_other_consumer(tmp_path):
    """While one consumer acts on and publishes an alert, the other's flush must skip it (seen:
    the same alert published twice when a slow StopJob overlapped a metrics message)."""
    published, flushed_meanwhile = [], []

    def publish(alert):
        # the metrics consumer arrives while this alert is being published
        flushed_meanwhile.append(m.flush_pending())
        published.append(alert.alert_id)

    m = Monitor(tmp_path / "m.sqlite", DetectorSet(DETECTORS), act=lambda a, p: "paused", publish=publish)
    alerts = feed(m, "j", [0] * 8 + [4, 7, 7, 7, 7])
    assert alerts and set(flushed_meanwhile) == {0}
    assert sorted(published) == sorted(a.alert_id for a in alerts)  # each exactly once
    assert m.flush_pending() == 0


def test_list_alerts_filters_and_validation(tmp_path):
    t = [1000.0]
    m = Monitor(tmp_path / "m.sqlite", DetectorSet(), clock=lambda: t[0])
    feed(m, "a", [0] * 8 + [4, 7, 7, 7, 7])
    t[0] = 2000.0
    feed(m, "b", [0] * 8 + [4, 7, 7, 7, 7])
    req = monitor_pb2.ListAlertsRequest
    assert {a.job_id for a in m.list_alerts(req())} == {"a", "b"}
    assert {a.job_id for a in m.list_alerts(req(job_id="b"))} == {"b"}
    assert {a.job_id for a in m.list_alerts(req(since_unix_ms=1_500_000))} == {"b"}
    assert m.list_alerts(req(domain="toy.next")) == []
    assert all(a.severity == monitor_pb2.ALERT_SEVERITY_CRITICAL
               for a in m.list_alerts(req(min_severity=monitor_pb2.ALERT_SEVERITY_CRITICAL)))
    assert len(m.list_alerts(req(limit=1))) == 1
    for bad, fld in ((req(limit=-1), "limit"), (req(detector="nope"), "detector"), (req(min_severity=9), "min_severity"),
                     (req(since_unix_ms=-5), "since_unix_ms")):
        with pytest.raises(InvalidArgument) as e:
            m.list_alerts(bad)
        assert e.value.field == fld


def test_a_step_closes_when_all_its_groups_are_in_else_when_the_next_starts(tmp_path):
    m = Monitor(tmp_path / "m.sqlite", DetectorSet())
    m.add_scored(group("j", 0, 0, 0, step_groups=2))
    assert m.series("j", "toy.copy") == []
    m.add_scored(group("j", 0, 1, 0, step_groups=2))
    assert [s.step for s in m.series("j", "toy.copy")] == [0]  # complete: closed at once
    m.add_scored(group("k", 0, 0, 0))  # the step's size unknown: open until step 1 of k starts
    assert m.series("k", "toy.copy") == []
    m.add_scored(group("k", 1, 0, 0))
    assert [s.step for s in m.series("k", "toy.copy")] == [0]
    m.add_scored(group("j", 0, 2, 7, step_groups=2))  # late for a closed step: curve only
    assert [s.samples for s in m.series("j", "toy.copy")] == [16]


def test_detector_config_per_domain_and_validation():
    ds = DetectorSet({"length": {"explode_ratio": 3.0, "policy": "stop",
                                 "domains": {"toy": {"enabled": False}, "toy.copy": {"enabled": True, "window": 5}}}})
    length = lambda dom: dict(ds.for_domain("scored", dom)).get("length")  # noqa: E731
    assert length("math.add").detector.explode_ratio == 3.0 and length("math.add").policy == "stop"
    assert length("toy.next") is None
    assert length("toy.copy").detector.window == 5 and length("toy.copy").detector.explode_ratio == 3.0
    assert {n for n, _ in ds.for_domain("metrics", "*")} == {"training_signal"}
    assert ds.policies() == {"stop"}
    for table, fld in (({"nope": {}}, "monitor.detectors.nope"),
                       ({"length": {"policy": "explode"}}, "monitor.detectors.length.policy"),
                       ({"length": {"domains": {"toy": {"windw": 2}}}}, "monitor.detectors.length.domains.toy.windw"),
                       ({"length": {"cooldown_steps": 0}}, "monitor.detectors.length.cooldown_steps")):
        with pytest.raises(InvalidArgument) as e:
            DetectorSet(table)
        assert e.value.field == fld


def test_metrics_series_spike(tmp_path):
    m = Monitor(tmp_path / "m.sqlite", DetectorSet())
    out = []
    for step in range(1, 13):
        kl = 0.5 if step == 12 else 0.02 + 0.001 * (step % 3)
        out += m.add_metrics(common_pb2.StepMetrics(job_id="j", step=step, values={"kl_ref": kl, "entropy": 2.0}))
    assert [(a.detector, a.domain, a.step) for a in out] == [("training_signal", "*", 12)]
    assert m.add_metrics(common_pb2.StepMetrics(job_id="j", step=12, values={"kl_ref": 9.0})) == []
    with pytest.raises(InvalidArgument):
        m.add_metrics(common_pb2.StepMetrics(job_id="", step=1))


def test_steps_lists_a_jobs_series_oldest_first_and_survives_a_restart(tmp_path):
    m = Monitor(tmp_path / "m.sqlite")
    feed(m, "j", [0, 1, 2, 3], prompts=2)  # steps 0-2 close (step 3 waits for a later one)
    m.add_scored(group("j", 0, 0, 1, domain="toy.next"))
    m.add_scored(group("other", 0, 0, 1))
    for step in (1, 2):
        m.add_metrics(common_pb2.StepMetrics(job_id="j", step=step, seconds=0.5 * step, values={"kl_ref": 0.01}))
    for step in (0, 2):  # batches that trained nothing (before any step, after step 2): no point on a curve
        assert m.add_metrics(common_pb2.StepMetrics(job_id="j", step=step, policy_version=9, samples=0,
                                                    values={"skipped_batch": 1.0, "dropped_groups": 4.0})) == []
    found = m.steps("j")
    assert [(src, d) for src, d, _ in found] == [("metrics", "*"), ("scored", "toy.copy")]
    (_, _, metrics), (_, _, copy) = found
    assert [s.step for s in copy] == [0, 1, 2] and copy[-1].samples == 16
    assert copy[-1].values["reward"] == pytest.approx((2 * 2 + 2) / 16)  # 2 hacked + 1 sound per group of 8
    assert [(s.step, s.values["step_seconds"], s.values["kl_ref"]) for s in metrics] == [(1, 0.5, 0.01), (2, 1.0, 0.01)]
    assert [(src, d, [s.step for s in steps]) for src, d, steps in m.steps("j", "toy.copy", last=2)] == \
        [("scored", "toy.copy", [1, 2])]
    assert m.steps("no-such-job") == []
    for field, kw in [("job_id", {"job": ""}), ("last", {"job": "j", "last": -1}), ("last", {"job": "j", "last": 10_001})]:
        with pytest.raises(InvalidArgument) as e:
            m.steps(**kw)
        assert e.value.field == field
    m.close()
    again = Monitor(tmp_path / "m.sqlite")
    assert [(src, d, [s.step for s in steps]) for src, d, steps in again.steps("j")] == \
        [(src, d, [s.step for s in steps]) for src, d, steps in found]
