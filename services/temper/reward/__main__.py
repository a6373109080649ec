"""Entry point: python -m temper.reward — gRPC Score, and `rollouts` -> `scored` streaming.

The stream path: each rollout group is scored (or, if it is a bad request, marked with ERROR
rewards), recorded in the redelivery table (``dedup.ScoredCache``), published on `scored`, and
only once the broker acknowledged it is the rollout's offset committed. If the sandbox is down
past its retries (``[reward.code] on_unavailable = "retry"``), the handler raises and the
consumer retries the same rollout after ``retry_backoff_seconds``: nothing is published for it
until it can be scored.
"""

from __future__ import annotations

import sys
from pathlib import Path

from prometheus_client import Counter, Histogram

from temper.reward.core import Scorer
from temper.reward.dedup import ScoredCache
from temper.reward.servicer import RewardServicer
from temper.reward.settings import RewardSettings
from temper.runtime import kafka
from temper.runtime.config import ServiceConfig, load_config
from temper.runtime.logs import get_logger
from temper.runtime.rpc import Service, serve
from temper.v1 import common_pb2, reward_pb2, reward_pb2_grpc

SCORED_GROUPS = Counter("temper_reward_groups_total", "Rollout groups handled on the stream path", ["outcome"])
SCORE_SECONDS = Histogram("temper_reward_score_seconds", "Time to score one group", ["domain_family"],
                          buckets=(0.001, 0.005, 0.02, 0.1, 0.5, 1, 2, 5, 10, 30, 60))
_log = get_logger(component="reward")


class RewardConfig(ServiceConfig, RewardSettings):
    """The [reward] table: the service's own settings plus RewardSettings (domains, verifiers, models)."""

    section = "reward"
    consumer_group: str = "temper-reward"
    publish_timeout_seconds: float = 30.0
    retry_backoff_seconds: float = 2.0  # a rollout that could not be scored (sandbox down) is retried after this
    redelivery_table_entries: int = 10_000  # scored groups remembered for redelivery (dedup.ScoredCache)

    def reward_settings(self) -> RewardSettings:
        return RewardSettings.model_validate(self.model_dump(include=set(RewardSettings.model_fields)))


def main(argv: list[str] | None = None) -> None:
    config = load_config(RewardConfig, sys.argv[1:] if argv is None else argv)
    scorer = Scorer.from_settings(config.reward_settings())
    state: dict = {}

    def handle(group: common_pb2.RolloutGroup) -> None:
        cache: ScoredCache = state["cache"]
        scored = cache.get(group)
        if scored is not None:
            SCORED_GROUPS.labels("redelivered").inc()
        else:
            with SCORE_SECONDS.labels(group.task.domain.split(".", 1)[0]).time():
                scored = scorer.score_or_mark(group)  # SandboxUnavailable propagates: the consumer retries
            marked = any(t.reward.status == common_pb2.REWARD_STATUS_ERROR for t in scored.trajectories)
            SCORED_GROUPS.labels("error" if marked else "scored").inc()
            cache.put(group, scored)
        # durable once the broker acknowledged it; only then is the input offset committed
        state["producer"].send(kafka.SCORED, scored.group_id, scored).get(config.publish_timeout_seconds)

    def on_start():
        kafka.ensure_topics(config.kafka_bootstrap)
        state["cache"] = ScoredCache(Path(config.data_dir) / "scored.sqlite", config.redelivery_table_entries)
        state["producer"] = kafka.ProtoProducer(config.kafka_bootstrap, client_id="temper-reward")
        state["consumer"] = kafka.ProtoConsumer(config.kafka_bootstrap, kafka.ROLLOUTS, config.consumer_group,
                                                common_pb2.RolloutGroup, handle,
                                                retry_backoff=config.retry_backoff_seconds).start()

    def on_stop():
        state["consumer"].stop()
        state["producer"].close()
        state["cache"].close()
        scorer.close()

    def register(server):
        reward_pb2_grpc.add_RewardServiceServicer_to_server(RewardServicer(scorer), server)
        return [reward_pb2.DESCRIPTOR.services_by_name["RewardService"].full_name]

    serve(config, Service("reward", register, on_start=on_start, on_stop=on_stop,
                          checks=[lambda: state["consumer"].alive]))


if __name__ == "__main__":
    main()
