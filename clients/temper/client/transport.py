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

# every method of every service: UNAVAILABLE (connection refused/reset, server restarting) is retried
RETRY_SERVICE_CONFIG = json.dumps({
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
# A target that names several servers (``dns:///inference-pods:50051``: a headless Service in Kubernetes;
# ``ipv4:a:p,b:q``) spreads calls over all of them (round_robin). A plain host:port keeps pick_first,
# which reconnects at once to a restarted server instead of after round_robin's reconnect backoff.
BALANCED_TARGETS = ("dns:", "ipv4:", "ipv6:")
BALANCED_OPTIONS = tuple(
    ("grpc.service_config", json.dumps({**json.loads(RETRY_SERVICE_CONFIG), "loadBalancingConfig": [{"round_robin": {}}]}))
    if key == "grpc.service_config" else (key, value) for key, value in CHANNEL_OPTIONS)


def channel(address: str, interceptors: Sequence[grpc.UnaryUnaryClientInterceptor] = ()) -> grpc.Channel:
    """An insecure channel to ``address`` with Temper's limits and retry policy."""
    options = BALANCED_OPTIONS if address.startswith(BALANCED_TARGETS) else CHANNEL_OPTIONS
    ch = grpc.insecure_channel(address, options=list(options))
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
