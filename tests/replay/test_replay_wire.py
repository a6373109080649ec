"""replay/wire.py: the wire views count packed arrays exactly as parsing would, refuse what the
real parser refuses, and serialize back to the bytes they came from."""

import numpy as np
import pytest
from google.protobuf.message import DecodeError

from temper.replay.wire import RolloutGroupView, array_lengths, needs_full_parse, upgrade_token_ids, varint
from temper.v1 import common_pb2
from tests.replay.util import schema1_bytes


def group(seed: int) -> common_pb2.RolloutGroup:
    rng = np.random.default_rng(seed)
    g = common_pb2.RolloutGroup(group_id=f"g{seed}", task=common_pb2.Task(domain="d"))
    for k in range(3):
        n = int(rng.integers(1, 300))
        ids = rng.integers(-2**31, 2**31, n, dtype=np.int64)  # negatives (10-byte varints in schema 1)
        ids[: n // 2] = rng.integers(0, 128, n // 2)  # and small ones
        g.trajectories.add(trajectory_id=f"t{k}", prompt_token_ids=rng.integers(0, 50_000, 7).tolist(),
                           completion_token_ids=ids.tolist(), completion_logprobs=(-rng.random(n)).tolist())
    return g


@pytest.mark.parametrize("seed", range(5))
def test_views_count_like_the_parser_and_serialize_back(seed):
    g = group(seed)
    data = g.SerializeToString()
    view = RolloutGroupView.FromString(data)
    assert not needs_full_parse(view)
    for t, v in zip(g.trajectories, view.trajectories):
        assert array_lengths(v) == (len(t.completion_token_ids), len(t.completion_logprobs), None)
    assert view.SerializeToString() == data


def test_malformed_packed_arrays_are_named():
    def traj(ids: bytes, floats: bytes) -> bytes:
        return b"\x22" + varint(len(ids)) + ids + b"\x2a" + varint(len(floats)) + floats

    view = RolloutGroupView.FromString(b"\x2a" + varint(len(t := traj(b"\x01\x85", b"\0" * 8))) + t)
    assert array_lengths(view.trajectories[0])[2] == "completion_token_ids"  # half a 4-byte id
    with pytest.raises(DecodeError):  # the real parser refuses it too
        common_pb2.RolloutGroup.FromString(b"\x2a" + varint(len(t)) + t)
    view = RolloutGroupView.FromString(b"\x2a" + varint(len(t := traj(b"\0" * 12, b"\0" * 4))) + t)
    assert array_lengths(view.trajectories[0]) == (3, 1, None)
    view = RolloutGroupView.FromString(b"\x2a" + varint(len(t := traj(b"\0" * 4, b"\0" * 5))) + t)
    assert array_lengths(view.trajectories[0])[2] == "completion_logprobs"
    prompt = b"\x1a\x03\0\0\0"
    view = RolloutGroupView.FromString(b"\x2a" + varint(len(t := prompt + traj(b"\0" * 4, b"\0" * 4))) + t)
    assert array_lengths(view.trajectories[0])[2] == "prompt_token_ids"


@pytest.mark.parametrize("seed", range(3))
def test_schema1_groups_upgrade_to_the_same_message(seed):
    """Replay schema 1 stored token ids as varints: upgrade_token_ids gives the current bytes of
    the same message (negative ids and every other field kept)."""
    g = group(seed)
    g.trajectories[0].reward.step_rewards.extend([0.5, -1.0])
    g.trace_context["traceparent"] = "00-x"
    old = schema1_bytes(g)
    assert old != g.SerializeToString()
    assert common_pb2.RolloutGroup.FromString(upgrade_token_ids(old)) == g
