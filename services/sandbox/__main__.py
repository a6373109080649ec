"""Entry point: python -m temper.sandbox.

The sandbox's methods answer UNIMPLEMENTED (the generated base servicer's behaviour) until the
sandbox issue fills them in; the service already runs, answers health checks and is launched.
"""

from __future__ import annotations

import sys

from temper.runtime.config import ServiceConfig, load_config
from temper.runtime.rpc import Service, serve
from temper.v1 import sandbox_pb2, sandbox_pb2_grpc


class SandboxConfig(ServiceConfig):
    section = "sandbox"


def main(argv: list[str] | None = None) -> None:
    config = load_config(SandboxConfig, sys.argv[1:] if argv is None else argv)

    def register(server):
        sandbox_pb2_grpc.add_SandboxServiceServicer_to_server(sandbox_pb2_grpc.SandboxServiceServicer(), server)
        return [sandbox_pb2.DESCRIPTOR.services_by_name["SandboxService"].full_name]

    serve(config, Service("sandbox", register))


if __name__ == "__main__":
    main()
