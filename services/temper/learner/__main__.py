"""Entry point: python -m temper.learner — pulls from replay, trains, pushes weights (--help: the settings)."""

from temper.learner.service import LearnerService
from temper.runtime.service import main

if __name__ == "__main__":
    main(LearnerService)
