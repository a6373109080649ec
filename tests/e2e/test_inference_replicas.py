"""A real job over two inference replicas (`[inference] replicas = 2`): real processes, broker, gRPC, tiny model.

Generation is spread over both (each replica's own spans count its Generate calls): each step's groups are
split over the two, and every group is published exactly once; each step's groups
come from one policy version (on-policy: every batch's samples are of version step - 1); a replica
SIGKILLed mid-job and restarted by the launcher loads the learner's current version before it reports
SERVING; both end at the learner's final version."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from kafka import KafkaConsumer, TopicPartition

from temper.client.sdk import InferenceClient, LearnerClient, SchedulerClient
from temper.runtime import kafka
from temper.runtime.launcher import Launcher, pid_alive
from temper.v1 import common_pb2, scheduler_pb2
from tests.conftest import wait_until

pytestmark = pytest.mark.e2e

STEPS = 8
CONFIG = """
[job]
prompts_per_step = 4       # the learner's groups per update

[model]
preset = "tiny"
hidden_size = 64
layers = 2
heads = 2
seed = 0

[inference]
engine = "hf"
replicas = 2

[learner]
lr = 0.001
epochs = 1

[replay]
ingest_tables = ["default"]

[replay.tables.default]
sampler = "fifo"
remover = "fifo"
max_size = 10000
max_times_sampled = 1
"""


@pytest.fixture
def stack(tmp_path):
    cfg = tmp_path / "job.toml"
    cfg.write_text(CONFIG)
    launcher = Launcher(home=tmp_path / "home", config=cfg)
    state = launcher.up(["inference", "reward", "replay", "learner", "scheduler"], timeout=180)
    pids = [p.pid for p in state.services.values()] + [state.broker.pid]
    yield launcher, state
    launcher.down()
    assert not [p for p in launcher.load().services.values() if pid_alive(p.pid)] if launcher.load() else True
    assert not [p for p in pids if pid_alive(p)], "processes left behind"


def _generate_calls(home: Path, name: str) -> int:
    path = home / "logs" / f"{name}.spans.jsonl"
    spans = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sum(1 for s in spans if s["name"].endswith("InferenceService/Generate"))


def _messages(bootstrap: str, topic: str, cls):
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False)
    tp = TopicPartition(topic, 0)
    consumer.assign([tp])
    consumer.seek_to_beginning(tp)
    out = [cls.FromString(r.value) for recs in consumer.poll(timeout_ms=5000).values() for r in recs]
    consumer.close()
    return out


def _step_metrics(bootstrap: str) -> list[common_pb2.StepMetrics]:
    return _messages(bootstrap, kafka.METRICS, common_pb2.StepMetrics)


def _rollouts(bootstrap: str) -> list[common_pb2.RolloutGroup]:
    return _messages(bootstrap, kafka.ROLLOUTS, common_pb2.RolloutGroup)


def test_a_job_over_two_replicas_and_a_replica_restarted_mid_job(stack):
    launcher, state = stack
    replicas = ["inference", "inference-1"]
    rows = {r["name"]: r for r in launcher.status()}
    assert all(rows[n]["health"] == "SERVING" for n in replicas)
    assert rows["inference"]["address"] != rows["inference-1"]["address"]
    scheduler = SchedulerClient(state.services["scheduler"].address)
    learner = LearnerClient(state.services["learner"].address)
    clients = {n: InferenceClient(state.services[n].address) for n in replicas}
    job = scheduler.start_job(scheduler_pb2.JobSpec(steps=STEPS, prompts_per_step=4, group_size=4,
                                                    domains=["toy.copy", "toy.next"], max_policy_lag=0,
                                                    temperature=1.0, max_tokens=2, seed=0)).job_id
    wait_until(lambda: learner.status().policy_version >= 3, timeout=120, what="three learner steps")
    scheduler.pause_job(job, "restart a replica")
    learner.pause()  # returns once its step in flight is done: no version moves, no push while the replica is down
    before = clients["inference-1"].info()
    assert before.policy_version >= 3 and before.lineage == learner.status().lineage
    clients["inference-1"].close()
    restarted = launcher.restart("inference-1", kill=True)  # SIGKILL, then started again; returns once SERVING
    assert restarted.address == state.services["inference-1"].address
    clients["inference-1"] = InferenceClient(restarted.address)
    after = clients["inference-1"].info()
    # SERVING at once with the learner's current version (the job is paused: it is not moving), never the base
    assert after.policy_version == learner.status().policy_version == before.policy_version
    assert after.lineage == before.lineage
    log = Path(restarted.log).read_text()
    assert "loaded the learner's current policy" in log
    learner.resume()
    scheduler.resume_job(job)
    wait_until(lambda: scheduler.job(job).state == scheduler_pb2.JOB_STATE_DONE, timeout=150, what="the job done")
    wait_until(lambda: learner.status().policy_version == STEPS, timeout=60, what="the learner's last step")
    lineage = learner.status().lineage
    # both replicas end at the learner's final version, of its lineage
    wait_until(lambda: all(c.info().policy_version == STEPS for c in clients.values()), timeout=30,
               what="every replica at the final version")
    assert {c.info().lineage for c in clients.values()} == {lineage}
    status = learner.status()
    assert dict(status.replica_errors) == {} and status.weight_push_failures == 0
    # one host, one policy_dir (the launcher's): every version reached both replicas by reference
    assert status.weight_pushes_by_reference >= 2 * STEPS and status.weight_pushes_streamed == 0
    # both served generation: a step's groups are split over both (`[scheduler] split_across_replicas`)
    home = Path(state.home)
    # a span reaches its file up to 1 s after it ended (the restarted replica's first process lost what it had
    # not written when it was killed: at most its last second, while the job was paused)
    def settled():
        calls = {n: _generate_calls(home, n) for n in replicas}
        return calls if all(v > 0 for v in calls.values()) and sum(calls.values()) >= STEPS else None
    calls = wait_until(settled, timeout=10, what="Generate spans of both replicas, one per step at least")
    shares = [json.loads(x)["prompts_per_replica"] for x in Path(state.services["scheduler"].log).read_text().splitlines()
              if "step generated over replicas" in x]
    both = {state.services[n].address for n in replicas}
    # at least the steps before the pause went to both replicas, 2 groups each
    assert sum(1 for s in shares if s == dict.fromkeys(both, 2)) >= 3, shares
    # every group of every step published exactly once
    ids = [g.group_id for g in _rollouts(state.kafka_bootstrap) if g.job_id == job]
    assert sorted(ids) == sorted(f"{job}/s{s}/p{i}" for s in range(STEPS) for i in range(4)), ids
    # every step trained on groups of one version, the one before it (on-policy over both replicas)
    metrics = {m.policy_version: m for m in _step_metrics(state.kafka_bootstrap) if m.job_id == job}
    assert sorted(metrics) == list(range(1, STEPS + 1))
    for v, m in metrics.items():
        assert m.min_sample_policy_version == m.max_sample_policy_version == v - 1, (v, m)
    print(f"Generate calls per replica: {calls}; replica_syncs {status.replica_syncs}; t={time.time():.0f}")
