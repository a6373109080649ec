"""The SDK's channel spreads calls over every address a multi-server target names (round_robin), as the
scheduler needs for `dns:///inference-pods:50051` in Kubernetes; here two real servers on 127.0.0.1."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from temper.client import transport

pytestmark = pytest.mark.slow  # starts gRPC servers


def _server(name: bytes) -> tuple[grpc.Server, int]:
    handler = grpc.method_handlers_generic_handler(
        "test.Who", {"Am": grpc.unary_unary_rpc_method_handler(lambda req, ctx: name)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def test_calls_go_to_every_resolved_server():
    (a, pa), (b, pb) = _server(b"a"), _server(b"b")
    try:
        with transport.channel(f"ipv4:127.0.0.1:{pa},127.0.0.1:{pb}") as ch:
            call = ch.unary_unary("/test.Who/Am", request_serializer=None, response_deserializer=None)
            answers = [call(b"", timeout=10, wait_for_ready=True) for _ in range(20)]
        assert set(answers) == {b"a", b"b"}
        assert abs(answers.count(b"a") - answers.count(b"b")) <= 2
        with transport.channel(f"127.0.0.1:{pa}") as ch:  # a plain host:port: one server, pick_first
            call = ch.unary_unary("/test.Who/Am", request_serializer=None, response_deserializer=None)
            assert {call(b"", timeout=10) for _ in range(5)} == {b"a"}
    finally:
        a.stop(0)
        b.stop(0)
