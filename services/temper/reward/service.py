"""The reward service: gRPC Score, and `rollouts` -> `scored` streaming.

The stream path: each rollout group is scored (or, if it is a bad request, marked with ERROR
rewards), recorded in the redelivery table (``dedup.ScoredCache``), published on `scored`, and
only once the broker acknowledged it is the rollout's offset committed. If the sandbox is down
past its retries (``[reward.code] on_unavailable = "retry"``), the handler raises and the
consumer retries the same rollout after ``retry_backoff_seconds``: nothing is published for it
until it can be scored.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

from prometheus_client import Counter, Histogram

from temper.reward.config import RewardConfig
from temper.reward.core import Scorer
from temper.reward.dedup import ScoredCache
from temper.reward.servicer import RewardServicer
from temper.runtime import kafka
from temper.runtime.service import Service
from temper.v1 import common_pb2, reward_pb2, reward_pb2_grpc

SCORED_GROUPS = Counter("temper_reward_groups_total", "Rollout groups handled on the stream path", ["outcome"])
SCORE_SECONDS = Histogram("temper_reward_score_seconds", "Time to score one group", ["domain_family"],
                          buckets=(0.001, 0.005, 0.02, 0.1, 0.5, 1, 2, 5, 10, 30, 60))


class RewardService(Service[RewardConfig]):
    name = "reward"
    config_class = RewardConfig

    def open(self, stack: ExitStack) -> None:
        config = self.config
        self.scorer = Scorer.from_settings(config.reward_settings())
        stack.callback(self.scorer.close)
        kafka.ensure_topics(config.kafka_bootstrap)
        self.cache = ScoredCache(Path(config.data_dir) / "scored.sqlite", config.redelivery_table_entries)
        stack.callback(self.cache.close)
        self.producer = kafka.ProtoProducer(config.kafka_bootstrap, client_id="temper-reward")
        stack.callback(self.producer.close)
        self.consumer = kafka.ProtoConsumer(config.kafka_bootstrap, kafka.ROLLOUTS, config.consumer_group,
                                            common_pb2.RolloutGroup, self._handle,
                                            retry_backoff=config.retry_backoff_seconds).start()
        stack.callback(self.consumer.stop)

    def _handle(self, group: common_pb2.RolloutGroup) -> None:
        scored = self.cache.get(group)
        if scored is not None:
            SCORED_GROUPS.labels("redelivered").inc()
        else:
            with SCORE_SECONDS.labels(group.task.domain.split(".", 1)[0]).time():
                scored = self.scorer.score_or_mark(group)  # SandboxUnavailable propagates: the consumer retries
            marked = any(t.reward.status == common_pb2.REWARD_STATUS_ERROR for t in scored.trajectories)
            SCORED_GROUPS.labels("error" if marked else "scored").inc()
            self.cache.put(group, scored)
        # durable once the broker acknowledged it; only then is the input offset committed
        self.producer.send(kafka.SCORED, scored.group_id, scored).get(self.config.publish_timeout_seconds)

    def register(self, server) -> list[str]:
        reward_pb2_grpc.add_RewardServiceServicer_to_server(RewardServicer(self.scorer), server)
        return [reward_pb2.DESCRIPTOR.services_by_name["RewardService"].full_name]

    def checks(self):
        return [lambda: self.consumer.alive]
