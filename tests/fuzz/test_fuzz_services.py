"""Fuzzed contracts: hypothesis-drawn malformed and extreme requests to every gRPC method of every
service, and messages to every Kafka consumer, of one real stack (``temper up``: the embedded broker,
the tiny model, real runsc), on loopback.

Properties, per case:
- **no crash**: the service's process (the pid it started with: the stack's supervisor would restart a
  dead one) still runs and answers its health check SERVING;
- **no hang**: the call answers within its deadline; DEADLINE_EXCEEDED is an answer only where the
  request asks for a wait (``WAITS``) and the server says so itself;
- **the right status**: OK, or a client-error status (``CLIENT_ERRORS``) whose details start with the
  offending field (``field: why``; its first component a field of the request); never UNKNOWN or
  INTERNAL, which is what an exception the servicer did not expect becomes;
- **consumers move on**: after a batch of fuzzed messages and one good one, every consumer group of the
  topic committed past the good one (nothing is retried forever), and each message that does not decode
  is on ``<topic>.dlq``, once per group.

Methods come from the generated descriptors (``strategies.methods()``): a new method is fuzzed with no
code here; ``test_strategies.py`` fails until ``targets.py`` knows its service's process and has a valid
request of it (the seed its mutations start from; ``test_seeds_are_accepted`` checks it is valid).
Consumer groups are ``targets.CONSUMERS``, checked against the broker's. Size: ``TEMPER_FUZZ_EXAMPLES``
cases per method (default 25) and a third of it per topic (each a batch of up to 4 messages);
derandomized, without a database and without shrinking, so every run tries the same cases.
``TEMPER_FUZZ_REPORT=PATH`` writes the cases tried per method and their answers as JSON.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections import Counter, defaultdict
from pathlib import Path

import grpc
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from kafka import KafkaAdminClient, KafkaConsumer
from kafka.structs import TopicPartition

from temper.client import transport
from temper.client.sdk import LearnerClient, SchedulerClient
from temper.runtime import kafka
from temper.runtime.launcher import pid_alive
from temper.runtime.rpc import check_health
from temper.v1 import common_pb2, sandbox_pb2, scheduler_pb2
from tests import builders
from tests.conftest import wait_until
from tests.fuzz import strategies
from tests.fuzz.targets import CONSUMERS, SEEDS, SERVICE_OF, TOPIC_TYPES, Context, covered_methods

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("TEMPER_FUZZ_EXAMPLES", "25"))
# no shrinking: each step of it is a real call, and a derandomized run finds the same case again anyway
settings.register_profile("temper-fuzz", max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
                          suppress_health_check=list(HealthCheck), print_blob=False,
                          phases=[Phase.explicit, Phase.generate])
settings.register_profile("temper-fuzz-kafka", parent=settings.get_profile("temper-fuzz"),
                          max_examples=max(3, EXAMPLES // 3))

S = grpc.StatusCode
CLIENT_ERRORS = {S.INVALID_ARGUMENT, S.OUT_OF_RANGE, S.NOT_FOUND, S.FAILED_PRECONDITION, S.ALREADY_EXISTS,
                 S.RESOURCE_EXHAUSTED}
# methods whose request asks for a wait: a short deadline of their own
WAITS = {"ReplayService.Sample": 3.0, "ReplayService.SampleStream": 3.0}
DEADLINE = 60.0                        # any other call: a hang if it has not answered by then
MAX_SEND = 16 << 20                    # bigger draws are cut there (still a malformed request)
MAX_KAFKA = 900 << 10                  # under the producer's 1 MiB message limit
FIELD = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)[^:]*: ")


def check_status(method: strategies.Method, code: grpc.StatusCode, details: str) -> None:
    if code == S.OK:
        return
    if code == S.DEADLINE_EXCEEDED and method.id in WAITS:
        assert details != "Deadline Exceeded", "the client's deadline passed: the server never answered"
        return
    assert code in CLIENT_ERRORS, f"{method.id} answered {code.name}: {details[:500]}"
    m = FIELD.match(details)
    assert m, f"{method.id} {code.name} names no field: {details[:500]}"
    if not method.streaming_request:  # a stream's errors name the stream's items in their own words
        fields = {f.name for f in method.method.input_type.fields} | {"request"}
        assert m.group(1) in fields, f"{method.id} {code.name} does not name a request field: {details[:500]}"


def call(channel: grpc.Channel, method: strategies.Method, request, timeout: float):
    """Send ``request`` (bytes, or a list of them for a client stream) as they are; (code, details)."""
    kind = {(False, False): channel.unary_unary, (True, False): channel.stream_unary,
            (False, True): channel.unary_stream, (True, True): channel.stream_stream}
    fn = kind[(method.method.client_streaming, method.method.server_streaming)](method.path)
    try:
        out = fn(iter(request) if method.streaming_request else request, timeout=timeout)
        if method.method.server_streaming:
            list(out)
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return S.OK, ""


def _cut(request, limit: int):
    return [r[:limit] for r in request] if isinstance(request, list) else request[:limit]


ANSWERS: defaultdict[str, Counter[str]] = defaultdict(Counter)  # method id (or topic) -> outcome -> cases


@pytest.fixture(scope="module", autouse=True)
def report():
    """With ``TEMPER_FUZZ_REPORT=PATH``: the cases tried per method and what they were answered, as JSON."""
    yield
    path = os.environ.get("TEMPER_FUZZ_REPORT")
    if path:
        Path(path).write_text(json.dumps({k: dict(v) for k, v in sorted(ANSWERS.items())}, indent=1))


@pytest.fixture(scope="module")
def context(stack, tmp_path_factory):
    args = stack.load().services["inference"].args
    return Context(model_dir=Path(args[args.index("--model-dir") + 1]), tmp=tmp_path_factory.mktemp("fuzz"))


@pytest.fixture(scope="module")
def started(stack):
    """Each service's pid when the module began: a different (or no) process later is a crash."""
    return {n: p.pid for n, p in stack.load().services.items()}


def assert_alive(stack, started, name: str) -> None:
    state = stack.load()
    assert pid_alive(started[name]), f"{name} (pid {started[name]}) died; log: {state.services[name].log}"
    assert check_health(state.services[name].address, timeout=10) == "SERVING", f"{name} is not SERVING"


def _settle(stack) -> None:
    """What a fuzz case may have started is stopped (a valid StartJob runs a job, Pause pauses the learner)."""
    s = stack.load().services
    with SchedulerClient(s["scheduler"].address) as scheduler:
        for job in scheduler.list_jobs():
            if job.state in (scheduler_pb2.JOB_STATE_RUNNING, scheduler_pb2.JOB_STATE_PAUSED):
                scheduler.stop_job(job.job_id)
    with LearnerClient(s["learner"].address) as learner:
        learner.resume()


@pytest.mark.parametrize("method", covered_methods(), ids=lambda m: m.id)
def test_seeds_are_accepted(stack, context, method):
    """The valid requests the fuzz cases start from are valid (else the mutations test only the first check)."""
    address = stack.load().services[SERVICE_OF[method.service.full_name]].address
    with transport.channel(address) as channel:
        for seed in SEEDS[method.id](context):
            request = [r.SerializeToString() for r in seed] if method.streaming_request else seed.SerializeToString()
            code, details = call(channel, method, request, DEADLINE)
            # a method that waits (WAITS) may run out of groups to draw: its request passed every check
            waited = code == S.DEADLINE_EXCEEDED and method.id in WAITS
            assert code in (S.OK, S.NOT_FOUND, S.FAILED_PRECONDITION) or waited, f"{code.name}: {details}"
            check_status(method, code, details)  # (StartJob's second seed: a job is running, naming spec.job_id)
    _settle(stack)


@pytest.mark.parametrize("method", covered_methods(), ids=lambda m: m.id)
def test_grpc_method_survives_fuzzed_requests(stack, started, context, method):
    name = SERVICE_OF[method.service.full_name]
    seeds = SEEDS[method.id](context)
    address = stack.load().services[name].address
    timeout = WAITS.get(method.id, DEADLINE)
    channel = transport.channel(address)

    @settings(settings.get_profile("temper-fuzz"))
    @given(request=strategies.request_strategy(method, seeds))
    def case(request):
        code, details = call(channel, method, _cut(request, MAX_SEND), timeout)
        field = FIELD.match(details)
        ANSWERS[method.id][f"{code.name} {field.group(1)}" if field and code != S.OK else code.name] += 1
        check_status(method, code, details)
        assert_alive(stack, started, name)

    try:
        case()
    finally:
        channel.close()
        _settle(stack)


# -- Kafka consumers -----------------------------------------------------------------------------------------

def _good(topic: str, key: str):
    if topic == kafka.ROLLOUTS:
        return builders.rollout_group("toy.copy", reference="1 2", texts=["1 2", "2 1"], group_id=key)
    if topic == kafka.SCORED:
        return builders.scored_group(key)
    if topic == kafka.METRICS:
        return common_pb2.StepMetrics(job_id="fuzz", step=1, policy_version=1, mean_reward=0.5, samples=2)
    if topic == kafka.SANDBOX_TRACES:
        return sandbox_pb2.ExecutionTrace(
            execution_id=key, method="RunTests",
            run_tests_request=sandbox_pb2.RunTestsRequest(
                tests=[sandbox_pb2.TestCase(stdin=b"1\n", expected_stdout=b"1\n")]),
            run_tests_response=sandbox_pb2.RunTestsResponse(results=[sandbox_pb2.ExecuteResponse(stdout=b"1\n")]),
            origin=sandbox_pb2.ExecutionOrigin(job_id="fuzz", group_id=f"{key}/g", trajectory_ids=[f"{key}/g/0"]))
    raise AssertionError(f"no good message for {topic}: add one here")


def _committed(admin: KafkaAdminClient, group: str) -> dict[str, int]:
    return {tp.topic: om.offset for tp, om in admin.list_group_offsets(group).get(group, {}).items()}


@pytest.fixture(scope="module")
def consumers(stack):
    """``CONSUMERS``, once each group committed a good message on its topic (it is up and reading)."""
    bootstrap = stack.load().kafka_bootstrap
    producer = kafka.ProtoProducer(bootstrap, "fuzz")
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="fuzz-admin")
    for topic in CONSUMERS:
        key = f"warm-{uuid.uuid4().hex[:8]}"
        producer.send(topic, key, _good(topic, key)).get(30)
    wait_until(lambda: all(topic in _committed(admin, g) for topic, groups in CONSUMERS.items() for g in groups),
               120, 0.2, "every consumer group to commit")
    yield CONSUMERS
    producer.close()
    admin.close()


def test_the_broker_knows_no_consumer_the_suite_does_not_fuzz(stack, consumers):
    admin = KafkaAdminClient(bootstrap_servers=stack.load().kafka_bootstrap, client_id="fuzz-admin")
    try:
        groups = {g["group_id"] for g in admin.list_groups()}
    finally:
        admin.close()
    assert groups <= {g for gs in consumers.values() for g in gs}, "add the new consumer to targets.CONSUMERS"


def _kafka_payloads(message_type) -> st.SearchStrategy[list[bytes]]:
    d = message_type.DESCRIPTOR
    one = st.one_of(strategies.message_strategy(d).map(lambda m: m.SerializeToString()), strategies.raw_request(d))
    return st.lists(one.map(lambda b: b[:MAX_KAFKA]), min_size=1, max_size=4)


def _undecodable(message_type, value: bytes) -> bool:
    try:
        message_type.FromString(value)
    except DecodeError:
        return True
    return False


@pytest.mark.parametrize("topic", list(CONSUMERS))
def test_kafka_consumers_survive_fuzzed_messages(stack, started, consumers, topic):
    bootstrap = stack.load().kafka_bootstrap
    groups = consumers[topic]
    message_type = TOPIC_TYPES[topic]
    producer = kafka.ProtoProducer(bootstrap, "fuzz")
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="fuzz-admin")
    dlq = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None, auto_offset_reset="earliest")
    dlq_tp = TopicPartition(f"{topic}.dlq", 0)
    dlq.assign([dlq_tp])
    dlq.seek_to_beginning(dlq_tp)
    dead: Counter[bytes] = Counter()

    @settings(settings.get_profile("temper-fuzz-kafka"))
    @given(payloads=_kafka_payloads(message_type))
    def case(payloads):
        run = uuid.uuid4().hex[:8]
        keys = [f"fuzz-{run}-{i}".encode() for i in range(len(payloads))]
        for key, value in zip(keys, payloads):
            producer.send_raw(topic, key, value, []).get(30)
        good = f"good-{run}"
        last = producer.send(topic, good, _good(topic, good)).get(30).offset

        def moved_on():
            return all(_committed(admin, g).get(topic, -1) > last for g in groups)

        wait_until(moved_on, 60, 0.1, f"every group of {topic} ({groups}) to commit past the good message "
                                      f"(offset {last}): a consumer is stuck on a fuzzed one")
        want = {k: len(groups) for k, v in zip(keys, payloads) if _undecodable(message_type, v)}

        def dead_lettered():
            for records in dlq.poll(timeout_ms=100).values():
                dead.update(r.key for r in records)
            return all(dead[k] >= n for k, n in want.items())

        wait_until(dead_lettered, 30, 0.05, f"the undecodable messages on {topic}.dlq")
        ANSWERS[f"kafka:{topic}"]["dead-lettered (undecodable)"] += len(want)
        ANSWERS[f"kafka:{topic}"]["messages"] += len(payloads)
        for name in started:
            assert_alive(stack, started, name)

    try:
        case()
    finally:
        dlq.close()
        admin.close()
        producer.close()
