"""OpenTelemetry tracing, set up the same way in every service.

Context crosses gRPC in metadata (the grpc instrumentation's interceptors) and Kafka in
message headers (``inject_headers`` / ``extract_context``), with the W3C traceparent format.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import (ALWAYS_ON, Decision, ParentBased, Sampler, SamplingResult,
                                              TraceIdRatioBased)

_provider: TracerProvider | None = None
FILE_EXPORT_DELAY_MS = 1000  # a trace file's spans are written at most this long after they end (or at exit)
FILE_EXPORT_QUEUE = 16384  # spans waiting for the file; beyond it (a burst the writer cannot follow) dropped

# Status reads that callers poll: a health probe, the scheduler waiting for a policy version, the CLI or a
# view refreshing a job, the monitor's curves. They get no span and carry no context (the gRPC
# interceptors skip them): a span per poll was a third of a toy step's spans and says nothing about a
# sample's path. Every call that moves data (Generate, UpdateWeights, Sample, Insert, Score, ...) is traced.
UNTRACED_METHODS = frozenset({
    "/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch", "/grpc.health.v1.Health/List",
    "/temper.v1.InferenceService/GetPolicyVersion",
    "/temper.v1.LearnerService/Status",
    "/temper.v1.MonitorService/RewardCurve", "/temper.v1.MonitorService/ListAlerts",
    "/temper.v1.MonitorService/ListSteps",
    "/temper.v1.ReplayService/Stats",
    "/temper.v1.RewardService/ListDomains",
    "/temper.v1.SchedulerService/GetJob", "/temper.v1.SchedulerService/ListJobs",
})


def traced_method(call_details) -> bool:
    """The gRPC interceptors' filter: False for the polled status reads of ``UNTRACED_METHODS``. Takes a
    server's ``HandlerCallDetails`` (``method``) or a client's call info (``full_method``)."""
    name = getattr(call_details, "full_method", None) or getattr(call_details, "method", "")
    if isinstance(name, bytes):
        name = name.decode()
    return name not in UNTRACED_METHODS


def setup_tracing(service: str, trace_file: str = "", otlp_endpoint: str = "", *, otlp_tls: bool = False,
                  otlp_ca_file: str = "", otlp_cert_file: str = "", otlp_key_file: str = "",
                  sample_ratio: float = 1.0) -> TracerProvider:
    """Install the process's tracer provider. Spans go to ``trace_file`` as JSON lines and/or OTLP/gRPC.

    OTLP goes in plaintext unless ``otlp_tls``: then over TLS, the collector's certificate checked against
    ``otlp_ca_file`` (PEM; "" = the system roots), presenting ``otlp_cert_file``/``otlp_key_file`` when given
    (a collector that requires mTLS). Only our own credentials are used, never the ``OTEL_EXPORTER_OTLP_*``
    environment. A collector that cannot be reached, or fails the handshake, loses spans, never the service:
    the exporter logs the failed export and drops the batch. ``sample_ratio``: see ``build_provider``."""
    global _provider
    provider = build_provider(service, trace_file, otlp_endpoint, otlp_tls=otlp_tls, otlp_ca_file=otlp_ca_file,
                              otlp_cert_file=otlp_cert_file, otlp_key_file=otlp_key_file, sample_ratio=sample_ratio)
    trace.set_tracer_provider(provider)
    _provider = provider
    return provider


def build_provider(service: str, trace_file: str = "", otlp_endpoint: str = "", *, otlp_tls: bool = False,
                   otlp_ca_file: str = "", otlp_cert_file: str = "", otlp_key_file: str = "",
                   sample_ratio: float = 1.0) -> TracerProvider:
    """The tracer provider ``setup_tracing`` installs, not installed (the tracing bench builds several).

    ``sample_ratio`` (0 to 1) is the share of traces recorded (``sampler``): a span with a remote parent
    (a gRPC call, a Kafka message) follows the parent's decision, so a trace is kept or dropped whole,
    across services. With neither export the SDK still records every sampled span (and propagates
    context); it just drops them.
    """
    provider = TracerProvider(resource=Resource.create({"service.name": f"temper-{service}"}),
                              sampler=sampler(sample_ratio))
    if trace_file:  # batched off the handler threads; a crash loses at most the last second's spans
        out = open(trace_file, "a")  # noqa: SIM115 - lives as long as the process
        provider.add_span_processor(BatchSpanProcessor(
            JsonLinesSpanExporter(out, f"temper-{service}"),
            schedule_delay_millis=FILE_EXPORT_DELAY_MS, max_queue_size=FILE_EXPORT_QUEUE))
    if otlp_endpoint:
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError as e:  # pragma: no cover - deployment option
            raise RuntimeError("OTLP export needs: pip install opentelemetry-exporter-otlp-proto-grpc") from e
        if otlp_tls:
            exporter = OTLPSpanExporter(endpoint=otlp_endpoint, insecure=False, credentials=otlp_credentials(
                otlp_ca_file, otlp_cert_file, otlp_key_file))
        else:
            exporter = OTLPSpanExporter(endpoint=otlp_endpoint, insecure=True)
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


class JsonLinesSpanExporter(SpanExporter):
    """Spans as JSON lines (one object per span, one write and flush per batch), for ``trace_file``.

    A line: ``name``, ``service``, ``context`` {``trace_id``, ``span_id``} (hex with 0x, as the SDK's
    ``to_json``), ``kind``, ``parent_id`` (or null), ``start_time_unix_nano`` / ``end_time_unix_nano``
    (integers, as OTLP/JSON), ``status`` {``status_code``[, ``description``]}, ``attributes``, ``events``
    [{``name``, ``time_unix_nano``, ``attributes``}] and ``links`` [{``context``, ``attributes``}]. The
    process's resource is the ``service`` name, not repeated whole on every line: the SDK's ``to_json``
    (the resource on each span, ISO timestamps, indentation) cost as much CPU as making the span."""

    def __init__(self, out: IO[str], service: str):
        self._out = out
        self._service = service
        self._encode = json.JSONEncoder(separators=(",", ":"), default=str).encode

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        encode, service = self._encode, self._service
        self._out.write("".join(encode(_span_record(span, service)) + "\n" for span in spans))
        self._out.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self._out.close()


def _span_record(span: ReadableSpan, service: str) -> dict:
    parent = span.parent
    status = {"status_code": span.status.status_code.name}
    if span.status.description:
        status["description"] = span.status.description
    return {"name": span.name, "service": service, "context": _context_record(span.context),
            "kind": span.kind.name, "parent_id": f"0x{parent.span_id:016x}" if parent is not None else None,
            "start_time_unix_nano": span.start_time, "end_time_unix_nano": span.end_time, "status": status,
            "attributes": dict(span.attributes or {}),
            "events": [{"name": e.name, "time_unix_nano": e.timestamp, "attributes": dict(e.attributes or {})}
                       for e in span.events],
            "links": [{"context": _context_record(link.context), "attributes": dict(link.attributes or {})}
                      for link in span.links]}


def _context_record(context: trace.SpanContext) -> dict:
    return {"trace_id": f"0x{context.trace_id:032x}", "span_id": f"0x{context.span_id:016x}"}


def sampler(ratio: float) -> Sampler:
    """Parent-based sampling by trace id: a root span is recorded with probability ``ratio``, decided from
    its trace id; a child as its parent was (the W3C ``sampled`` flag crosses gRPC metadata and Kafka
    headers), so a trace is kept or dropped whole. A root span with links (the learner step, linked to
    the scheduler steps whose groups it trained on) follows them: recorded when any linked span was."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"trace sample ratio {ratio!r} is not between 0 and 1")
    return ParentBased(ALWAYS_ON if ratio >= 1.0 else _LinkedOrRatio(ratio))


class _LinkedOrRatio(Sampler):
    """A root span's decision: one with links follows them (recorded when any linked span was, so a
    learner step is traced with the steps it trained on and dropped with them); one without links
    is kept by trace id with ``ratio``."""

    def __init__(self, ratio: float):
        self._ratio = ratio
        self._by_id = TraceIdRatioBased(ratio)

    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None,
                      trace_state=None) -> SamplingResult:
        if links:
            keep = any(link.context.trace_flags.sampled for link in links)
            return SamplingResult(Decision.RECORD_AND_SAMPLE if keep else Decision.DROP,
                                  attributes if keep else None, trace_state)
        return self._by_id.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)

    def get_description(self) -> str:
        return f"LinkedOrTraceIdRatio{{{self._ratio}}}"


def otlp_credentials(ca_file: str = "", cert_file: str = "", key_file: str = "") -> grpc.ChannelCredentials:
    """TLS credentials for the OTLP channel from PEM files ("" = the system roots / no client certificate)."""
    def read(path: str) -> bytes | None:
        return Path(path).read_bytes() if path else None

    return grpc.ssl_channel_credentials(root_certificates=read(ca_file), private_key=read(key_file),
                                        certificate_chain=read(cert_file))


def shutdown_tracing() -> None:
    if _provider is not None:
        _provider.shutdown()


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def inject_headers() -> list[tuple[str, bytes]]:
    """The current trace context as Kafka headers."""
    return [(k, v.encode()) for k, v in current_context_carrier().items()]


def current_context_carrier() -> dict[str, str]:
    """The current trace context as a string map (to store it inside a message)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


def links_to(carriers) -> list[trace.Link]:
    """Span links to the (valid, distinct) span contexts stored in ``carriers``."""
    links, seen = [], set()
    for carrier in carriers:
        ctx = trace.get_current_span(propagate.extract(dict(carrier))).get_span_context()
        if ctx.is_valid and (ctx.trace_id, ctx.span_id) not in seen:
            seen.add((ctx.trace_id, ctx.span_id))
            links.append(trace.Link(ctx))
    return links


def extract_context(headers: list[tuple[str, bytes]] | None) -> otel_context.Context:
    """The trace context carried by Kafka headers (an empty context if none)."""
    carrier = {k: v.decode(errors="replace") for k, v in (headers or []) if v is not None}
    return propagate.extract(carrier)
