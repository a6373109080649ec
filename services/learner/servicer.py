"""gRPC LearnerService: status and control of the loop."""

from __future__ import annotations

from temper.learner.loop import LearnerLoop
from temper.runtime.errors import Unimplemented
from temper.v1 import learner_pb2, learner_pb2_grpc


class LearnerServicer(learner_pb2_grpc.LearnerServiceServicer):
    def __init__(self, loop: LearnerLoop, algorithm: str):
        self.loop = loop
        self.algorithm = algorithm

    def _status(self) -> learner_pb2.LearnerStatus:
        s = self.loop.state
        return learner_pb2.LearnerStatus(step=s.step, policy_version=s.policy_version, paused=s.paused, last=s.last,
                                         skipped_batches=s.skipped_batches, algorithm=self.algorithm)

    def Status(self, request, context):
        return self._status()

    def Checkpoint(self, request, context):
        raise Unimplemented("checkpoints arrive with the learner issue")

    def Pause(self, request, context):
        self.loop.pause()
        return self._status()

    def Resume(self, request, context):
        self.loop.resume()
        return self._status()
