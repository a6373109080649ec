"""gRPC plumbing shared by every service: the domain-error mapping of servers, traced client channels.

The server's lifecycle (bind, health, reflection, metrics, drain on SIGTERM) is
``temper.runtime.service``.
"""

from __future__ import annotations

import random
import threading
from typing import TypeVar

import grpc
from opentelemetry.instrumentation.grpc import client_interceptor
from opentelemetry.instrumentation.grpc.grpcext import intercept_channel
from prometheus_client import Counter, Gauge

from temper.client import transport
from temper.runtime.errors import InvalidArgument, TemperError
from temper.runtime.logs import get_logger
from temper.runtime.tracing import traced_method

RPC_ERRORS = Counter("temper_rpc_errors_total", "RPCs answered with an error status", ["method", "code"])
RPC_IN_FLIGHT = Gauge("temper_rpc_in_flight", "calls being served now (health checks aside)")
RPC_SHED = Counter("temper_rpc_shed_total", "calls refused RESOURCE_EXHAUSTED: max_concurrent_rpcs were in flight",
                   ["method"])

_log = get_logger(component="rpc")

# gRPC's retry policy waits this long (trailing metadata) before it tries a refused call again
RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"


# Status details travel in a trailer (percent-encoded: up to 12 bytes per character) and gRPC drops a
# call whose trailers pass 16 KiB, so a message that quotes a huge request value ("no job 'xxx…'") would
# reach the client as RESOURCE_EXHAUSTED "Stream removed" instead of its status: the field and the
# message are cut here (each on its own, so the details still start with "field: ").
MAX_FIELD_CHARS, MAX_MESSAGE_CHARS = 160, 480


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


def _details(e: Exception) -> str:
    if isinstance(e, TemperError):
        message = _cut(e.message, MAX_MESSAGE_CHARS)
        return f"{_cut(e.field, MAX_FIELD_CHARS)}: {message}" if e.field else message
    return _cut(f"internal error: {type(e).__name__}: {e}", MAX_MESSAGE_CHARS)


def _abort(context: grpc.ServicerContext, method: str, e: Exception):
    if isinstance(e, TemperError):
        RPC_ERRORS.labels(method, e.code.name).inc()
        if getattr(e, "retry_after_ms", 0) > 0:
            context.set_trailing_metadata(((RETRY_PUSHBACK_KEY, str(e.retry_after_ms)),))
        context.abort(e.code, _details(e))
    RPC_ERRORS.labels(method, "INTERNAL").inc()
    _log.exception("rpc failed", method=method)
    context.abort(grpc.StatusCode.INTERNAL, _details(e))


class _Undecodable:
    """A request whose bytes did not parse, handed to the behaviour in the request's place.

    gRPC answers a deserializer's exception with INTERNAL ("Exception deserializing request!"),
    as if the server were at fault; the behaviour raises this instead, so the client hears
    INVALID_ARGUMENT naming the request (or the stream's item) that was malformed."""

    def __init__(self, error: Exception):
        self.error = error

    def invalid(self, field: str) -> TemperError:
        if isinstance(self.error, TemperError):  # a deserializer that validates names its own field
            return self.error
        return InvalidArgument(f"not a valid message: {self.error}", field=field)


def _tolerant(deserialize):
    if deserialize is None:
        return None

    def inner(data: bytes):
        try:
            return deserialize(data)
        except Exception as e:  # noqa: BLE001 - any parse failure is the client's bytes
            return _Undecodable(e)
    return inner


def _checked(requests):
    for i, request in enumerate(requests):
        if isinstance(request, _Undecodable):
            raise request.invalid(f"requests[{i}]")
        yield request


def add_service(servicer, server: grpc.Server, service, request_decoders: dict | None = None,
                response_serializer=None) -> str:
    """Add ``servicer`` for the ``service`` descriptor to ``server``, one generic handler per method: requests
    parsed by their message class unless ``request_decoders`` names a decoder for the method (a wire view
    that spares a copy), responses serialized by ``response_serializer`` (default: the message's own).
    Returns the service's full name. For services whose methods read or answer bytes the generated
    ``add_*Servicer_to_server`` cannot."""
    from google.protobuf.message_factory import GetMessageClass

    handlers = {}
    for m in service.methods:
        kind = {(False, False): grpc.unary_unary_rpc_method_handler, (True, False): grpc.stream_unary_rpc_method_handler,
                (False, True): grpc.unary_stream_rpc_method_handler,
                (True, True): grpc.stream_stream_rpc_method_handler}[(m.client_streaming, m.server_streaming)]
        decode = (request_decoders or {}).get(m.name) or GetMessageClass(m.input_type).FromString
        handlers[m.name] = kind(getattr(servicer, m.name), request_deserializer=decode,
                                response_serializer=response_serializer or GetMessageClass(m.output_type).SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    return service.full_name


UNLIMITED_PREFIXES = ("/grpc.health.v1.Health/",)  # probes are answered however busy the service is


def rewrap(handler: grpc.RpcMethodHandler, wrap, request_deserializer=None) -> grpc.RpcMethodHandler:
    """``handler`` with its behaviour replaced by ``wrap(behavior, streams_responses)`` (and its request
    deserializer by ``request_deserializer``, if given): the one way a server interceptor wraps a method."""
    kw = dict(request_deserializer=request_deserializer or handler.request_deserializer,
              response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(wrap(handler.unary_unary, False), **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(wrap(handler.stream_unary, False), **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(wrap(handler.unary_stream, True), **kw)
    return grpc.stream_stream_rpc_method_handler(wrap(handler.stream_stream, True), **kw)


class AdmissionInterceptor(grpc.ServerInterceptor):
    """Backpressure: at most ``limit`` calls are served at once (health checks aside); the next one is
    refused at once with RESOURCE_EXHAUSTED, the setting named, and retry advice: ``grpc-retry-pushback-ms``
    trailing metadata (gRPC's retry policy waits that long before it tries again; the SDK's channels
    retry RESOURCE_EXHAUSTED) and the same delay in the message. Work never piles up in a queue the
    caller cannot see, and a probe is never stuck behind it.

    A call is counted from the moment a handler thread runs it to its end, so the server's thread pool
    holds ``limit`` admitted calls plus spare threads that refuse the next ones and answer probes (see
    ``temper.runtime.service``)."""

    def __init__(self, limit: int, retry_after_ms: int = 250, setting: str = "max_concurrent_rpcs"):
        self.limit, self.retry_after_ms, self.setting = limit, retry_after_ms, setting
        self._lock = threading.Lock()
        self.in_flight = 0

    def _enter(self) -> bool:
        with self._lock:
            if self.in_flight >= self.limit:
                return False
            self.in_flight += 1
        RPC_IN_FLIGHT.inc()
        return True

    def _leave(self) -> None:
        with self._lock:
            self.in_flight -= 1
        RPC_IN_FLIGHT.dec()

    def _refuse(self, context: grpc.ServicerContext, method: str):
        # jittered, so refused callers do not all come back in the same instant
        delay = int(self.retry_after_ms * (1 + random.random()))
        RPC_SHED.labels(method).inc()
        context.set_trailing_metadata(((RETRY_PUSHBACK_KEY, str(delay)),))
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                      f"{self.setting}: busy, {self.limit} calls in flight (the limit); retry in {delay} ms")

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(UNLIMITED_PREFIXES):
            return handler

        def wrap(behavior, streams_responses):
            if streams_responses:
                def inner_stream(request, context):
                    if not self._enter():
                        self._refuse(context, method)
                    try:
                        yield from behavior(request, context)
                    finally:
                        self._leave()
                return inner_stream

            def inner(request, context):
                if not self._enter():
                    self._refuse(context, method)
                try:
                    return behavior(request, context)
                finally:
                    self._leave()
            return inner

        return rewrap(handler, wrap)


class ErrorMappingInterceptor(grpc.ServerInterceptor):
    """Turn exceptions raised by servicers into statuses: TemperError keeps its code and field; a
    request that does not parse is INVALID_ARGUMENT (field ``request``, or ``requests[i]`` in a stream)."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        streaming = handler.request_streaming

        def checked(request):
            if streaming:
                return _checked(request)
            if isinstance(request, _Undecodable):
                raise request.invalid("request")
            return request

        def wrap(behavior, streams_responses):
            if streams_responses:
                def inner_stream(request, context):
                    try:
                        yield from behavior(checked(request), context)
                    except TemperError as e:
                        _abort(context, method, e)
                    except grpc.RpcError:
                        raise
                    except Exception as e:  # noqa: BLE001
                        _abort(context, method, e)
                return inner_stream

            def inner(request, context):
                try:
                    return behavior(checked(request), context)
                except TemperError as e:
                    _abort(context, method, e)
                except grpc.RpcError:
                    raise
                except Exception as e:  # noqa: BLE001 - the service must keep serving
                    _abort(context, method, e)
            return inner

        return rewrap(handler, wrap, request_deserializer=_tolerant(handler.request_deserializer))


def channel(address: str, server_name: str = "") -> grpc.Channel:
    """A client channel that carries the trace context in metadata (the SDK's channel + OTel); ``server_name``
    as ``temper.client.transport.channel``'s."""
    return intercept_channel(transport.channel(address, server_name=server_name), client_interceptor(filter_=traced_method))


C = TypeVar("C")


def client(cls: type[C], address: str, server_name: str = "", **kw) -> C:
    """An SDK client (``temper.client.sdk``) whose calls carry this process's trace context (``server_name``:
    the name its TLS certificate carries when it is not the address's, as for ``Replicas``)."""
    return cls(address, channel=channel(address, server_name), **kw)


check_health = transport.check_health
