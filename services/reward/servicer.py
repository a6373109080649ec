"""gRPC RewardService: synchronous scoring of one group."""

from __future__ import annotations

from temper.reward.core import score_group
from temper.runtime.errors import require
from temper.v1 import reward_pb2, reward_pb2_grpc


class RewardServicer(reward_pb2_grpc.RewardServiceServicer):
    def Score(self, request, context):
        require(request.HasField("group"), "group", "required")
        return reward_pb2.ScoreResponse(group=score_group(request.group))
