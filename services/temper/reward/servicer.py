"""gRPC RewardService: protobuf in, the core's Scorer, protobuf out."""

from __future__ import annotations

from temper.reward.core import Scorer
from temper.reward.verifiers.registry import component_names
from temper.runtime.errors import require
from temper.v1 import reward_pb2, reward_pb2_grpc


class RewardServicer(reward_pb2_grpc.RewardServiceServicer):
    def __init__(self, scorer: Scorer):
        self.scorer = scorer

    def Score(self, request, context):
        require(request.HasField("group"), "group", "required")
        return reward_pb2.ScoreResponse(group=self.scorer.score_group(request.group))

    def ListDomains(self, request, context):
        s = self.scorer.settings
        return reward_pb2.ListDomainsResponse(
            domains=[reward_pb2.DomainInfo(domain=name, weights=spec.weights, prm_aggregation=spec.prm_aggregation)
                     for name, spec in sorted(s.domains.items())],
            verifiers=component_names(), reward_model_loaded=self.scorer.rm is not None,
            process_reward_model_loaded=self.scorer.prm is not None)
