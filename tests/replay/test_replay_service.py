"""The replay service as a real process: gRPC contract, Kafka ingest into several tables, bad input."""

import math
import struct

import grpc
import pytest

from temper.client.sdk import ReplayClient
from temper.runtime import kafka
from temper.runtime.launcher import pid_alive
from temper.runtime.rpc import check_health
from temper.v1 import common_pb2, replay_pb2
from temper.replay.wire import varint
from tests.conftest import wait_until
from tests.builders import scored_group
from tests.replay.util import start_replay

pytestmark = pytest.mark.slow  # starts a broker and the replay service

CONFIG = """
[replay]
ingest_tables = ["default", "prio"]
max_batch = 256

[replay.tables.default]

[replay.tables.prio]
sampler = "prioritized"
priority_exponent = 0.5
importance_sampling_exponent = 0.4
max_times_sampled = 0
initial_priority = 1.0
seed = 7

[replay.tables.lag]
sampler = "uniform"
max_times_sampled = 0
max_policy_lag = 2
domain_quotas = { "math" = 2 }

[replay.tables.lease]

[replay.tables.stream]
"""
IA = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def replay(tmp_path_factory, replay_model_dir):
    launcher, pids = start_replay(tmp_path_factory.mktemp("replay-svc"), replay_model_dir, CONFIG)
    state = launcher.load()
    client = ReplayClient(state.services["replay"].address, timeout=30)
    yield client, state
    client.close()
    launcher.down()
    assert not [p for p in pids if pid_alive(p)], "processes left behind"


def expect(code, field, call, *args, **kwargs):
    with pytest.raises(grpc.RpcError) as e:
        call(*args, **kwargs)
    assert e.value.code() == code, e.value.details()
    assert field in e.value.details(), e.value.details()


def test_kafka_ingest_reaches_every_ingest_table(replay):
    client, state = replay
    producer = kafka.ProtoProducer(state.kafka_bootstrap, "test")
    for i in range(3):
        g = scored_group(f"kafka-{i}", n=4)
        producer.send(kafka.SCORED, g.group_id, g).get(10)
    producer.close()
    wait_until(lambda: client.stats("default").size == 3 and client.stats("prio").size == 3, 60, what="ingest")
    groups = client.sample(3, timeout_ms=0)
    assert [g.group_id for g in groups] == ["kafka-0", "kafka-1", "kafka-2"]
    assert all(len(g.trajectories) == 4 for g in groups)
    assert client.stats("lag").size == 0  # not an ingest table


def test_prioritized_sampling_reports_probabilities_and_weights(replay):
    client, _ = replay
    r = client.insert([scored_group(f"p{i}") for i in range(3)], table="prio", priorities=[4.0, 1.0, 0.0])
    assert r.inserted == 3
    resp = client.sample_batch(200, table="prio", timeout_ms=0)
    assert len(resp.groups) == len(resp.info) == 200
    weights = {"p0": 2.0, "p1": 1.0, "p2": 0.0}  # priority ** 0.5 (kafka-* have priority 1.0: weight 1)
    total = sum(weights.values()) + 3.0
    for g, info in zip(resp.groups, resp.info):
        assert g.group_id == info.group_id and info.table_size == 6
        w = weights.get(info.group_id, 1.0)
        assert info.probability == pytest.approx(w / total)
        assert info.importance_weight == pytest.approx((1.0 / w) ** 0.4)  # (p_min / p_i)^beta, p_min = weight 1
    assert "p2" not in {i.group_id for i in resp.info}  # priority 0: never drawn
    # the learner re-prioritises: p2 up, p0 down to 0
    r = client.update_priorities({"p2": 9.0, "p0": 0.0, "nope": 1.0}, table="prio")
    assert (r.updated, list(r.unknown_group_ids)) == (2, ["nope"])
    ids = [i.group_id for i in client.sample_batch(200, table="prio", timeout_ms=0, importance_sampling_exponent=0).info]
    assert "p0" not in ids and ids.count("p2") > ids.count("p1")


def test_a_leased_sample_is_acknowledged_requeued_or_refused_through_grpc(replay):
    client, _ = replay
    client.insert([scored_group("l0"), scored_group("l1")], table="lease")
    held = client.sample_batch(2, table="lease", timeout_ms=0, lease_ms=60_000)
    assert [g.group_id for g in held.groups] == ["l0", "l1"] and held.lease_id
    stats = client.stats("lease")
    assert (stats.size, stats.leases, stats.leased, dict(stats.lease_outcomes)) == (0, 1, 2, {})
    assert client.ack_sample(held.lease_id, "extend", extend_ms=60_000).groups == 2
    assert client.ack_sample(held.lease_id, "requeue").groups == 2  # back, as if never drawn
    again = client.sample_batch(2, table="lease", timeout_ms=0, lease_ms=60_000)
    assert [g.group_id for g in again.groups] == ["l0", "l1"]
    assert client.ack_sample(again.lease_id).groups == 2
    stats = client.stats("lease")
    assert stats.size == 0 and stats.removed["sampled_out"] == 2
    assert (stats.leases, stats.leased, dict(stats.lease_outcomes)) == (0, 0, {"acked": 1, "requeued": 1})
    expect(grpc.StatusCode.NOT_FOUND, "lease_id", client.ack_sample, again.lease_id)  # settled already
    expect(IA, "lease_id", client.ack_sample, "")
    expect(IA, "extend_ms", client.ack_sample, "x", "extend")
    expect(IA, "extend_ms", client.ack_sample, "x", "ack", extend_ms=5)
    expect(IA, "lease_ms", client.sample_batch, 1, table="lease", timeout_ms=0, lease_ms=-1)
    expect(IA, "action", client.stub.AckSample, replay_pb2.AckSampleRequest(lease_id="x", action=7))
    assert client.stats("lease").size == 0  # nothing of the refused calls took or gave anything


def test_policy_lag_and_quota_through_grpc(replay):
    client, _ = replay
    client.insert([scored_group("m0", domain="math", version=5), scored_group("m1", domain="math", version=5),
                   scored_group("m2", domain="math", version=6), scored_group("c0", domain="code", version=4)], table="lag")
    s = client.stats("lag")
    assert dict(s.domain_counts) == {"math": 2, "code": 1} and s.removed["quota"] == 1
    resp = client.sample_batch(50, table="lag", timeout_ms=0, current_policy_version=7)  # lag 2: versions >= 5
    assert {i.group_id for i in resp.info} == {"m1", "m2"} and resp.current_policy_version == 7
    s = client.stats("lag")
    assert s.current_policy_version == 7 and s.removed["stale"] == 1 and dict(s.policy_version_counts) == {5: 1, 6: 1}
    assert s.rate_limiter.can_sample and s.config.max_policy_lag == 2 and sum(b.count for b in s.age_seconds) == 2


def test_bad_input_is_refused_naming_the_field_and_harms_nothing(replay):
    client, state = replay
    client.insert([scored_group("keep-1"), scored_group("keep-2")], table="default")
    before = client.stats("default")
    expect(IA, "table", client.sample, 1, table="nope", timeout_ms=0)
    expect(IA, "table", client.stats, "nope")
    expect(IA, "table", client.update_priorities, {"x": 1.0}, table="nope")
    expect(IA, "requests[1].table", client.stub.Insert, iter([
        replay_pb2.InsertRequest(table="default", group=scored_group("new-1")),
        replay_pb2.InsertRequest(table="nope", group=scored_group("new-2"))]), timeout=10)
    for bad in (0, -3, 257):  # max_batch = 256
        expect(IA, "batch_size", client.sample, bad, table="default", timeout_ms=0)
    expect(IA, "timeout_ms", client.sample, 1, table="default", timeout_ms=-1)
    expect(IA, "priorities['keep-1']", client.update_priorities, {"keep-2": 1.0, "keep-1": -1.0}, table="default")
    expect(IA, "priorities['keep-2']", client.update_priorities, {"keep-2": math.nan}, table="default")
    expect(IA, "requests[0].priorities[1]", client.insert, [scored_group("new-3"), scored_group("new-4")],
           table="default", priorities=[1.0, -0.5])  # the SDK sends one batch message
    expect(IA, "requests[1].priority", client.stub.Insert, iter([
        replay_pb2.InsertRequest(table="default", group=scored_group("new-3"), priority=1.0),
        replay_pb2.InsertRequest(table="default", group=scored_group("new-4"), priority=-0.5)]), timeout=10)
    expect(IA, "requests[0].priorities", client.stub.Insert, iter([replay_pb2.InsertRequest(
        table="default", groups=[scored_group("new-3"), scored_group("new-4")], priorities=[1.0])]), timeout=10)
    malformed = scored_group("new-5")
    malformed.trajectories[1].completion_logprobs.pop()
    expect(IA, "requests[0].groups[1].trajectories[1].completion_logprobs", client.insert,
           [scored_group("new-6"), malformed], table="default")
    expect(IA, "requests[1].group.trajectories[1].completion_logprobs", client.stub.Insert, iter([
        replay_pb2.InsertRequest(table="default", group=scored_group("new-6")),
        replay_pb2.InsertRequest(table="default", group=malformed)]), timeout=10)
    expect(IA, "requests[0].group", client.stub.Insert, iter([replay_pb2.InsertRequest(table="default")]), timeout=10)
    expect(IA, "importance_sampling_exponent", client.sample_batch, 1, table="prio", timeout_ms=0,
           importance_sampling_exponent=-1.0)
    expect(IA, "checkpoint_id", client.restore, "../escape")
    expect(grpc.StatusCode.NOT_FOUND, "checkpoint_id", client.restore, "replay-missing")
    after = client.stats("default")
    assert (after.size, after.inserts, after.duplicates) == (before.size, before.inserts, before.duplicates)
    got = {g.group_id: g for g in client.sample(after.size, table="default", timeout_ms=0)}  # FIFO: all of it
    assert set(got) == {"keep-1", "keep-2"}
    assert got["keep-1"] == scored_group("keep-1")  # intact
    assert check_health(state.services["replay"].address) == "SERVING"


def test_sample_waits_for_enough_groups_then_times_out(replay):
    client, _ = replay
    with pytest.raises(grpc.RpcError) as e:
        client.sample(5, timeout_ms=200)  # default table: FIFO, sample-once, empty
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "batch_size" in e.value.details()


def test_checkpoint_and_restore_through_grpc(replay):
    client, _ = replay
    client.insert([scored_group("ck-a"), scored_group("ck-b")])
    ckpt = client.checkpoint()
    assert ckpt.table_sizes["default"] == 2 and ckpt.bytes > 0
    assert [g.group_id for g in client.sample(2, timeout_ms=0)] == ["ck-a", "ck-b"]
    assert client.stats().size == 0
    assert client.restore(ckpt.checkpoint_id).table_sizes["default"] == 2
    assert [g.group_id for g in client.sample(2, timeout_ms=0)] == ["ck-a", "ck-b"]
    assert isinstance(client.sample_batch(1, table="prio", timeout_ms=0).groups[0], common_pb2.RolloutGroup)


def _len(data: bytes) -> bytes:
    return varint(len(data)) + data


def test_groups_are_validated_from_the_wire_packed_or_not(replay):
    """The server counts packed arrays without decoding them (replay/wire.py): unpacked arrays
    (legal protobuf) are still read right, malformed packed arrays are refused naming the field."""
    client, _ = replay
    raw_insert = client._channel.stream_unary("/temper.v1.ReplayService/Insert", request_serializer=bytes,
                                              response_deserializer=replay_pb2.InsertResponse.FromString)
    g = scored_group("unpacked-1", n=2, tokens=5)
    body = common_pb2.RolloutGroup(group_id=g.group_id, task=g.task)
    trajectories = []
    for t in g.trajectories:
        head = common_pb2.Trajectory(trajectory_id=t.trajectory_id, group_id=t.group_id, prompt_token_ids=t.prompt_token_ids,
                                     policy_version=t.policy_version, reward=t.reward).SerializeToString()
        unpacked = b"".join(b"\x25" + struct.pack("<i", x) for x in t.completion_token_ids)  # field 4, sfixed32 each
        unpacked += b"".join(b"\x2d" + struct.pack("<f", x) for x in t.completion_logprobs)  # field 5, fixed32 each
        trajectories.append(b"\x2a" + _len(head + unpacked))  # RolloutGroup field 5
    group_bytes = body.SerializeToString() + b"".join(trajectories)
    assert common_pb2.RolloutGroup.FromString(group_bytes) == g
    request = replay_pb2.InsertRequest(table="default").SerializeToString() + b"\x12" + _len(group_bytes)
    assert raw_insert(iter([request]), timeout=10).inserted == 1
    got = client.sample_batch(client.stats("default").size, table="default", timeout_ms=5_000)  # FIFO: all of it
    assert g in list(got.groups)

    bad = common_pb2.Trajectory(trajectory_id="x", completion_logprobs=[-1.0], reward=g.trajectories[0].reward)
    bad_bytes = bad.SerializeToString() + b"\x22\x01\x85"  # field 4 packed: one byte, not a whole 4-byte id
    request = (replay_pb2.InsertRequest(table="default").SerializeToString() + b"\x12" +
               _len(common_pb2.RolloutGroup(group_id="bad-varint").SerializeToString() + b"\x2a" + _len(bad_bytes)))
    expect(IA, "requests[0].group.trajectories[0].completion_token_ids", raw_insert, iter([request]), timeout=10)


def test_sdk_insert_future_and_sample_batches_over_one_stream(replay):
    client, _ = replay
    futures = [client.insert_future([scored_group(f"fut-{k}-{i}") for i in range(3)], table="prio") for k in range(3)]
    assert [f.result().inserted for f in futures] == [3, 3, 3]
    batches = list(client.sample_batches(4, table="prio", count=5))
    assert len(batches) == 5 and all(len(b.groups) == len(b.info) == 4 for b in batches)
    assert all(b.info[0].probability > 0 and not b.lease_id for b in batches)
    endless = client.sample_batches(4, table="prio")  # count None: until closed
    assert [len(next(endless).groups) for _ in range(7)] == [4] * 7
    endless.close()
    with pytest.raises(grpc.RpcError) as e:  # errors surface from the batch that failed
        next(client.sample_batches(4, table="nope", count=1))
    assert e.value.code() == IA and "table" in e.value.details()


def test_a_sample_stream_is_validated_and_loses_no_group_of_a_table_whose_draws_use_them_up(replay):
    """SampleStream: bad settings refused with the field named; on a sample-once table a stream needs a lease,
    and the batches drawn ahead for a caller that stops reading go back to the table when their leases run
    out: every group is still there to be drawn (no accepted group lost); one that cannot be filled in time
    ends the stream with DEADLINE_EXCEEDED after the batches it sent."""
    client, _ = replay
    raw = client._sample_stream
    expect(IA, "count", lambda: next(raw(replay_pb2.SampleStreamRequest(table="stream", batch_size=1, count=-1,
                                                                        lease_ms=1000), timeout=10)))
    expect(IA, "timeout_ms", lambda: next(raw(replay_pb2.SampleStreamRequest(
        table="prio", batch_size=1, timeout_ms=10**12), timeout=10)))
    expect(IA, "batch_size", lambda: next(client.sample_batches(0, table="prio", count=1)))
    expect(IA, "lease_ms", lambda: next(client.sample_batches(2, table="stream", count=1)))
    unknown = replay_pb2.SampleStreamRequest(table="prio", batch_size=1).SerializeToString() + b"\xa0\x06\x01"
    stream_raw = client._channel.unary_stream("/temper.v1.ReplayService/SampleStream", request_serializer=bytes,
                                              response_deserializer=replay_pb2.SampleResponse.FromString)
    expect(IA, "request", lambda: next(stream_raw(unknown, timeout=10)))
    ids = [f"st-{i}" for i in range(40)]
    assert client.insert([scored_group(i) for i in ids], table="stream").inserted == 40
    batches = client.sample_batches(2, table="stream", timeout_ms=0, lease_ms=1500)
    first = next(batches)
    assert len(first.groups) == 2 and first.lease_id
    client.ack_sample(first.lease_id)  # these two are used: final
    wait_until(lambda: client.stats("stream").leases > 0, 10, what="draws ahead of the reader")
    batches.close()  # stop reading: whatever was drawn ahead is held by leases, then given back
    wait_until(lambda: client.stats("stream").leases == 0, 30, what="the leases running out")
    assert client.stats("stream").size == 38
    left = list(client.sample_batches(2, table="stream", timeout_ms=0, lease_ms=60_000, count=19))
    got = [g.group_id for b in left for g in b.groups]
    assert sorted(got + [g.group_id for g in first.groups]) == sorted(ids)
    for b in left:
        client.ack_sample(b.lease_id)
    with pytest.raises(grpc.RpcError) as e:  # empty now: the next batch is not ready in time
        list(client.sample_batches(2, table="stream", timeout_ms=200, lease_ms=60_000, count=3))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e.value.details()
