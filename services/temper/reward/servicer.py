"""gRPC RewardService: protobuf in, the core's Scorer, protobuf out."""

from __future__ import annotations

import json

from temper.reward.core import Scorer
from temper.reward.verifiers.registry import component_names
from temper.runtime.errors import require
from temper.v1 import reward_pb2, reward_pb2_grpc

SLOTS = {reward_pb2.MODEL_SLOT_RM: "rm", reward_pb2.MODEL_SLOT_PRM: "prm"}


class RewardServicer(reward_pb2_grpc.RewardServiceServicer):
    def __init__(self, scorer: Scorer):
        self.scorer = scorer

    def Score(self, request, context):
        require(request.HasField("group"), "group", "required")
        return reward_pb2.ScoreResponse(group=self.scorer.score_group(request.group))

    def ListDomains(self, request, context):
        s = self.scorer.settings
        rm, prm = self.scorer.rm, self.scorer.prm
        return reward_pb2.ListDomainsResponse(
            domains=[reward_pb2.DomainInfo(domain=name, weights=spec.weights, prm_aggregation=spec.prm_aggregation)
                     for name, spec in sorted(s.domains.items())],
            verifiers=component_names(), reward_model_loaded=rm is not None,
            process_reward_model_loaded=prm is not None,
            reward_model_dir=str(rm.model_dir) if rm is not None else "",
            process_reward_model_dir=str(prm.model_dir) if prm is not None else "")

    def LoadModel(self, request, context):
        require(request.slot in SLOTS, "slot", "MODEL_SLOT_RM or MODEL_SLOT_PRM")
        loaded = self.scorer.load_model(SLOTS[request.slot], request.model_dir)
        return reward_pb2.LoadModelResponse(
            slot=request.slot, model_dir=str(loaded.model_dir), architecture=loaded.architecture,
            per_token=loaded.per_token, step_tag=loaded.meta.get("step_tag") or "",
            step_delimiter=self.scorer.settings.prm_step_delimiter,
            metadata={k: json.dumps(v) for k, v in loaded.meta.items()}, version=loaded.version,
            replaced_dir=str(loaded.replaced_dir or ""))
