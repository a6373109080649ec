"""One step split over two real inference replicas (tiny model, loopback, port 0), through the real scheduler
process and broker: each replica answers one chunk of the step, every group is published exactly once, in
prompt order, each of one policy version. With ``split_across_replicas`` off the step is one call."""

from __future__ import annotations

import json
import urllib.request

import pytest
from kafka import KafkaConsumer, TopicPartition

from temper.client.discovery import target_of
from temper.client.sdk import SchedulerClient
from temper.models.tiny import build_tiny_model
from temper.runtime import kafka
from temper.v1 import common_pb2, scheduler_pb2
from tests.conftest import spawn_service, wait_until

pytestmark = pytest.mark.slow  # starts two inference services, a scheduler and a broker

PROMPTS, GROUP = 5, 3


@pytest.fixture
def replicas(tmp_path):
    model = build_tiny_model(tmp_path / "tiny", seed=3, hidden_size=64, layers=2, heads=2)
    started = []
    try:
        for i in range(2):
            started.append(spawn_service("inference", tmp_path / f"inference-{i}", "--model-dir", str(model),
                                         "--engine", "hf", "--dtype", "float32", timeout=180))
        yield started
    finally:
        for s in started:
            s.stop()


def _calls(metrics_port: int) -> dict[tuple[str, str], float]:
    """The scheduler's split Generate calls: (replica, outcome) -> count."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("temper_scheduler_replica_generate_calls_total{"):
            labels, value = line.rsplit(" ", 1)
            fields = dict(kv.split("=", 1) for kv in labels[labels.index("{") + 1:-1].split(","))
            out[(json.loads(fields["replica"]), json.loads(fields["outcome"]))] = float(value)
    return out


def _rollouts(bootstrap: str) -> list[common_pb2.RolloutGroup]:
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False)
    tp = TopicPartition(kafka.ROLLOUTS, 0)
    consumer.assign([tp])
    consumer.seek_to_beginning(tp)
    out = [common_pb2.RolloutGroup.FromString(r.value) for recs in consumer.poll(timeout_ms=5000).values()
           for r in recs]
    consumer.close()
    return out


def _run_job(workdir, broker, replicas, job_id, *flags):
    scheduler = spawn_service("scheduler", workdir, "--kafka-bootstrap", broker, "--inference-address",
                              target_of(sorted(r.address for r in replicas)), "--no-persist-jobs", *flags)
    try:
        with scheduler.client(SchedulerClient) as client:
            client.start_job(scheduler_pb2.JobSpec(job_id=job_id, steps=1, prompts_per_step=PROMPTS, group_size=GROUP,
                                                   domains=["toy.copy", "toy.next"], max_policy_lag=0, max_tokens=2,
                                                   temperature=1.0, seed=0))
            wait_until(lambda: client.job(job_id).state == scheduler_pb2.JOB_STATE_DONE, timeout=120,
                       what="the one-step job done")
        return _calls(scheduler.metrics_port), scheduler.log.read_text()
    finally:
        scheduler.stop()


def test_one_step_goes_to_both_replicas_and_every_group_comes_back_once(tmp_path, broker, replicas):
    addresses = sorted(r.address for r in replicas)
    calls, log = _run_job(tmp_path / "split", broker, replicas, "split")
    assert calls == {(a, "ok"): 1.0 for a in addresses} | {(a, "failed"): 0.0 for a in addresses}, calls
    # the step log names each replica's share: chunks of 3 and 2 prompts, in sorted order
    line = next(json.loads(x) for x in log.splitlines() if "step generated over replicas" in x)
    assert line["prompts_per_replica"] == {addresses[0]: 3, addresses[1]: 2}, line
    groups = [g for g in _rollouts(broker) if g.job_id == "split"]
    assert [g.group_id for g in groups] == [f"split/s0/p{i}" for i in range(PROMPTS)]  # each once, in order
    for g in groups:
        assert len(g.trajectories) == GROUP and g.step_groups == PROMPTS
        assert {t.policy_version for t in g.trajectories} == {0}

    calls, log = _run_job(tmp_path / "one-call", broker, replicas, "one-call", "--no-split-across-replicas")
    assert calls == {} and "step generated over replicas" not in log  # one call over the round_robin channel
    assert [g.group_id for g in _rollouts(broker) if g.job_id == "one-call"] == [
        f"one-call/s0/p{i}" for i in range(PROMPTS)]
