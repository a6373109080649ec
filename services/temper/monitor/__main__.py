"""Entry point: python -m temper.monitor — `scored` -> reward curves (--help: the settings)."""

from temper.monitor.service import MonitorService
from temper.runtime.service import main

if __name__ == "__main__":
    main(MonitorService)
