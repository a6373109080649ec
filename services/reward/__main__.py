"""Entry point: python -m temper.reward — gRPC Score, and `rollouts` -> `scored` streaming."""

from __future__ import annotations

import sys

from temper.reward.core import score_or_mark
from temper.reward.servicer import RewardServicer
from temper.runtime import kafka
from temper.runtime.config import ServiceConfig, load_config
from temper.runtime.rpc import Service, serve
from temper.v1 import common_pb2, reward_pb2, reward_pb2_grpc


class RewardConfig(ServiceConfig):
    section = "reward"
    consumer_group: str = "temper-reward"
    publish_timeout_seconds: float = 30.0


def main(argv: list[str] | None = None) -> None:
    config = load_config(RewardConfig, sys.argv[1:] if argv is None else argv)
    state: dict = {}

    def handle(group: common_pb2.RolloutGroup) -> None:
        scored = score_or_mark(group)
        # durable once the broker acknowledged it; only then is the input offset committed
        state["producer"].send(kafka.SCORED, scored.group_id, scored).get(config.publish_timeout_seconds)

    def on_start():
        kafka.ensure_topics(config.kafka_bootstrap)
        state["producer"] = kafka.ProtoProducer(config.kafka_bootstrap, client_id="temper-reward")
        state["consumer"] = kafka.ProtoConsumer(config.kafka_bootstrap, kafka.ROLLOUTS, config.consumer_group,
                                                common_pb2.RolloutGroup, handle).start()

    def on_stop():
        state["consumer"].stop()
        state["producer"].close()

    def register(server):
        reward_pb2_grpc.add_RewardServiceServicer_to_server(RewardServicer(), server)
        return [reward_pb2.DESCRIPTOR.services_by_name["RewardService"].full_name]

    serve(config, Service("reward", register, on_start=on_start, on_stop=on_stop,
                          checks=[lambda: state["consumer"].alive]))


if __name__ == "__main__":
    main()
