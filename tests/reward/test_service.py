"""The reward service as a process: `rollouts` -> `scored` with a real broker and a real sandbox;
a sandbox outage holds a code rollout back (retried, never published with a made-up 0);
redelivery publishes the same scored groups again without scoring twice; bad requests over gRPC."""

from __future__ import annotations

import json
from collections import Counter

import grpc
import pytest
from kafka import KafkaConsumer
from kafka.structs import OffsetAndMetadata, TopicPartition

from temper.client.sdk import RewardClient
from temper.reward.dataset import read_topic
from temper.runtime import kafka
from temper.v1 import common_pb2, sandbox_pb2
from tests.conftest import wait_until
from tests.builders import rollout_group
from tests.conftest import spawn_service
from tests.reward.conftest import component, start_sandbox

SUITE = json.dumps({"tests": [{"stdin": "1 2\n", "expected_stdout": "3\n"}, {"stdin": "4\n", "expected_stdout": "4\n"}]})
RIGHT = "```python\nprint(sum(map(int, input().split())))\n```"
WRONG = "```python\nprint(3)\n```"


def scored_messages(bootstrap: str) -> list[common_pb2.RolloutGroup]:
    return list(read_topic(bootstrap, kafka.SCORED, common_pb2.RolloutGroup, idle_seconds=0.5))


def rewind(bootstrap: str, group_id: str, topic: str) -> None:
    """Set a consumer group's committed offset back to 0, as a crash before its commits would leave it."""
    c = KafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=group_id, enable_auto_commit=False,
                      session_timeout_ms=6000, heartbeat_interval_ms=2000)
    tp = TopicPartition(topic, 0)
    try:
        wait_until(lambda: c.poll(timeout_ms=200) is not None and c.assignment(), 60, interval=0.1, what="joining")
        c.seek(tp, 0)
        c.commit({tp: OffsetAndMetadata(0, "", -1)})
    finally:
        c.close()


def test_stream_outage_redelivery_and_rpc(broker, tmp_path):
    # the sandbox's address is needed before it runs: start it once (port 0) for its port, stop it; it
    # comes back on that port later, as `temper restart` brings a service back on its own address
    sandbox = start_sandbox(tmp_path)
    sandbox.stop()
    sandbox_port = sandbox.port
    config = tmp_path / "temper.toml"
    config.write_text(f"""
[reward]
sandbox_address = "127.0.0.1:{sandbox_port}"
retry_backoff_seconds = 0.5
max_completion_chars = 1000
[reward.code]
retries = 1
retry_backoff_seconds = 0.1
timeout_seconds = 10
""")
    args = ("--config", str(config), "--kafka-bootstrap", broker)
    reward = spawn_service("reward", tmp_path, *args)
    producer = kafka.ProtoProducer(broker, "test")
    try:
        # 1. a code rollout while no sandbox runs: held back and retried, nothing published
        code = rollout_group("code.sum_numbers", SUITE, [RIGHT, WRONG], group_id="job/s0/p0", prompt="sum them")
        producer.send(kafka.ROLLOUTS, code.group_id, code).get(10)
        wait_until(lambda: reward.log.read_text().count("sandbox unavailable after 2 attempt") >= 2, 90, interval=0.5,
                   what="the rollout tried, failed and retried")
        assert scored_messages(broker) == []
        # the sandbox comes up: the same rollout is scored for real
        since_sandbox = len(reward.log.read_text())
        sandbox = start_sandbox(tmp_path, port=sandbox_port, kafka_bootstrap=broker)
        wait_until(lambda: len(scored_messages(broker)) == 1, 60, interval=0.5, what="the code group scored")
        first = scored_messages(broker)[0]
        assert [t.reward.total for t in first.trajectories] == [1.0, 0.0]
        assert component(first.trajectories[1], "code.pass_fraction").value == 0.5

        # 2. other domains, and a bad request that goes on marked
        toy = rollout_group("toy.copy", "4", ["4", "5"], group_id="job/s0/p1", prompt="copy 1 2 4")
        math = rollout_group("math.fraction_sum", "\\frac{5}{6}", ["\\boxed{10/12}", "\\boxed{0.83}"], group_id="job/s0/p2")
        bad = rollout_group("nope", "1", ["1"], group_id="job/s0/p3")
        for g in (toy, math, bad):
            producer.send(kafka.ROLLOUTS, g.group_id, g).get(10)
        wait_until(lambda: len(scored_messages(broker)) == 4, 60, interval=0.5, what="4 scored groups")
        published = {g.group_id: g for g in scored_messages(broker)}
        assert [t.reward.total for t in published["job/s0/p1"].trajectories] == [1.0, 0.0]
        assert [t.reward.total for t in published["job/s0/p2"].trajectories] == [1.0, 0.0]
        marked = published["job/s0/p3"].trajectories[0].reward
        assert marked.status == common_pb2.REWARD_STATUS_ERROR and "group.task.domain" in marked.components[0].error
        runs = list(read_topic(broker, kafka.SANDBOX_TRACES, sandbox_pb2.ExecutionTrace, idle_seconds=0.5))
        traces = len(runs)
        # one RunTests per distinct program; a run the sandbox itself failed (a loaded machine can fail to
        # start a gVisor sandbox) or a call past its deadline is tried again, and each try is a trace
        answered = Counter(t.run_tests_request.program.files[0].content.decode() for t in runs
                           if t.verdict != sandbox_pb2.VERDICT_SANDBOX_ERROR)
        assert len(answered) == 2 and any("sum(map" in p for p in answered), answered
        retried = reward.log.read_text()[since_sandbox:].count("retrying")
        assert traces == 2 or traces - 2 <= 2 * retried, (traces, retried)

        # 3. a crash before the offsets were committed: everything comes again
        reward.kill()
        rewind(broker, "temper-reward", kafka.ROLLOUTS)
        reward = spawn_service("reward", tmp_path, *args, port=reward.port)
        wait_until(lambda: len(scored_messages(broker)) == 8, 60, interval=0.5, what="4 redelivered groups")
        again = scored_messages(broker)[4:]
        assert sorted(g.group_id for g in again) == sorted(published)
        for g in again:
            assert g == published[g.group_id]  # the same scored group, same ids, same rewards
        # nothing was run again: the answers came from the redelivery table
        assert len(list(read_topic(broker, kafka.SANDBOX_TRACES, sandbox_pb2.ExecutionTrace, idle_seconds=0.5))) == traces

        # 4. the synchronous path
        with RewardClient(reward.address, timeout=30) as client:
            scored = client.score(code)
            assert [t.reward.total for t in scored.trajectories] == [1.0, 0.0]
            domains = client.list_domains()
            assert {d.domain for d in domains.domains} >= {"toy", "math", "code", "rg"}
            assert "code.all_pass" in domains.verifiers and not domains.reward_model_loaded
            long = rollout_group("toy.copy", "4", ["4 " * 600])
            unknown_verifier = rollout_group("toy.copy", "4", ["4"], metadata={"verifier": "telepathy"})
            for g, field in [(rollout_group("nope", "1", ["1"]), "group.task.domain"),
                             (rollout_group("math", "", ["\\boxed{1}"]), "group.task.reference_answer"),
                             (long, "group.trajectories[0].completion_text"),
                             (unknown_verifier, "group.task.metadata[verifier]"),
                             (rollout_group("code", '{"tests": []}', [RIGHT]), "group.task.reference_answer.tests"),
                             (common_pb2.RolloutGroup(task=common_pb2.Task(domain="toy.copy")), "group.group_id")]:
                with pytest.raises(grpc.RpcError) as e:
                    client.score(g)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
                assert e.value.details().startswith(field + ":"), (field, e.value.details())
    finally:
        producer.close()
        reward.stop()
        sandbox.stop()
