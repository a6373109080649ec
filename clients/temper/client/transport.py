"""Client channels: message-size limits, a retry policy for transient failures, health checks.

Retries are gRPC's own (the ``retryPolicy`` of the channel's service config): a call that
fails with UNAVAILABLE before the server saw it is tried again with exponential backoff. No
hand-written retry loops. Servers that want the trace context in metadata wrap the channel
with their interceptors (``channel(address, interceptors=...)``); the SDK needs none.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

MAX_MESSAGE_BYTES = 64 << 20

# every method of every service: UNAVAILABLE (connection refused/reset, server restarting) is retried.
# round_robin: a target that resolves to many servers (dns:///inference-pods:50051, a headless Service in
# Kubernetes) spreads calls over all of them; with one address it is the same as the default pick_first
RETRY_SERVICE_CONFIG = json.dumps({
    "loadBalancingConfig": [{"round_robin": {}}],
    "methodConfig": [{
        "name": [{}],
        "retryPolicy": {
            "maxAttempts": 5,
            "initialBackoff": "0.1s",
            "maxBackoff": "2s",
            "backoffMultiplier": 2,
            "retryableStatusCodes": ["UNAVAILABLE"],
        },
    }],
})

CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.enable_retries", 1),
    ("grpc.service_config", RETRY_SERVICE_CONFIG),
)


def channel(address: str, interceptors: Sequence[grpc.UnaryUnaryClientInterceptor] = ()) -> grpc.Channel:
    """An insecure channel to ``address`` with Temper's limits and retry policy."""
    ch = grpc.insecure_channel(address, options=list(CHANNEL_OPTIONS))
    return grpc.intercept_channel(ch, *interceptors) if interceptors else ch


def check_health(address: str, timeout: float = 1.0, service: str = "") -> str:
    """The health status name of the server at ``address`` ("UNREACHABLE" if it does not answer)."""
    with grpc.insecure_channel(address) as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                        timeout=timeout)
        except grpc.RpcError:
            return "UNREACHABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
