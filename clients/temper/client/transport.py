"""Client channels: message-size limits, a retry policy for transient failures, health checks.

Retries are gRPC's own (the ``retryPolicy`` of the channel's service config): a call that
fails with UNAVAILABLE before the server saw it is tried again with exponential backoff, and one
a busy server refused (RESOURCE_EXHAUSTED: backpressure) after the delay the server advised in
``grpc-retry-pushback-ms``; five attempts in all, then the caller gets the status. No hand-written
retry loops. Servers that want the trace context in metadata wrap the channel
with their interceptors (``channel(address, interceptors=...)``); the SDK needs none.

Authentication: services started with a shared token (``[auth] mode = "token"``) refuse calls
without it. A channel carries the token as ``authorization: Bearer <token>`` metadata on every
call: the one given (``token=``), else the content of the file named by ``TEMPER_AUTH_TOKEN_FILE``
(what the launcher sets for the services it starts and for the ``temper`` CLI). The token never
appears in a log or an error message. Health checks need none.

Transport security: with ``TEMPER_TLS_DIR`` set (the launcher sets it for the services it starts and
for the ``temper`` CLI when the job has ``[auth] tls = true``; in Kubernetes it names a mounted Secret)
every channel, health checks included, is mTLS: it trusts only the CA in ``<dir>/ca.crt`` and presents
``<dir>/tls.crt`` / ``<dir>/tls.key`` as its client certificate (the file names of a Kubernetes TLS
Secret). ``channel_credentials`` is the one place that builds them.
"""

from __future__ import annotations

import collections
import json
import os
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

MAX_MESSAGE_BYTES = 64 << 20

# every method of every service: UNAVAILABLE (connection refused/reset, server restarting) and
# RESOURCE_EXHAUSTED (a server at its max_concurrent_rpcs, which advises when to come back) are retried
RETRY_SERVICE_CONFIG = json.dumps({
    "methodConfig": [{
        "name": [{}],
        "retryPolicy": {
            "maxAttempts": 5,
            "initialBackoff": "0.1s",
            "maxBackoff": "2s",
            "backoffMultiplier": 2,
            "retryableStatusCodes": ["UNAVAILABLE", "RESOURCE_EXHAUSTED"],
        },
    }],
})

CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.enable_retries", 1),
    ("grpc.service_config", RETRY_SERVICE_CONFIG),
)
# A target that names several servers (``dns:///inference-pods:50051``: a headless Service in Kubernetes;
# ``ipv4:a:p,b:q``) spreads calls over all of them (round_robin). A plain host:port keeps pick_first,
# which reconnects at once to a restarted server instead of after round_robin's reconnect backoff.
BALANCED_TARGETS = ("dns:", "ipv4:", "ipv6:")
BALANCED_OPTIONS = tuple(
    ("grpc.service_config", json.dumps({**json.loads(RETRY_SERVICE_CONFIG), "loadBalancingConfig": [{"round_robin": {}}]}))
    if key == "grpc.service_config" else (key, value) for key, value in CHANNEL_OPTIONS)


AUTH_TOKEN_FILE_ENV = "TEMPER_AUTH_TOKEN_FILE"
TLS_DIR_ENV = "TEMPER_TLS_DIR"
TLS_FILES = ("ca.crt", "tls.crt", "tls.key")  # the trusted CA, this process's certificate chain, its private key


def tls_files(tls_dir: str | Path | None = None) -> tuple[bytes, bytes, bytes] | None:
    """(CA, certificate chain, private key) PEM bytes from ``tls_dir`` (default ``$TEMPER_TLS_DIR``); None when
    neither names a folder (plaintext). A folder that lacks a file is an error naming it."""
    folder = tls_dir if tls_dir is not None else os.environ.get(TLS_DIR_ENV, "")
    if not folder:
        return None
    out = []
    for name in TLS_FILES:
        path = Path(folder) / name
        try:
            out.append(path.read_bytes())
        except OSError as e:
            raise RuntimeError(f"{TLS_DIR_ENV}={folder}: cannot read {name} ({e.strerror})") from None
    return out[0], out[1], out[2]


def channel_credentials(tls_dir: str | Path | None = None) -> grpc.ChannelCredentials | None:
    """mTLS credentials of a client channel (``tls_files``): trust the deployment's CA only, present this
    process's certificate. None: plaintext."""
    files = tls_files(tls_dir)
    if files is None:
        return None
    ca, chain, key = files
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=chain)


def _raw_channel(address: str, options=(), tls_dir: str | Path | None = None, server_name: str = "") -> grpc.Channel:
    creds = channel_credentials(tls_dir)
    if creds is None:
        return grpc.insecure_channel(address, options=list(options))
    if server_name:  # the certificate is checked against this name, not the address dialled
        options = [*options, ("grpc.ssl_target_name_override", server_name)]
    return grpc.secure_channel(address, creds, options=list(options))


def auth_token(token: str | None = None) -> str:
    """``token`` if given, else the token in the file ``$TEMPER_AUTH_TOKEN_FILE`` names; "" when neither."""
    if token is not None:
        return token
    path = os.environ.get(AUTH_TOKEN_FILE_ENV, "")
    if not path:
        return ""
    try:
        return Path(path).read_text().strip()
    except OSError as e:
        raise RuntimeError(f"{AUTH_TOKEN_FILE_ENV}={path}: cannot read the auth token ({e.strerror})") from None


class _CallDetails(collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials",
                                                           "wait_for_ready", "compression")),
                   grpc.ClientCallDetails):
    pass


class BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                  grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds ``authorization: Bearer <token>`` to every call's metadata."""

    def __init__(self, token: str):
        self._metadata = (("authorization", f"Bearer {token}"),)

    def __repr__(self) -> str:  # never the token
        return "BearerToken(***)"

    def _with_token(self, d: grpc.ClientCallDetails) -> _CallDetails:
        return _CallDetails(d.method, d.timeout, [*(d.metadata or ()), *self._metadata], d.credentials,
                            d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._with_token(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._with_token(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._with_token(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._with_token(client_call_details), request_iterator)


def channel(address: str, interceptors: Sequence[grpc.UnaryUnaryClientInterceptor] = (),
            token: str | None = None, tls_dir: str | Path | None = None, server_name: str = "") -> grpc.Channel:
    """A channel to ``address`` with Temper's limits and retry policy, carrying the auth token (``auth_token``)
    when there is one; mTLS with the certificates in ``tls_dir`` (default ``$TEMPER_TLS_DIR``), else plaintext.
    ``server_name``: over TLS, the name the server's certificate must carry when it is not ``address``'s
    host (a pod of a headless Service dialled by IP: ``temper.client.discovery.server_name``)."""
    options = BALANCED_OPTIONS if address.startswith(BALANCED_TARGETS) else CHANNEL_OPTIONS
    ch = _raw_channel(address, options, tls_dir, server_name)
    token = auth_token(token)
    interceptors = (BearerToken(token), *interceptors) if token else tuple(interceptors)
    return grpc.intercept_channel(ch, *interceptors) if interceptors else ch


def check_health(address: str, timeout: float = 1.0, service: str = "", tls_dir: str | Path | None = None) -> str:
    """The health status name of the server at ``address`` ("UNREACHABLE" if it does not answer, or refuses
    this process's TLS identity); over mTLS when ``tls_dir`` / ``$TEMPER_TLS_DIR`` names certificates."""
    with _raw_channel(address, tls_dir=tls_dir) as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                        timeout=timeout)
        except grpc.RpcError:
            return "UNREACHABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def wire_bytes(message) -> bytes:
    """A message's wire bytes: pre-encoded bytes (hand-framed, or stored as received) as they are, a
    protobuf message serialized. The serializer of calls that take either."""
    return message if isinstance(message, (bytes, bytearray, memoryview)) else message.SerializeToString()


def varint(n: int) -> bytes:
    """Protobuf base-128 varint of a non-negative ``n`` (for hand-framed messages: length prefixes, tags)."""
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)
