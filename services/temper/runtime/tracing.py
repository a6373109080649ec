"""OpenTelemetry tracing, set up the same way in every service.

Context crosses gRPC in metadata (the grpc instrumentation's interceptors) and Kafka in
message headers (``inject_headers`` / ``extract_context``), with the W3C traceparent format.
"""

from __future__ import annotations

from pathlib import Path

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
from opentelemetry.sdk.trace.sampling import (ALWAYS_ON, Decision, ParentBased, Sampler, SamplingResult,
                                              TraceIdRatioBased)

_provider: TracerProvider | None = None
FILE_EXPORT_DELAY_MS = 1000  # a trace file's spans are written at most this long after they end (or at exit)
FILE_EXPORT_QUEUE = 16384  # spans waiting for the file; beyond it (a burst the writer cannot follow) dropped


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
        out = open(trace_file, "a", buffering=1)  # noqa: SIM115 - lives as long as the process
        provider.add_span_processor(BatchSpanProcessor(
            ConsoleSpanExporter(out=out, formatter=lambda span: span.to_json(indent=None) + "\n"),
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
