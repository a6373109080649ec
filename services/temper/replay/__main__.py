"""Entry point: python -m temper.replay — `scored` -> durable tables; gRPC Insert/Sample/... (--help: the settings)."""

from temper.replay.service import ReplayService
from temper.runtime.service import main

if __name__ == "__main__":
    main(ReplayService)
