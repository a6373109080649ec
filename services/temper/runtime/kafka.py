"""Kafka I/O for every service: protobuf values, trace context in headers, at-least-once.

Only standard Kafka semantics are used (consumer groups, explicit offset commits, idempotent
acks=all producers), so the same code runs against the embedded broker and a real cluster.

Delivery contract: a consumer commits a message's offset only after its handler returned,
i.e. after the message's effect is durable. A message is therefore delivered at least once;
every message carries a stable id (group_id, trajectory_id) so handlers are idempotent and a
redelivery never double-counts. A message that cannot be decoded, or that its handler refuses
as invalid (InvalidArgument), is published to ``<topic>.dlq`` with the error in a header before
its offset is committed: never silently dropped, never retried forever.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

from google.protobuf.message import DecodeError, Message
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer
from kafka.admin import NewTopic
from kafka.errors import KafkaError, TopicAlreadyExistsError
from kafka.structs import OffsetAndMetadata, TopicPartition
from opentelemetry import context as otel_context
from opentelemetry import trace

from temper.runtime.errors import InvalidArgument
from temper.runtime.logs import get_logger
from temper.runtime.tracing import extract_context, inject_headers

ROLLOUTS = "rollouts"  # RolloutGroup, unscored (scheduler -> reward)
SCORED = "scored"  # RolloutGroup with rewards (reward -> replay, monitor)
METRICS = "metrics"  # StepMetrics (learner -> monitor, CLI)
SANDBOX_TRACES = "sandbox-traces"  # execution traces (sandbox -> reward-model training)
ALERTS = "alerts"  # Alert (monitor)
ALL_TOPICS = (ROLLOUTS, SCORED, METRICS, SANDBOX_TRACES, ALERTS)

M = TypeVar("M", bound=Message)
_log = get_logger(component="kafka")


def ensure_topics(bootstrap: str, topics: tuple[str, ...] = ALL_TOPICS, partitions: int = 1,
                  timeout: float = 30.0) -> None:
    """Create ``topics`` (and their dead-letter twins) if missing; safe to call from every service."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="temper-admin")
            break
        except KafkaError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    try:
        existing = set(admin.list_topics())
        wanted = [t for name in topics for t in (name, f"{name}.dlq") if t not in existing]
        for name in wanted:
            try:
                admin.create_topics([NewTopic(name, partitions, 1)])
            except TopicAlreadyExistsError:
                pass
    finally:
        admin.close()


def messages_in(bootstrap: str, topic: str) -> int:
    """How many messages ``topic`` has ever held: the sum of its partitions' end offsets (0 for a topic the
    broker does not have). Offsets only grow on one broker, so a count below what a producer knows it
    published there means this is another broker (a new embedded one starts empty)."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False)
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
        return sum(consumer.end_offsets(tps).values()) if tps else 0
    finally:
        consumer.close()


class ProtoProducer:
    """Publishes protobuf messages with the current trace context in the headers."""

    def __init__(self, bootstrap: str, client_id: str):
        self._producer = KafkaProducer(bootstrap_servers=bootstrap, client_id=client_id, acks="all",
                                       enable_idempotence=True, linger_ms=5, compression_type="lz4")

    def send(self, topic: str, key: str, message: Message, extra_headers: list[tuple[str, bytes]] = ()):
        """Queue ``message``; returns the send future (``.get()`` waits for the broker's ack)."""
        return self._producer.send(topic, key=key.encode(), value=message.SerializeToString(),
                                   headers=[*inject_headers(), *extra_headers])

    def send_raw(self, topic: str, key: bytes, value: bytes, headers: list[tuple[str, bytes]]):
        return self._producer.send(topic, key=key, value=value, headers=headers)

    def flush(self, timeout: float | None = None) -> None:
        self._producer.flush(timeout)

    def close(self) -> None:
        self._producer.close()


def shard_partitions(consumer: KafkaConsumer, topic: str, index: int, shards: int, timeout: float = 30.0) -> list[int]:
    """The partitions of ``topic`` shard ``index`` of ``shards`` owns: p % shards == index."""
    deadline = time.monotonic() + timeout
    found = consumer.partitions_for_topic(topic)
    while not found and time.monotonic() < deadline:
        time.sleep(0.2)
        found = consumer.partitions_for_topic(topic)
    count = len(found or ())
    if count == 0:
        raise ValueError(f"shard: topic {topic!r} has no partitions")
    if not 0 <= index < shards or count % shards:
        raise ValueError(f"shard: {index}/{shards}: {shards} shards do not divide the {count} partitions of "
                         f"{topic!r} (each shard must own the same number; create the topic with a multiple)")
    return [p for p in sorted(found) if p % shards == index]


class ProtoConsumer:
    """At-least-once consumption of one topic into a handler, on a thread of its own.

    ``handler(message)`` runs inside a span whose parent is the trace context from the Kafka
    headers; when it returns, the message's effect must be durable, and its offset is then
    committed. If it raises, nothing past the message is committed and the message is retried
    after ``retry_backoff`` seconds (a transient failure such as a dependency being down).
    """

    def __init__(self, bootstrap: str, topic: str, group_id: str, message_type: type[M],
                 handler: Callable[[M], None], retry_backoff: float = 1.0, max_poll_records: int = 64,
                 shard: tuple[int, int] | None = None):
        """``shard`` = (i, n): instead of joining the group's partition balancing, own the partitions p of
        ``topic`` with p % n == i (offsets still committed under ``group_id``); the topic's partition count
        must be a multiple of n (ValueError naming ``shard`` if not)."""
        self.topic = topic
        self._message_type = message_type
        self._handler = handler
        self._retry_backoff = retry_backoff
        self._max_poll_records = max_poll_records
        self._consumer = KafkaConsumer(
            *([] if shard else [topic]), bootstrap_servers=bootstrap, group_id=group_id, client_id=group_id,
            enable_auto_commit=False, auto_offset_reset="earliest",
            session_timeout_ms=6000, heartbeat_interval_ms=2000, fetch_max_wait_ms=50)
        if shard is not None:
            try:
                partitions = shard_partitions(self._consumer, topic, *shard)
            except ValueError:
                self._consumer.close(autocommit=False)
                raise
            self._consumer.assign([TopicPartition(topic, p) for p in partitions])
        self._dlq = ProtoProducer(bootstrap, client_id=f"{group_id}-dlq")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"consume-{topic}", daemon=True)
        self._tracer = trace.get_tracer("temper.kafka")
        self.handled = 0
        self.dead_lettered = 0

    def start(self) -> ProtoConsumer:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
        self._dlq.close()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                batches = self._consumer.poll(timeout_ms=200, max_records=self._max_poll_records)
                for tp, records in batches.items():
                    for record in records:
                        if self._stop.is_set() or not self._handle(tp, record):
                            break
                        self._consumer.commit({tp: OffsetAndMetadata(record.offset + 1, "", -1)})
        except Exception:  # noqa: BLE001 - log, the service's health reflects the dead thread
            _log.exception("consumer loop died", topic=self.topic)
            raise
        finally:
            self._consumer.close(autocommit=False)

    def _handle(self, tp: TopicPartition, record) -> bool:
        """Process one record; False means: not done, seek back and retry later."""
        try:
            message = self._message_type.FromString(record.value)
        except DecodeError as e:
            self._dead_letter(record, f"undecodable: {e}")
            return True
        token = otel_context.attach(extract_context(record.headers))
        try:
            with self._tracer.start_as_current_span(f"consume {self.topic}", kind=trace.SpanKind.CONSUMER,
                                               attributes={"messaging.destination": self.topic,
                                                           "messaging.kafka.offset": record.offset}):
                self._handler(message)
        except InvalidArgument as e:
            self._dead_letter(record, str(e))
            return True
        except Exception:  # noqa: BLE001 - retried, never skipped
            _log.exception("handler failed; will retry", topic=self.topic, offset=record.offset)
            self._consumer.seek(tp, record.offset)
            self._stop.wait(self._retry_backoff)
            return False
        finally:
            otel_context.detach(token)
        self.handled += 1
        return True

    def _dead_letter(self, record, error: str) -> None:
        self._dlq.send_raw(f"{self.topic}.dlq", record.key or b"", record.value or b"",
                           [*(record.headers or []), ("temper-error", error.encode())]).get(30)
        self.dead_lettered += 1
        _log.error("message dead-lettered", topic=self.topic, offset=record.offset, error=error)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()
