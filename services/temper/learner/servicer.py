"""gRPC LearnerService: status, checkpoints and control of the loop (protobuf <-> plain objects)."""

from __future__ import annotations

from temper.learner.loop import LearnerLoop
from temper.runtime.errors import reject_unknown_fields, require
from temper.v1 import learner_pb2, learner_pb2_grpc


class LearnerServicer(learner_pb2_grpc.LearnerServiceServicer):
    def __init__(self, loop: LearnerLoop, algorithm: str):
        self.loop = loop
        self.algorithm = algorithm

    def _status(self) -> learner_pb2.LearnerStatus:
        s = self.loop.state
        return learner_pb2.LearnerStatus(
            step=s.step, policy_version=s.policy_version, paused=s.paused, last=s.last,
            skipped_batches=s.skipped_batches, algorithm=self.algorithm, skipped_by_field=s.skipped_by_field,
            stale_groups_dropped=s.stale_groups_dropped, weight_push_failures=s.push_failures,
            checkpoint_step=s.checkpoint_step, checkpoint_path=s.checkpoint_path, resumed=s.resumed,
            dropped_groups=s.dropped_groups, dropped_by_reason=s.dropped_by_reason,
            replica_errors=s.replica_errors, lineage=self.loop.lineage, replica_syncs=s.replica_syncs,
            weight_pushes_by_reference=s.pushes_by_reference, weight_pushes_streamed=s.pushes_streamed)

    def Status(self, request, context):
        return learner_pb2.StatusResponse(status=self._status())

    def Checkpoint(self, request, context):
        reject_unknown_fields(request, "request")
        path, step, version = self.loop.checkpoint(request.path or None)
        return learner_pb2.CheckpointResponse(path=str(path), step=step, policy_version=version)

    def ExportPolicy(self, request, context):
        reject_unknown_fields(request, "request")
        require(self.loop.model_dir is not None, "path", "this learner does not know its model folder")
        path, step, version, size = self.loop.export_policy(request.path, request.dtype)
        return learner_pb2.ExportPolicyResponse(path=str(path), step=step, policy_version=version, bytes=size)

    def Pause(self, request, context):
        self.loop.pause()
        return learner_pb2.PauseResponse(status=self._status())

    def Resume(self, request, context):
        self.loop.resume()
        return learner_pb2.ResumeResponse(status=self._status())
