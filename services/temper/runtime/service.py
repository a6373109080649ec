"""The one service lifecycle every Temper service runs (``python -m temper.<svc>`` calls ``main``).

A service is a subclass of ``Service``: it names its config class, opens its resources in order
on an ``ExitStack`` (``open``), registers its servicers (``register``) and declares liveness
checks of its background work (``checks``). The runtime does the rest, in this order:

1. read the config (``--help`` prints every field with its description and exits 0; a
   validation error exits non-zero naming the fields);
2. logging, tracing, the Prometheus endpoint (``--metrics-port``, 0: the OS picks one);
3. bind the gRPC port (``--port``, 0: the OS picks one) and report both ports: a log line and,
   with ``--port-file PATH``, ``{"address": "HOST:PORT", "metrics_port": N, "pid": P}`` written
   atomically. The port is bound *before* ``open`` (which may load a model for a minute): the
   socket already listens, so a dependent started meanwhile connects instead of being refused;
   its calls wait until the server starts, up to gRPC's connect timeout (20 s) or their
   deadline. A dependent that must call a dependency while starting waits for the channel
   first (``temper.client.sdk`` clients' ``wait_ready``, as the learner does before resuming);
4. ``open`` (resources, in order), ``register``, server start, health SERVING;
   With ``TEMPER_AUTH_TOKEN_FILE`` set, every call but health checks needs that file's token
   (``temper.runtime.auth``: UNAUTHENTICATED without one, PERMISSION_DENIED with another);
   with ``TEMPER_TLS_DIR`` set, the port serves TLS only and requires a client certificate from the
   deployment's CA (``temper.runtime.tls``);
5. on SIGTERM/SIGINT: health NOT_SERVING, the server stops accepting calls and lets in-flight
   ones finish for ``grace_seconds``, then the ExitStack closes the resources in reverse order.

A service that cannot run here (a missing binary, a model that is not there) raises
``StartupError`` from ``open``: the process exits non-zero with that message on stderr.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from collections.abc import Callable
from concurrent import futures
from contextlib import ExitStack
from pathlib import Path
from typing import ClassVar, Generic, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry.instrumentation.grpc import server_interceptor
from prometheus_client import start_http_server
from pydantic import ValidationError

from temper.client.transport import MAX_MESSAGE_BYTES
from temper.runtime.auth import TokenAuthInterceptor, server_token
from temper.runtime.config import ServiceConfig, describe_errors, load_config
from temper.runtime.logs import get_logger, setup_logging
from temper.runtime.rpc import AdmissionInterceptor, ErrorMappingInterceptor
from temper.runtime.tls import server_credentials
from temper.runtime.tracing import setup_tracing, shutdown_tracing, traced_method

C = TypeVar("C", bound=ServiceConfig)

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class StartupError(RuntimeError):
    """The service cannot run with this config on this machine; the message says why (and what to do)."""


class Service(Generic[C]):
    """Subclass per service: set ``name`` and ``config_class``, implement ``open`` and ``register``."""

    name: ClassVar[str]
    config_class: ClassVar[type[ServiceConfig]]

    def __init__(self, config: C):
        """Cheap: no resources yet (the port is not even bound). May adjust ``config`` (e.g. max_concurrent_rpcs)."""
        self.config = config
        self.stop_event = threading.Event()

    def open(self, stack: ExitStack) -> None:
        """Open resources in order (engines, stores, producers, consumers, loops); register each one's
        close on ``stack`` (``stack.callback``/``enter_context``): they close in reverse order on stop,
        after the gRPC server drained."""

    def register(self, server: grpc.Server) -> list[str]:
        """Add the servicers to ``server``; return their full service names (for health and reflection)."""
        raise NotImplementedError

    def checks(self) -> list[Callable[[], bool]]:
        """Liveness of background work (consumer threads, loops): any False -> NOT_SERVING until True again."""
        return []


def write_port_file(path: str | Path, address: str, metrics_port: int) -> None:
    """``{"address", "metrics_port", "pid"}`` to ``path``, atomically (a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"address": address, "metrics_port": metrics_port, "pid": os.getpid()}))
    os.replace(tmp, path)


def read_port_file(path: str | Path) -> dict | None:
    """What a service reported in its port file, or None while it has not written it yet."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None


# Handler threads beyond max_concurrent_rpcs: they answer health checks and refuse calls over the limit at
# once. Past HARD_QUEUE more calls waiting for a thread, gRPC itself refuses new ones (RESOURCE_EXHAUSTED,
# "Concurrent RPC limit exceeded!"), so even a flood of refusals never queues without bound.
SPARE_THREADS, HARD_QUEUE = 8, 256


def _server(config: ServiceConfig, name: str, token: str = "") -> grpc.Server:
    auth = [TokenAuthInterceptor(token)] if token else []
    limit = config.max_concurrent_rpcs
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=limit + SPARE_THREADS, thread_name_prefix=name),
        interceptors=[*auth, AdmissionInterceptor(limit), server_interceptor(filter_=traced_method),
                      ErrorMappingInterceptor()],
        maximum_concurrent_rpcs=limit + SPARE_THREADS + HARD_QUEUE,
        options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                 ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                 # a second process must never share a port by accident (a restart on the same port)
                 ("grpc.so_reuseport", 0)],
    )


def _bind(config: ServiceConfig, name: str, prog: str) -> tuple[grpc.Server, str, str, object]:
    """The service's server (auth and TLS as the environment says), bound to its port: (server, address,
    token, credentials); exits naming the problem when it cannot be."""
    try:
        token = server_token()
        credentials = server_credentials()
    except RuntimeError as e:
        sys.exit(f"{prog}: {e}")
    server = _server(config, name, token)
    bind = f"{config.host}:{config.port}"
    port = server.add_insecure_port(bind) if credentials is None else server.add_secure_port(bind, credentials)
    if port == 0:
        sys.exit(f"{prog}: cannot bind {config.host}:{config.port}")
    return server, f"{config.host}:{port}", token, credentials


def serve_health(config: ServiceConfig, name: str) -> tuple[grpc.Server, health.HealthServicer, str]:
    """A started server with grpc.health.v1 only, NOT_SERVING until set, on the service's port (auth and
    TLS as ``run``'s): for a process of a service that answers no call of its own but is probed as its
    pod (a learner's first rank on another host, started by torchrun)."""
    server, address, _, _ = _bind(config, name, f"temper-{name}")
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    health_servicer.set("", _NOT_SERVING)
    server.start()
    get_logger(service=name).info("health only", address=address)
    return server, health_servicer, address


def run(service_cls: type[Service], argv: list[str] | None = None) -> None:
    """Run ``service_cls`` until SIGTERM/SIGINT: the lifecycle of the module docstring."""
    argv = sys.argv[1:] if argv is None else argv
    prog = f"temper-{service_cls.name}"
    try:
        config = load_config(service_cls.config_class, argv)
    except ValidationError as e:
        fields = ", ".join(".".join(map(str, err["loc"])) or "config" for err in e.errors())
        lines = describe_errors(service_cls.config_class, e, argv)
        sys.exit(f"{prog}: invalid configuration ({fields}):\n" + "\n".join(lines))
    from temper.runtime.kafka import client_security

    try:  # a Kafka TLS/SASL setting that cannot be used stops the start at once, naming the variable
        client_security()
    except ValueError as e:
        sys.exit(f"{prog}: {e}")
    service = service_cls(config)
    log = setup_logging(service.name, config.log_level)
    setup_tracing(service.name, config.trace_file, config.otlp_endpoint, otlp_tls=config.otlp_uses_tls(),
                  otlp_ca_file=config.otlp_ca_file, otlp_cert_file=config.otlp_cert_file,
                  otlp_key_file=config.otlp_key_file, sample_ratio=config.trace_sample_ratio)
    metrics_port = -1
    if config.metrics_port >= 0:
        metrics_server, _ = start_http_server(config.metrics_port, addr=config.host)
        metrics_port = metrics_server.server_port
    server, address, token, credentials = _bind(config, service.name, prog)
    if config.port_file:
        write_port_file(config.port_file, address, metrics_port)
    log.info("bound", address=address, metrics_port=metrics_port, auth="token" if token else "none",
             tls="mtls" if credentials is not None else "off",
             otlp=("off" if not config.otlp_endpoint else "tls" if config.otlp_uses_tls() else "plaintext"))

    def on_signal(signum, _frame):
        log.info("stopping", signal=signal.Signals(signum).name)
        service.stop_event.set()

    # installed before open: a SIGTERM while a model loads stops the service once it is up, not mid-load
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    with ExitStack() as stack:
        stack.callback(shutdown_tracing)
        try:
            service.open(stack)
        except StartupError as e:
            log.error("cannot start", error=str(e))
            sys.exit(f"{prog}: {e}")
        names = ["", *service.register(server)]
        health_servicer = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(
            [*names[1:], health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME], server)
        for n in names:
            health_servicer.set(n, _NOT_SERVING)
        server.start()
        # the server stops (drained) before the stack closes what its handlers use
        stack.callback(lambda: server.stop(config.grace_seconds).wait())
        stack.callback(health_servicer.enter_graceful_shutdown)
        checks = service.checks()
        serving = all(check() for check in checks)
        for n in names:
            health_servicer.set(n, _SERVING if serving else _NOT_SERVING)
        log.info("serving", address=address, metrics_port=metrics_port)
        while not service.stop_event.wait(1.0):
            ok = all(check() for check in checks)
            if ok != serving:
                serving = ok
                log.warning("health changed", serving=ok)
                for n in names:
                    health_servicer.set(n, _SERVING if ok else _NOT_SERVING)
    log.info("stopped")


def main(service_cls: type[Service]) -> None:
    """The whole of every ``temper/<svc>/__main__.py``."""
    run(service_cls)
