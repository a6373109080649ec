"""The local proof of scale-out: a real job over 2 inference replicas, 2 reward replicas, 2 sandbox replicas,
2 replay shards and a learner of 2 ranks (`replicas = 2` in each table, `[learner] ranks = 2`): real
processes, broker, gVisor, gRPC, tiny model, code and toy domains.

The `rollouts` and `scored` topics get 2 partitions: the reward replicas share `rollouts` in one consumer
group, each replay shard owns one partition of `scored`; the scheduler spreads generation over both
inference replicas; the reward replicas' code checks go round robin over both sandboxes; the learner samples
both shards as one table and trains each batch on two ranks. Counted by id from the topics and the
learner's records: every group is generated once, scored (each by one replica, both replicas scoring),
stored once (in one shard; both shards storing) and trained on exactly once. The tiny model writes no
code blocks, so its code answers never reach a sandbox: code groups scored through the replicas' Score
afterwards show both sandboxes running programs, right and wrong ones scored as such."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from kafka import KafkaConsumer

from temper.client.sdk import LearnerClient, ReplayClient, RewardClient, SchedulerClient
from temper.reward.dataset import read_topic
from temper.runtime import kafka
from temper.runtime.launcher import Launcher, pid_alive
from temper.v1 import common_pb2, scheduler_pb2
from tests.builders import rollout_group
from tests.conftest import wait_until

pytestmark = pytest.mark.e2e

SUITE = json.dumps({"tests": [{"stdin": "1 2\n", "expected_stdout": "3\n"}, {"stdin": "4\n", "expected_stdout": "4\n"}]})
RIGHT = "```python\nprint(sum(map(int, input().split())))\n```"
WRONG = "```python\nprint(3)\n```"

STEPS, PROMPTS = 6, 4
CONFIG = """
[job]
prompts_per_step = 4

[model]
preset = "tiny"
hidden_size = 64
layers = 2
heads = 2
seed = 0

[inference]
engine = "hf"
replicas = 2

[reward]
replicas = 2

[sandbox]
replicas = 2
max_concurrency = 1

[learner]
lr = 0.001
epochs = 1
ranks = 2
micro_batch_tokens = 64

[replay]
replicas = 2

[replay.tables.default]
sampler = "fifo"
remover = "fifo"
max_times_sampled = 1
"""


@pytest.fixture
def stack(tmp_path):
    cfg = tmp_path / "job.toml"
    cfg.write_text(CONFIG)
    launcher = Launcher(home=tmp_path / "home", config=cfg)
    state = launcher.up(["sandbox", "inference", "reward", "replay", "learner", "scheduler"], timeout=240)
    pids = [p.pid for p in state.services.values()] + [state.broker.pid]
    yield launcher, state
    launcher.down()
    assert not [p for p in pids if pid_alive(p)], "processes left behind"


def spans(home: Path, name: str, suffix: str) -> int:
    path = home / "logs" / f"{name}.spans.jsonl"
    return sum(1 for line in path.read_text().splitlines() if line.strip() and json.loads(line)["name"].endswith(suffix))


def test_a_job_over_two_replicas_of_every_service_and_two_learner_ranks(stack):
    launcher, state = stack
    rows = {r["name"]: r for r in launcher.status()}
    for name in ("inference", "inference-1", "reward", "reward-1", "sandbox", "sandbox-1", "replay", "replay-1"):
        assert rows[name]["health"] == "SERVING", rows[name]
    reward_args = state.services["reward"].args
    sandbox_target = reward_args[reward_args.index("--sandbox-address") + 1]
    assert sandbox_target.startswith("ipv4:") and state.services["sandbox-1"].address in sandbox_target

    scheduler = SchedulerClient(state.services["scheduler"].address)
    job = scheduler.start_job(scheduler_pb2.JobSpec(
        steps=STEPS, prompts_per_step=PROMPTS, group_size=4, domains=["code.sum_numbers", "code.fibonacci", "toy.copy"],
        max_policy_lag=0, temperature=1.0, max_tokens=8, seed=0)).job_id
    wait_until(lambda: scheduler.job(job).state == scheduler_pb2.JOB_STATE_DONE, timeout=400, what="the job done")
    learner = LearnerClient(state.services["learner"].address)
    wait_until(lambda: learner.status().policy_version == STEPS, timeout=120, what="the learner's last step")

    expected = sorted(f"{job}/s{s}/p{i}" for s in range(STEPS) for i in range(PROMPTS))
    bootstrap = state.kafka_bootstrap
    consumer = KafkaConsumer(bootstrap_servers=bootstrap)
    partitions = consumer.partitions_for_topic(kafka.ROLLOUTS)
    consumer.close()
    assert partitions == {0, 1}, partitions  # one per reward replica (and per replay shard)
    rollouts = [g.group_id for g in read_topic(bootstrap, kafka.ROLLOUTS, common_pb2.RolloutGroup) if g.job_id == job]
    assert sorted(rollouts) == expected
    # every group scored; a redelivery after a rebalance may score one twice, replay keeps the first
    scored = Counter(g.group_id for g in read_topic(bootstrap, kafka.SCORED, common_pb2.RolloutGroup)
                     if g.job_id == job)
    assert sorted(scored) == expected
    home = Path(state.home)

    def consumed():  # a span reaches its file up to 1 s after it ended
        return {n: spans(home, n, f"consume {kafka.ROLLOUTS}") for n in ("reward", "reward-1")}
    wait_until(lambda: all(v > 0 for v in consumed().values()), timeout=10, what=f"both replicas scored: {consumed()}")
    # code answers through the reward replicas (Score, round robin) to the sandboxes (round robin)
    scheduler_args = state.services["scheduler"].args
    with RewardClient(scheduler_args[scheduler_args.index("--reward-address") + 1]) as reward:
        for i in range(6):
            group = reward.score(rollout_group("code.sum_numbers", SUITE, [RIGHT, WRONG], group_id=f"code/{i}",
                                               prompt="sum them"))
            assert [t.reward.total for t in group.trajectories] == [1.0, 0.0], group

    def executed():
        return {n: spans(home, n, "SandboxService/RunTestsBatch") + spans(home, n, "SandboxService/RunTests")
                for n in ("sandbox", "sandbox-1")}
    wait_until(lambda: all(v > 0 for v in executed().values()), timeout=10, what=f"both sandboxes used: {executed()}")
    # stored once: each group in the one shard that owns its partition of `scored`, both shards storing
    inserts = {}
    for name in ("replay", "replay-1"):
        with ReplayClient(state.services[name].address) as replay:
            stats = replay.stats()
        assert stats.duplicates == 0, (name, stats)
        inserts[name] = stats.inserts
    assert sum(inserts.values()) == len(expected) and all(inserts.values()), inserts
    # `temper monitor` shows the one table over both shards (sums), each shard's size, and both shards' health
    from temper.cli.monitor import gather

    snap = gather(launcher.load())
    assert snap.services["replay"] == snap.services["replay-1"] == "up"
    assert snap.replay["inserts"] == len(expected) and set(snap.replay["shards"]) == {"replay", "replay-1"}
    assert snap.replay["size"] == sum(snap.replay["shards"].values())
    shard_args = [state.services[n].args for n in ("replay", "replay-1")]
    assert [a[a.index("--shard") + 1] for a in shard_args] == ["0/2", "1/2"]
    # generation over both inference replicas; the learner's second rank is its child process
    generated = {n: spans(home, n, "InferenceService/Generate") for n in ("inference", "inference-1")}
    wait_until(lambda: all(spans(home, n, "InferenceService/Generate") for n in generated), timeout=10,
               what="Generate spans of both inference replicas")
    learner_pid = state.services["learner"].pid
    children = [int(c) for t in Path(f"/proc/{learner_pid}/task").iterdir() for c in (t / "children").read_text().split()]
    assert [c for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()], children
    # trained on exactly once
    trained = Counter(gid for m in read_topic(bootstrap, kafka.METRICS, common_pb2.StepMetrics)
                      if m.job_id == job for gid in m.group_ids)
    assert sorted(trained) == expected and set(trained.values()) == {1}, trained
    print(f"\nrollouts consumed per reward replica {consumed()}; sandbox calls per replica {executed()}; scored "
          f"messages {sum(scored.values())} for {len(expected)} groups; stored per replay shard {inserts}; "
          f"Generate calls per inference replica {generated}")
