"""OTLP span export over TLS to a real OTLP/gRPC receiver on loopback (``otlp_ca_file`` and friends).

The receiver is an in-process gRPC server implementing the collector's ``TraceService``; it serves with a
certificate from a CA made here (``temper.runtime.tls``), optionally requiring a client certificate. A span
counts as delivered only when the receiver's ``Export`` got it; ``force_flush`` returns after the exporter
has finished with the batch (delivered, or given up after ``OTEL_EXPORTER_OTLP_TRACES_TIMEOUT``), so "nothing
arrived" is checked after the exporter gave up, not after a sleep.
"""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from temper.client.sdk import SchedulerClient
from temper.runtime.config import ServiceConfig, load_config
from temper.runtime.tls import issue, make_ca, write_identity
from temper.runtime.tracing import setup_tracing
from tests.conftest import spawn_service, wait_until

pytestmark = pytest.mark.slow  # starts gRPC servers (and one service as a process)


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Records the name of every span exported to it."""

    def __init__(self):
        self.spans: list[tuple[str, str]] = []  # (service.name, span name)
        self.lock = threading.Lock()

    def Export(self, request, context):  # noqa: N802 - the generated servicer's name
        with self.lock:
            for resource_spans in request.resource_spans:
                service = next((a.value.string_value for a in resource_spans.resource.attributes
                                if a.key == "service.name"), "")
                for scope in resource_spans.scope_spans:
                    self.spans += [(service, span.name) for span in scope.spans]
        return trace_service_pb2.ExportTraceServiceResponse()

    def names(self) -> list[str]:
        with self.lock:
            return [name for _, name in self.spans]


@pytest.fixture
def pki(tmp_path):
    """Two CAs: the collector's (signs the collector and a client identity) and an unrelated one."""
    ca, ca_key = make_ca("collector CA")
    other_ca, other_key = make_ca("another CA")
    return {
        "collector": write_identity(tmp_path / "collector", ca, *issue(ca, ca_key, "collector")),
        "client": write_identity(tmp_path / "client", ca, *issue(ca, ca_key, "temper")),
        "stranger": write_identity(tmp_path / "stranger", other_ca, *issue(other_ca, other_key, "temper")),
    }


@pytest.fixture
def receiver(pki):
    """Start a TLS OTLP receiver: ``start(require_client_cert)`` -> (its address, the Receiver)."""
    servers = []

    def start(require_client_cert: bool = False) -> tuple[str, Receiver]:
        folder = pki["collector"]
        key, chain, ca = ((folder / f).read_bytes() for f in ("tls.key", "tls.crt", "ca.crt"))
        credentials = grpc.ssl_server_credentials([(key, chain)], root_certificates=ca if require_client_cert else None,
                                                  require_client_auth=require_client_cert)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        servicer = Receiver()
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
        port = server.add_secure_port("127.0.0.1:0", credentials)
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}", servicer

    yield start
    for server in servers:
        server.stop(grace=None)


class OtlpConfig(ServiceConfig):
    section = "otlptest"


def _export_one_span(monkeypatch, argv: list[str], span: str) -> None:
    """Configure tracing from the flags ``argv`` (as a service does), emit ``span``, flush, shut down."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "2")  # a refused handshake gives up fast
    config = load_config(OtlpConfig, argv)
    provider = setup_tracing("otlptest", otlp_endpoint=config.otlp_endpoint, otlp_tls=config.otlp_uses_tls(),
                             otlp_ca_file=config.otlp_ca_file, otlp_cert_file=config.otlp_cert_file,
                             otlp_key_file=config.otlp_key_file)
    try:
        with provider.get_tracer("test").start_as_current_span(span):
            pass
        provider.force_flush(timeout_millis=10_000)
    finally:
        provider.shutdown()


def test_spans_reach_a_tls_collector_verified_with_its_ca(receiver, pki, monkeypatch):
    address, got = receiver()
    _export_one_span(monkeypatch, ["--otlp-endpoint", address, "--otlp-ca-file", str(pki["collector"] / "ca.crt")],
                     "over-tls")
    assert got.names() == ["over-tls"]
    assert got.spans[0][0] == "temper-otlptest"


def test_a_collector_whose_certificate_another_ca_signed_gets_nothing(receiver, pki, monkeypatch):
    address, got = receiver()
    _export_one_span(monkeypatch, ["--otlp-endpoint", address, "--otlp-ca-file", str(pki["stranger"] / "ca.crt")],
                     "wrong-ca")
    assert got.names() == []
    # plaintext (the default for a bare host:port) to a TLS collector gets nothing through either
    _export_one_span(monkeypatch, ["--otlp-endpoint", address], "plaintext")
    assert got.names() == []
    # and the same receiver still takes a correctly configured export afterwards
    _export_one_span(monkeypatch, ["--otlp-endpoint", address, "--otlp-ca-file", str(pki["collector"] / "ca.crt")],
                     "after")
    assert got.names() == ["after"]


def test_a_collector_requiring_mtls_takes_spans_only_with_a_client_certificate_of_its_ca(receiver, pki, monkeypatch):
    address, got = receiver(require_client_cert=True)
    ca = ["--otlp-endpoint", address, "--otlp-ca-file", str(pki["collector"] / "ca.crt")]
    _export_one_span(monkeypatch, ca, "no-client-cert")
    stranger = pki["stranger"]
    _export_one_span(monkeypatch, [*ca, "--otlp-cert-file", str(stranger / "tls.crt"),
                                   "--otlp-key-file", str(stranger / "tls.key")], "stranger-cert")
    assert got.names() == []
    client = pki["client"]
    _export_one_span(monkeypatch, [*ca, "--otlp-cert-file", str(client / "tls.crt"),
                                   "--otlp-key-file", str(client / "tls.key")], "mtls")
    assert got.names() == ["mtls"]


def test_a_service_process_exports_its_spans_over_mtls(receiver, pki, tmp_path, broker):
    """The real lifecycle (``temper.runtime.service.run``): the TOML keys of the service's table reach its exporter;
    a StopJob call is a server span (the health checks ``spawn_service`` makes are polls, never traced), flushed at
    the latest when the service stops."""
    address, got = receiver(require_client_cert=True)
    client = pki["client"]
    config = tmp_path / "job.toml"
    config.write_text(f'[scheduler]\notlp_endpoint = "{address}"\notlp_ca_file = "{pki["collector"] / "ca.crt"}"\n'
                      f'otlp_cert_file = "{client / "tls.crt"}"\notlp_key_file = "{client / "tls.key"}"\n')
    scheduler = spawn_service("scheduler", tmp_path / "work", "--config", str(config), "--no-persist-jobs",
                              "--kafka-bootstrap", broker, "--inference-address", "127.0.0.1:1")
    try:
        assert '"otlp": "tls"' in scheduler.log.read_text()
        with pytest.raises(grpc.RpcError) as e:
            scheduler.client(SchedulerClient).stop_job("no-such-job")
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        scheduler.stop()
    wait_until(lambda: got.spans, timeout=10, what="the service's spans at the collector")
    assert {service for service, _ in got.spans} == {"temper-scheduler"}
    assert "/temper.v1.SchedulerService/StopJob" in got.names(), got.names()
    assert not any("Health/Check" in name for name in got.names()), got.names()
