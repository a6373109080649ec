"""Configuration of the reward service (the ``[reward]`` table): the service's own settings plus
``RewardSettings`` (domains, verifiers, models; see ``temper.reward.settings``)."""

from __future__ import annotations

from pydantic import Field

from temper.reward.settings import RewardSettings
from temper.runtime.config import ServiceConfig


class RewardConfig(ServiceConfig, RewardSettings):
    section = "reward"

    replicas: int = Field(1, ge=1, description="how many reward services the local launcher (`temper up`) starts, "
                                               "each on its own port, one Kafka consumer group: the `rollouts` "
                                               "topic gets as many partitions and each replica scores its share; "
                                               "Score calls go round robin (Kubernetes: the Deployment's replicas)")
    consumer_group: str = Field("temper-reward", description="Kafka consumer group of the `rollouts` stream")
    publish_timeout_seconds: float = Field(30.0, description="how long a scored group may wait for the broker's "
                                                             "acknowledgement")
    retry_backoff_seconds: float = Field(2.0, description="a rollout that could not be scored (sandbox down) is "
                                                          "retried after this")
    redelivery_table_entries: int = Field(10_000, description="scored groups remembered for redelivery "
                                                              "(dedup.ScoredCache)")

    def reward_settings(self) -> RewardSettings:
        return RewardSettings.model_validate(self.model_dump(include=set(RewardSettings.model_fields)))
