"""``python -m temper.client.health HOST:PORT``: exit 0 when the server there is SERVING, 1 otherwise.

For probes that must speak mTLS (``TEMPER_TLS_DIR`` set, as in a pod with ``[auth] tls = true``):
Kubernetes' native gRPC probes cannot present a client certificate, an exec probe running this can.
"""

from __future__ import annotations

import argparse
import sys

from temper.client.transport import check_health


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m temper.client.health", description=__doc__.splitlines()[0])
    parser.add_argument("address", help="host:port of the gRPC server")
    parser.add_argument("--service", default="", help="the health service name to ask about (default: the server)")
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the answer")
    args = parser.parse_args(argv)
    status = check_health(args.address, timeout=args.timeout, service=args.service)
    print(status)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
