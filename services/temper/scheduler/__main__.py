"""Entry point: python -m temper.scheduler — runs jobs: tasks -> inference -> `rollouts` (--help: the settings)."""

from temper.runtime.service import main
from temper.scheduler.service import SchedulerService

if __name__ == "__main__":
    main(SchedulerService)
