"""At-least-once consumption against the real broker: retries, dead letters, trace headers."""

import threading

from kafka import KafkaConsumer
from kafka.structs import TopicPartition
from opentelemetry import trace

from temper.runtime import kafka
from temper.runtime.errors import InvalidArgument
from temper.v1 import common_pb2
from tests.conftest import wait_until


def _groups(n):
    return [common_pb2.RolloutGroup(group_id=f"g{i}") for i in range(n)]


def test_failed_handler_is_retried_not_skipped_and_bad_messages_dead_letter(broker):
    kafka.ensure_topics(broker, (kafka.ROLLOUTS,))
    producer = kafka.ProtoProducer(broker, "test")
    for g in _groups(3):
        producer.send(kafka.ROLLOUTS, g.group_id, g).get(10)
    producer.send_raw(kafka.ROLLOUTS, b"junk", b"\xff\xff\xff not a protobuf", []).get(10)
    producer.send(kafka.ROLLOUTS, "invalid", common_pb2.RolloutGroup(group_id="invalid")).get(10)
    seen, failed_once = [], threading.Event()

    def handle(g):
        if g.group_id == "g1" and not failed_once.is_set():
            failed_once.set()
            raise ConnectionError("dependency down")  # transient: must be retried
        if g.group_id == "invalid":
            raise InvalidArgument("bad", field="group")  # permanent: dead-lettered
        seen.append(g.group_id)

    consumer = kafka.ProtoConsumer(broker, kafka.ROLLOUTS, "t", common_pb2.RolloutGroup, handle, retry_backoff=0.1)
    consumer.start()
    try:
        wait_until(lambda: consumer.dead_lettered == 2, 30, what="dead letters")
    finally:
        consumer.stop()
    assert seen == ["g0", "g1", "g2"]  # g1 retried, in order, none skipped
    dlq = KafkaConsumer(bootstrap_servers=broker, group_id=None, auto_offset_reset="earliest")
    tp = TopicPartition(f"{kafka.ROLLOUTS}.dlq", 0)
    dlq.assign([tp])
    dlq.seek_to_beginning(tp)
    records = [r for recs in dlq.poll(timeout_ms=5000).values() for r in recs]
    dlq.close()
    assert [r.key for r in records] == [b"junk", b"invalid"]
    assert all(any(k == "temper-error" for k, _ in r.headers) for r in records)
    producer.close()


def test_trace_context_travels_in_headers(broker):
    from opentelemetry.sdk.trace import TracerProvider

    kafka.ensure_topics(broker, (kafka.SCORED,))
    provider = TracerProvider()
    tracer = provider.get_tracer("t")
    producer = kafka.ProtoProducer(broker, "test")
    with tracer.start_as_current_span("root") as root:
        producer.send(kafka.SCORED, "g", common_pb2.RolloutGroup(group_id="g")).get(10)
        want = root.get_span_context().trace_id
    got = []
    consumer = kafka.ProtoConsumer(broker, kafka.SCORED, "t", common_pb2.RolloutGroup,
                                   lambda g: got.append(trace.get_current_span().get_span_context().trace_id))
    # the consumer's own span is a no-op without a global provider, but its parent context is extracted
    consumer._tracer = tracer
    consumer.start()
    try:
        wait_until(lambda: got, 30, what="message")
    finally:
        consumer.stop()
    producer.close()
    assert got == [want]
