"""Entry point: python -m temper.learner — pulls from replay, trains, pushes weights."""

from __future__ import annotations

import sys

from temper.client.sdk import InferenceClient, ReplayClient
from temper.learner.loop import LearnerLoop
from temper.learner.servicer import LearnerServicer
from temper.learner.trainer import Trainer, TrainerConfig
from temper.runtime import kafka
from temper.runtime.config import ServiceConfig, load_config
from temper.runtime.rpc import Service, serve
from temper.v1 import learner_pb2, learner_pb2_grpc


class LearnerConfig(ServiceConfig):
    section = "learner"
    model_dir: str = ".temper/models/tiny"
    replay_address: str = "127.0.0.1:50054"
    inference_addresses: list[str] = ["127.0.0.1:50051"]
    groups_per_step: int = 16
    table: str = "default"
    advantage: str = "grpo"
    policy_loss: str = "ppo_clip"
    lr: float = 1e-3
    clip_low: float = 0.2
    clip_high: float = 0.2
    max_grad_norm: float = 1.0
    epochs: int = 1
    seed: int = 0


def main(argv: list[str] | None = None) -> None:
    config = load_config(LearnerConfig, sys.argv[1:] if argv is None else argv)
    trainer = Trainer(config.model_dir, TrainerConfig(
        advantage=config.advantage, policy_loss=config.policy_loss, lr=config.lr, clip_low=config.clip_low,
        clip_high=config.clip_high, max_grad_norm=config.max_grad_norm, epochs=config.epochs, seed=config.seed))
    replay = ReplayClient(config.replay_address)
    replicas = [InferenceClient(a) for a in config.inference_addresses]
    state: dict = {}
    loop = LearnerLoop(trainer, replay, replicas, None, config.groups_per_step, config.table)

    def on_start():
        kafka.ensure_topics(config.kafka_bootstrap)
        loop.producer = kafka.ProtoProducer(config.kafka_bootstrap, client_id="temper-learner")
        state["loop"] = loop.start()

    def on_stop():
        loop.stop()
        loop.producer.close()

    def register(server):
        learner_pb2_grpc.add_LearnerServiceServicer_to_server(
            LearnerServicer(loop, f"{config.advantage}+{config.policy_loss}"), server)
        return [learner_pb2.DESCRIPTOR.services_by_name["LearnerService"].full_name]

    serve(config, Service("learner", register, on_start=on_start, on_stop=on_stop))


if __name__ == "__main__":
    main()
