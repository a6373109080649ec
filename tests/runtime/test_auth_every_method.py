"""[auth] mode = "token" on a whole stack: every method of every service (from the protobuf descriptors, as
the fuzz suite finds them, so a new method is covered with no code here) refuses a call without the token
(UNAUTHENTICATED) and one with another token (PERMISSION_DENIED), before the request is even looked at;
reflection too; health checks stay open."""

from __future__ import annotations

import grpc
import pytest

from temper.runtime.launcher import Launcher, pid_alive
from temper.runtime.rpc import check_health
from tests.fuzz.targets import SERVICE_OF, covered_methods

pytestmark = pytest.mark.slow  # starts the stack

REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("auth-stack")
    config = tmp / "job.toml"
    config.write_text('[model]\npreset = "tiny"\n\n[auth]\nmode = "token"\n')
    launcher = Launcher(home=tmp / "home", config=str(config))
    state = launcher.up()
    pids = [p.pid for p in state.services.values()] + [state.broker.pid]
    yield launcher
    launcher.down()
    assert not [p for p in pids if pid_alive(p)], "processes left behind"


def answer(address: str, path: str, client_streaming: bool, server_streaming: bool, metadata) -> grpc.StatusCode:
    """The status of one call of ``path`` with an empty request and ``metadata``."""
    with grpc.insecure_channel(address) as ch:
        kind = {(False, False): ch.unary_unary, (True, False): ch.stream_unary,
                (False, True): ch.unary_stream, (True, True): ch.stream_stream}
        fn = kind[(client_streaming, server_streaming)](path)
        try:
            out = fn(iter([b""]) if client_streaming else b"", timeout=30, metadata=metadata)
            if server_streaming:
                list(out)
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


def test_every_method_refuses_callers_without_the_token(stack):
    services = stack.load().services
    refused: dict[str, tuple[str, str]] = {}
    for m in covered_methods():
        address = services[SERVICE_OF[m.service.full_name]].address
        kinds = (m.method.client_streaming, m.method.server_streaming)
        refused[m.id] = (answer(address, m.path, *kinds, metadata=None).name,
                         answer(address, m.path, *kinds, metadata=(("authorization", "Bearer not-the-token"),)).name)
    assert len(refused) >= 30, sorted(refused)
    wrong = {k: v for k, v in refused.items() if v != ("UNAUTHENTICATED", "PERMISSION_DENIED")}
    assert not wrong, wrong
    for name, p in services.items():
        assert answer(p.address, REFLECTION, True, True, metadata=None) == grpc.StatusCode.UNAUTHENTICATED, name
        assert check_health(p.address) == "SERVING", name
    print(f"\n{len(refused)} methods x 2: {2 * len(refused)} calls without / with a wrong token refused")
