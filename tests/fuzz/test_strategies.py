"""The fuzz strategies themselves (no server): every method of every temper.v1 service has one, and
what they draw is what the fuzz suite claims to send."""

import math
from pathlib import Path

import pytest
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass
from hypothesis import given, settings
from hypothesis import strategies as st

from temper.runtime import kafka
from tests.fuzz import strategies
from tests.fuzz.targets import CONSUMERS, SEEDS, SERVICE_OF, TOPIC_TYPES, Context, covered_methods

METHODS = strategies.methods()


def test_every_method_of_every_service_is_fuzzed():
    assert len(METHODS) >= 25  # the enumeration found the services at all
    services = {m.service.full_name for m in METHODS}
    assert services - set(SERVICE_OF) == set(), "a service the fuzz suite does not know where to find"
    assert {m.id for m in METHODS} == {m.id for m in covered_methods()}
    assert {m.id for m in METHODS} - set(SEEDS) == set(), "a method with no valid request to start its fuzz cases from"


@pytest.mark.parametrize("method", [m for m in METHODS if m.id != "InferenceService.UpdateWeights"], ids=lambda m: m.id)
def test_seeds_are_requests_of_their_method(method, tmp_path):
    seeds = SEEDS[method.id](Context(model_dir=tmp_path, tmp=tmp_path))
    assert seeds
    for seed in seeds:
        for request in seed if method.streaming_request else [seed]:
            assert request.DESCRIPTOR is method.method.input_type


def test_every_topic_has_a_message_type():
    assert set(kafka.ALL_TOPICS) <= set(TOPIC_TYPES), "a topic the Kafka fuzz does not know the type of"
    assert set(CONSUMERS) <= set(kafka.ALL_TOPICS)


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.id)
@settings(max_examples=15, derandomize=True, database=None, deadline=None)
@given(data=st.data())
def test_request_strategy_draws_for(method, data):
    seeds = [] if method.id == "InferenceService.UpdateWeights" else SEEDS[method.id](
        Context(model_dir=Path("/nonexistent"), tmp=Path("/tmp")))
    sent = data.draw(strategies.request_strategy(method, seeds))
    for request in sent if method.streaming_request else [sent]:
        assert isinstance(request, bytes)
        try:  # what parses is a message of the method's input type (of any size under the send limit)
            GetMessageClass(method.method.input_type).FromString(request)
        except DecodeError:
            pass


def _floats(message):
    for field, value in message.ListFields():
        if field.message_type is not None:
            items = value.values() if field.message_type.GetOptions().map_entry else (
                value if field.is_repeated else [value])
            for v in items:
                yield from _floats(v) if hasattr(v, "ListFields") else ([v] if isinstance(v, float) else [])
        elif isinstance(value, float):
            yield value
        elif field.is_repeated and value and isinstance(value[0], float):
            yield from value


def test_strategies_reach_the_extremes():
    """The extreme values do come out: NaN and infinities, min/max ints, huge strings, many items, unknown enums."""
    from temper.v1 import common_pb2, replay_pb2, sandbox_pb2

    seen = {"nan": False, "inf": False, "int64 min": False, "huge string": False, "many items": False,
            "unknown enum": False}

    @settings(max_examples=300, derandomize=True, database=None, deadline=None)
    @given(strategies.message_strategy(common_pb2.Trajectory.DESCRIPTOR),
           strategies.message_strategy(replay_pb2.SampleRequest.DESCRIPTOR),
           strategies.message_strategy(sandbox_pb2.RunTestsRequest.DESCRIPTOR))
    def look(t, s, r):
        fs = list(_floats(t))
        seen["nan"] |= any(math.isnan(f) for f in fs)
        seen["inf"] |= any(math.isinf(f) for f in fs)
        seen["int64 min"] |= -(2**63) in (s.current_policy_version, t.policy_version)
        seen["huge string"] |= len(t.completion_text) >= 1000
        seen["many items"] |= len(t.completion_token_ids) >= 100
        seen["unknown enum"] |= r.output_match not in sandbox_pb2.OutputMatch.values()

    look()
    assert all(seen.values()), seen
