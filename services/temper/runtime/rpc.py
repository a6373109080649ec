"""gRPC plumbing shared by every service: server bootstrap and client channels.

``serve`` starts a server with the standard health-checking and reflection services, the
OpenTelemetry interceptor, the domain-error mapping, and a Prometheus endpoint; it blocks
until SIGTERM/SIGINT, then marks the service NOT_SERVING, stops accepting calls and lets
in-flight ones finish for ``grace_seconds``.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterable
from concurrent import futures
from dataclasses import dataclass, field
from typing import TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry.instrumentation.grpc import client_interceptor, server_interceptor
from opentelemetry.instrumentation.grpc.grpcext import intercept_channel
from prometheus_client import Counter, start_http_server

from temper.client import transport
from temper.client.transport import MAX_MESSAGE_BYTES
from temper.runtime.config import ServiceConfig
from temper.runtime.errors import TemperError
from temper.runtime.logs import get_logger, setup_logging
from temper.runtime.tracing import setup_tracing, shutdown_tracing

RPC_ERRORS = Counter("temper_rpc_errors_total", "RPCs answered with an error status", ["method", "code"])

_log = get_logger(component="rpc")


def _abort(context: grpc.ServicerContext, method: str, e: Exception):
    if isinstance(e, TemperError):
        RPC_ERRORS.labels(method, e.code.name).inc()
        context.abort(e.code, str(e))
    RPC_ERRORS.labels(method, "INTERNAL").inc()
    _log.exception("rpc failed", method=method)
    context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}")


class ErrorMappingInterceptor(grpc.ServerInterceptor):
    """Turn exceptions raised by servicers into statuses: TemperError keeps its code and field."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method

        def wrap_unary(behavior):
            def inner(request, context):
                try:
                    return behavior(request, context)
                except TemperError as e:
                    _abort(context, method, e)
                except grpc.RpcError:
                    raise
                except Exception as e:  # noqa: BLE001 - the service must keep serving
                    _abort(context, method, e)
            return inner

        def wrap_stream(behavior):
            def inner(request, context):
                try:
                    yield from behavior(request, context)
                except TemperError as e:
                    _abort(context, method, e)
                except grpc.RpcError:
                    raise
                except Exception as e:  # noqa: BLE001
                    _abort(context, method, e)
            return inner

        kw = dict(request_deserializer=handler.request_deserializer,
                  response_serializer=handler.response_serializer)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(wrap_unary(handler.unary_unary), **kw)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(wrap_unary(handler.stream_unary), **kw)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(wrap_stream(handler.unary_stream), **kw)
        return grpc.stream_stream_rpc_method_handler(wrap_stream(handler.stream_stream), **kw)


@dataclass
class Service:
    """What a service hands to ``serve``: how to register its servicers, and its lifecycle hooks."""

    name: str
    register: Callable[[grpc.Server], Iterable[str]]  # adds servicers, returns full service names
    on_start: Callable[[], None] | None = None  # after the port is bound (start consumers, loops)
    on_stop: Callable[[], None] | None = None  # after the server drained (stop consumers, flush)
    # liveness of background work (consumer threads, loops): any False -> NOT_SERVING until True again
    checks: list[Callable[[], bool]] = field(default_factory=list)
    stop_event: threading.Event = field(default_factory=threading.Event)


def build_server(config: ServiceConfig, service: Service) -> tuple[grpc.Server, int, health.HealthServicer, list[str]]:
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.max_workers, thread_name_prefix=service.name),
        interceptors=[server_interceptor(), ErrorMappingInterceptor()],
        options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                 ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                 ("grpc.so_reuseport", 0)],
    )
    names = list(service.register(server))
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME], server)
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    if port == 0:
        raise RuntimeError(f"cannot bind {config.host}:{config.port}")
    for n in ["", *names]:
        health_servicer.set(n, health_pb2.HealthCheckResponse.NOT_SERVING)
    return server, port, health_servicer, ["", *names]


def serve(config: ServiceConfig, service: Service) -> None:
    """Run ``service`` until SIGTERM/SIGINT; the one server bootstrap every service uses."""
    log = setup_logging(service.name, config.log_level)
    setup_tracing(service.name, config.trace_file, config.otlp_endpoint)
    if config.metrics_port >= 0:
        metrics_server, _ = start_http_server(config.metrics_port, addr=config.host)
        metrics_port = metrics_server.server_port
    else:
        metrics_port = -1
    server, port, health_servicer, health_names = build_server(config, service)
    server.start()
    if service.on_start:
        service.on_start()
    for n in health_names:
        health_servicer.set(n, health_pb2.HealthCheckResponse.SERVING)
    log.info("serving", address=f"{config.host}:{port}", metrics_port=metrics_port)

    def on_signal(signum, _frame):
        log.info("stopping", signal=signal.Signals(signum).name)
        service.stop_event.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    serving = True
    while not service.stop_event.wait(1.0):
        ok = all(check() for check in service.checks)
        if ok != serving:
            serving = ok
            log.warning("health changed", serving=ok)
            status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
            for n in health_names:
                health_servicer.set(n, status)
    health_servicer.enter_graceful_shutdown()
    server.stop(config.grace_seconds).wait()
    if service.on_stop:
        service.on_stop()
    shutdown_tracing()
    log.info("stopped")


def channel(address: str) -> grpc.Channel:
    """A client channel that carries the trace context in metadata (the SDK's channel + OTel)."""
    return intercept_channel(transport.channel(address), client_interceptor())


C = TypeVar("C")


def client(cls: type[C], address: str, **kw) -> C:
    """An SDK client (``temper.client.sdk``) whose calls carry this process's trace context."""
    return cls(address, channel=channel(address), **kw)


check_health = transport.check_health
