"""The learner service: pulls from replay, trains, pushes weights to inference, checkpoints."""

from __future__ import annotations

import os
from contextlib import ExitStack

from temper.client.discovery import Replicas
from temper.client.shards import ShardedReplay, shard_addresses
from temper.client.sdk import InferenceClient, ReplayClient
from temper.learner.config import LearnerConfig
from temper.learner.loop import LearnerLoop
from temper.learner.ranks import Ranks, check_world, torchrun
from temper.learner.servicer import LearnerServicer
from temper.learner.trainer import Trainer
from temper.runtime import kafka
from temper.runtime.logs import get_logger
from temper.runtime.rpc import client
from temper.runtime.service import Service, StartupError
from temper.runtime.storage import StorageError, mirror_from_url
from temper.v1 import learner_pb2, learner_pb2_grpc


def _exit_ranks_broken(error: BaseException) -> None:
    """Over ranks, an error the followers did not share (a rank gone, a collective failed) leaves the group
    unusable: rank 0 exits at once (status 5) so that its followers see it gone and leave, and the supervisor
    (torchrun, Kubernetes, ``temper up``'s) restarts the learner, which resumes from its newest checkpoint."""
    get_logger(component="learner").error("learner ranks broken; exiting for a restart of every rank",
                                          error=f"{type(error).__name__}: {error}")
    os._exit(5)


class LearnerService(Service[LearnerConfig]):
    name = "learner"
    config_class = LearnerConfig

    def open(self, stack: ExitStack) -> None:
        config = self.config
        try:  # before the model loads: a store that cannot be used stops the start at once
            mirror = mirror_from_url(config.checkpoint_url)
        except StorageError as e:
            raise StartupError(f"checkpoint_url: {e}") from e
        launched = torchrun()
        if launched is not None:  # torchrun started the ranks (several hosts): this is rank 0; join them
            try:
                check_world(config, launched[1])
                ranks = Ranks.joined(config)
            except ValueError as e:
                raise StartupError(str(e)) from e
            stack.callback(ranks.close)
        elif config.ranks > 1:  # the followers start and join before the model loads (temper.learner.ranks)
            ranks = Ranks(config.ranks, config.data_dir, config.model_dir, config.trainer_config().model_dump())
            stack.callback(ranks.close)
        trainer = Trainer(config.model_dir, config.trainer_config())  # the slow part; the port is already bound
        # channels to dependencies that may still be loading: calls wait for their servers (see runtime.service)
        shards = shard_addresses(config.replay_address)  # [replay] replicas = N: N shards, sampled as one table
        if len(shards) > 1:
            replay = ShardedReplay([stack.enter_context(client(ReplayClient, a)) for a in shards])
        else:
            replay = stack.enter_context(client(ReplayClient, config.replay_address))
        # every replica the targets name (fixed addresses, or dns:/// of a headless Service), re-resolved before
        # each push and each replica check, so a replica added later gets the policy
        try:
            replicas = Replicas(config.inference_addresses, lambda a, name: client(InferenceClient, a, name))
        except ValueError as e:
            raise StartupError(f"inference_addresses: {e}") from e
        stack.callback(replicas.close)
        self.loop = LearnerLoop(trainer, replay, replicas, None, config.groups_per_step, config.table,
                                checkpoint_dir=config.checkpoint_folder(),
                                checkpoint_every=config.checkpoint_every, keep_checkpoints=config.keep_checkpoints,
                                priority_signal=config.priority_signal, model_dir=config.model_dir,
                                mirror=mirror, policy_dir=config.policy_dir or None,
                                sample_lease_s=config.sample_lease_seconds)
        kafka.ensure_topics(config.kafka_bootstrap)
        self.loop.producer = kafka.ProtoProducer(config.kafka_bootstrap, client_id="temper-learner")
        stack.callback(self.loop.producer.close)
        if config.resume:
            # resuming asks every replica its version: wait for replicas that are still loading (bounded;
            # one that stays down gets the weights with the next step's push, as before)
            for replica in replicas.current().values():
                replica.wait_ready(config.dependency_wait_seconds)
            self.loop.resume_from_checkpoint()
        if trainer.world > 1:  # a rank gone mid-step breaks the group: only a restart of every rank mends it
            self.loop.on_failure = _exit_ranks_broken
        self.loop.start()
        stack.callback(self.loop.stop)

    def checks(self):
        return [self.loop.alive]  # a loop ended by an error: NOT_SERVING (a pod's liveness probe restarts it)

    def register(self, server) -> list[str]:
        learner_pb2_grpc.add_LearnerServiceServicer_to_server(
            LearnerServicer(self.loop, f"{self.config.advantage}+{self.config.policy_loss}"), server)
        return [learner_pb2.DESCRIPTOR.services_by_name["LearnerService"].full_name]
