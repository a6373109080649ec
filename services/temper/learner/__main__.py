"""Entry point: python -m temper.learner — pulls from replay, trains, pushes weights, checkpoints.

Every field of TrainerConfig (algorithms, clipping, KL, LR schedule, micro-batching, packing,
off-policy correction, LoRA) is a setting of the [learner] table / TEMPER_LEARNER_* / --flag;
unknown algorithm names are refused at start-up with the field named.
"""

from __future__ import annotations

import sys
from pathlib import Path

from pydantic import ValidationError

from temper.client.sdk import InferenceClient, ReplayClient
from temper.learner.loop import LearnerLoop
from temper.learner.servicer import LearnerServicer
from temper.learner.trainer import Trainer, TrainerConfig
from temper.runtime import kafka
from temper.runtime.config import ServiceConfig, load_config
from temper.runtime.rpc import Service, client, serve
from temper.v1 import learner_pb2, learner_pb2_grpc


class LearnerConfig(ServiceConfig, TrainerConfig):
    section = "learner"
    model_dir: str = ".temper/models/tiny"
    replay_address: str = "127.0.0.1:50054"
    inference_addresses: list[str] = ["127.0.0.1:50051"]
    groups_per_step: int = 16
    table: str = "default"
    checkpoint_dir: str = ""  # "": <data_dir>/checkpoints
    checkpoint_every: int = 0  # steps between checkpoints; 0: only on request (gRPC Checkpoint)
    keep_checkpoints: int = 3
    resume: bool = True  # restore the newest checkpoint of checkpoint_dir at start-up

    def trainer_config(self) -> TrainerConfig:
        return TrainerConfig(**self.model_dump(include=set(TrainerConfig.model_fields)))


def main(argv: list[str] | None = None) -> None:
    try:
        config = load_config(LearnerConfig, sys.argv[1:] if argv is None else argv)
    except ValidationError as e:
        fields = ", ".join(".".join(map(str, err["loc"])) or "config" for err in e.errors())
        sys.exit(f"temper-learner: invalid configuration ({fields}):\n{e}")
    trainer = Trainer(config.model_dir, config.trainer_config())
    replay = client(ReplayClient, config.replay_address)
    replicas = [client(InferenceClient, a) for a in config.inference_addresses]
    loop = LearnerLoop(trainer, replay, replicas, None, config.groups_per_step, config.table,
                       checkpoint_dir=config.checkpoint_dir or Path(config.data_dir) / "checkpoints",
                       checkpoint_every=config.checkpoint_every, keep_checkpoints=config.keep_checkpoints)

    def on_start():
        kafka.ensure_topics(config.kafka_bootstrap)
        loop.producer = kafka.ProtoProducer(config.kafka_bootstrap, client_id="temper-learner")
        if config.resume:
            loop.resume_from_checkpoint()
        loop.start()

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
