"""Kafka I/O for every service: protobuf values, trace context in headers, at-least-once.

Only standard Kafka semantics are used (consumer groups, explicit offset commits, acks=all
producers), so the same code runs against the embedded broker and a real cluster.

Delivery contract: a consumer commits a message's offset only after its handler returned,
i.e. after the message's effect is durable. A message is therefore delivered at least once;
every message carries a stable id (group_id, trajectory_id) so handlers are idempotent and a
redelivery never double-counts. A message that cannot be decoded, or that its handler refuses
as invalid (InvalidArgument), is published to ``<topic>.dlq`` with the error in a header before
its offset is committed: never silently dropped, never retried forever.

Security (every client below, and every other Kafka client of Temper, takes ``client_security()``): from
the environment, as the gRPC side takes ``TEMPER_TLS_DIR``.

- ``TEMPER_KAFKA_TLS_DIR``: TLS to the brokers; the folder holds ``ca.crt`` (the brokers' CA) and, for
  mutual TLS (a Strimzi listener with ``authentication: tls``), ``user.crt`` and ``user.key`` (a Strimzi
  KafkaUser's Secret, with the cluster CA's ``ca.crt`` beside them).
- ``TEMPER_KAFKA_SASL_USERNAME`` and ``TEMPER_KAFKA_SASL_PASSWORD_FILE`` (``TEMPER_KAFKA_SASL_MECHANISM``:
  SCRAM-SHA-512 unless set): SASL, over TLS when the TLS folder is set too.

None set: plaintext, as the embedded broker speaks (Tansu 0.6.0 offers neither: README, Security). A
setting that cannot be used (a missing file, an unknown mechanism) is a ``ValueError`` naming the
variable; the password is read from its file and never logged.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
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

TLS_DIR_ENV = "TEMPER_KAFKA_TLS_DIR"
SASL_USERNAME_ENV = "TEMPER_KAFKA_SASL_USERNAME"
SASL_PASSWORD_FILE_ENV = "TEMPER_KAFKA_SASL_PASSWORD_FILE"
SASL_MECHANISM_ENV = "TEMPER_KAFKA_SASL_MECHANISM"
SASL_MECHANISMS = ("SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN")
# file names in TEMPER_KAFKA_TLS_DIR: a Strimzi KafkaUser Secret's (user.crt, user.key) and its cluster CA's
TLS_FILES = {"ca": "ca.crt", "cert": "user.crt", "key": "user.key"}


def client_security(env: dict[str, str] | None = None) -> dict:
    """The kafka-python settings every Temper Kafka client is made with (module docstring, Security)."""
    env = os.environ if env is None else env
    out: dict = {}
    tls_dir = env.get(TLS_DIR_ENV, "")
    if tls_dir:
        folder = Path(tls_dir)
        ca = folder / TLS_FILES["ca"]
        if not ca.is_file():
            raise ValueError(f"{TLS_DIR_ENV}: {folder} has no {TLS_FILES['ca']} (the brokers' CA)")
        out.update(security_protocol="SSL", ssl_cafile=str(ca), ssl_check_hostname=True)
        cert, key = folder / TLS_FILES["cert"], folder / TLS_FILES["key"]
        if cert.is_file() != key.is_file():
            raise ValueError(f"{TLS_DIR_ENV}: {folder} has one of {TLS_FILES['cert']} and {TLS_FILES['key']} "
                             "without the other (mutual TLS needs both)")
        if cert.is_file():
            out.update(ssl_certfile=str(cert), ssl_keyfile=str(key))
    user = env.get(SASL_USERNAME_ENV, "")
    if user:
        password_file = env.get(SASL_PASSWORD_FILE_ENV, "")
        if not password_file or not Path(password_file).is_file():
            raise ValueError(f"{SASL_PASSWORD_FILE_ENV}: {password_file or '(unset)'} is not a file (the password "
                             f"of {SASL_USERNAME_ENV})")
        mechanism = env.get(SASL_MECHANISM_ENV, "") or SASL_MECHANISMS[0]
        if mechanism not in SASL_MECHANISMS:
            raise ValueError(f"{SASL_MECHANISM_ENV}: {mechanism!r} is not one of {', '.join(SASL_MECHANISMS)}")
        out.update(security_protocol="SASL_SSL" if tls_dir else "SASL_PLAINTEXT", sasl_mechanism=mechanism,
                   sasl_plain_username=user,
                   sasl_plain_password=Path(password_file).read_text().strip())
    return out


def ensure_topics(bootstrap: str, topics: tuple[str, ...] = ALL_TOPICS, partitions: int = 1,
                  timeout: float = 30.0) -> None:
    """Create ``topics`` (and their dead-letter twins) if missing; safe to call from every service."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="temper-admin", **client_security())
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


def messages_in(bootstrap: str, topic: str, timeout: float = 10.0) -> int:
    """How many messages ``topic`` has ever held: the sum of its partitions' high watermarks (0 for a topic the
    broker does not have). Offsets only grow on one broker, so a count below what a producer knows it
    published there means this is another broker (a new embedded one starts empty). The high watermark is
    read from a fetch response: ListOffsets (``end_offsets``) is short on Tansu's s3 engine (1 for a
    partition of 5 messages), the fetch's watermark is not."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False,
                             fetch_max_wait_ms=50, max_partition_fetch_bytes=64 * 1024, **client_security())
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
        if not tps:
            return 0
        ends = consumer.end_offsets(tps)
        consumer.assign(tps)
        for tp in tps:  # a fetch from just below the (possibly short) end: its response carries the watermark
            consumer.seek(tp, max(ends[tp] - 1, 0))
        deadline = time.monotonic() + timeout
        while any(consumer.highwater(tp) is None for tp in tps):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{topic}: no fetch answered in {timeout}s")
            consumer.poll(100)
        return sum(max(ends[tp], consumer.highwater(tp)) for tp in tps)
    finally:
        consumer.close()


class ProtoProducer:
    """Publishes protobuf messages with the current trace context in the headers.

    acks=all, retried until acknowledged, one request in flight per connection (a retried batch keeps its
    place in the partition). Not Kafka's idempotent producer: a batch whose request was cut by a broker restart
    is retried and may be stored twice -- harmless, every consumer dedupes by the message's stable id -- where
    the embedded broker (Tansu 0.6.0, s3 engine) answered the retry of an idempotent batch as a duplicate
    without having kept the first copy, and the acknowledged message was gone (measured: 2-4 of ~1,830
    acknowledged messages lost over 10 kill -9 restarts; none lost, a few stored twice, without idempotence;
    tests/runtime/test_broker_supervision.py).
    """

    def __init__(self, bootstrap: str, client_id: str):
        self._producer = KafkaProducer(bootstrap_servers=bootstrap, client_id=client_id, acks="all",
                                       enable_idempotence=False, max_in_flight_requests_per_connection=1,
                                       linger_ms=5, compression_type="lz4", **client_security())

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
            session_timeout_ms=6000, heartbeat_interval_ms=2000, fetch_max_wait_ms=50, **client_security())
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
                try:
                    batches = self._consumer.poll(timeout_ms=200, max_records=self._max_poll_records)
                except KafkaError as e:  # the broker gone or restarting: the client reconnects by itself
                    _log.warning("poll failed; retrying", topic=self.topic, error=f"{type(e).__name__}: {e}")
                    self._stop.wait(self._retry_backoff)
                    continue
                for tp, records in batches.items():
                    for record in records:
                        if self._stop.is_set() or not self._handle(tp, record):
                            break
                        try:
                            self._consumer.commit({tp: OffsetAndMetadata(record.offset + 1, "", -1)})
                        except KafkaError as e:  # not committed: delivered again later (handlers are idempotent)
                            _log.warning("commit failed", topic=self.topic, offset=record.offset,
                                         error=f"{type(e).__name__}: {e}")
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
