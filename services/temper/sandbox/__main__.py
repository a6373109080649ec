"""Entry point: python -m temper.sandbox — gRPC Execute/RunTests in gVisor sandboxes (--help: the settings)."""

from temper.runtime.service import main
from temper.sandbox.service import SandboxService

if __name__ == "__main__":
    main(SandboxService)
