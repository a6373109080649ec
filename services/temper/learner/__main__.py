"""Entry point: python -m temper.learner — pulls from replay, trains, pushes weights (--help: the settings).
Under torchrun (ranks on several hosts) the process of RANK 0 is the service and the others its followers
(temper.learner.ranks)."""

import sys

from temper.learner.ranks import follow_torchrun, torchrun
from temper.learner.service import LearnerService
from temper.runtime.service import main

if __name__ == "__main__":
    launched = torchrun()
    if launched is not None and launched[0] > 0:
        follow_torchrun(sys.argv[1:])
    else:
        main(LearnerService)
