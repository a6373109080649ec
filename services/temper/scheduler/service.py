"""The scheduler service: runs jobs (tasks -> inference -> `rollouts`)."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import grpc
from prometheus_client import Counter

from temper.client.discovery import Replicas
from temper.client.sdk import InferenceClient, RewardClient
from temper.runtime import kafka
from temper.runtime.logs import get_logger
from temper.runtime.rpc import client
from temper.runtime.service import Service, StartupError
from temper.scheduler.config import SchedulerConfig
from temper.scheduler.core import Job, JobSpec
from temper.scheduler.evaluation import check_scorable
from temper.scheduler.replicas import generate_split, lowest_version
from temper.scheduler.servicer import SchedulerServicer
from temper.scheduler.store import JobStore
from temper.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

_log = get_logger(component="scheduler")
REPLICA_GENERATE_CALLS = Counter("temper_scheduler_replica_generate_calls_total",
                                 "Generate calls of a step split over inference replicas, per replica and outcome",
                                 ["replica", "outcome"])
# a replica down, restarting or dying mid-call: its chunk goes to another one
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED,
                       grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL})


def _retryable(e: BaseException) -> bool:
    return isinstance(e, grpc.RpcError) and e.code() in RETRYABLE


def _unavailable(e: BaseException) -> bool:
    """A dependency down or restarting (or gone mid-call): what a job waits out (temper.scheduler.core)."""
    return isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.UNAVAILABLE


class SchedulerService(Service[SchedulerConfig]):
    name = "scheduler"
    config_class = SchedulerConfig

    def open(self, stack: ExitStack) -> None:
        config = self.config
        self.inference = stack.enter_context(client(InferenceClient, config.inference_address))
        self.inference.timeout = config.generate_timeout_seconds
        # held-out answers on a channel of their own, with a longer deadline
        self.evaluator = stack.enter_context(client(InferenceClient, config.inference_address))
        self.evaluator.timeout = config.eval_timeout_seconds
        # the replicas one by one, to read the version every one serves (generation is spread by the channel above)
        try:
            self.replicas = Replicas(config.inference_address,
                                     lambda a, name: client(InferenceClient, a, name, timeout=10.0))
        except ValueError as e:
            raise StartupError(f"inference_address: {e}") from e
        stack.callback(self.replicas.close)
        # and for generation, when a step is split over them (temper.scheduler.replicas)
        self.generators = Replicas(config.inference_address,
                                   lambda a, name: client(InferenceClient, a, name,
                                                          timeout=config.generate_timeout_seconds))
        stack.callback(self.generators.close)
        self.reward = stack.enter_context(client(RewardClient, config.reward_address)) if config.reward_address else None
        kafka.ensure_topics(config.kafka_bootstrap)
        self.producer = kafka.ProtoProducer(config.kafka_bootstrap, client_id="temper-scheduler")
        stack.callback(self.producer.close)
        self.store = None
        if config.persist_jobs:  # durable job state (temper.scheduler.store); closed after the jobs stop
            self.store = JobStore(Path(config.data_dir) / "jobs.sqlite")
            stack.callback(self.store.close)
        self.servicer = SchedulerServicer(self._make_job)
        stack.callback(self.servicer.stop_all)
        if self.store is not None:  # before the consumer: every outcome of a resumed job reaches it
            resumed = self.servicer.resume_saved(self.store.jobs(),
                                                 kafka.messages_in(config.kafka_bootstrap, kafka.ROLLOUTS))
            if resumed:
                _log.warning("resumed jobs a previous scheduler left unfinished", jobs=resumed)
        # outcomes: every scored group of a running job reaches its sampling policy (curriculum, weights)
        self.consumer = kafka.ProtoConsumer(config.kafka_bootstrap, kafka.SCORED, config.consumer_group,
                                            common_pb2.RolloutGroup, self.servicer.observe_scored).start()
        stack.callback(self.consumer.stop)

    def _make_job(self, spec: JobSpec, resumed: bool = False) -> Job:
        inference, evaluator, reward, config = self.inference, self.evaluator, self.reward, self.config

        def generate(prompts, s: JobSpec, seed: int, adapters: list[str] | None = None):
            # each prompt travels with its LoRA adapter ("": the base), so a step split over replicas keeps them paired
            prompts = list(zip(prompts, adapters or [""] * len(prompts)))

            def on(replica: InferenceClient):
                return lambda part, part_seed: replica.generate(
                    [p for p, _ in part], n=s.group_size, temperature=s.temperature, max_tokens=s.max_tokens,
                    seed=part_seed, apply_chat_template=s.chat_template, assistant_prefix=s.response_prefix,
                    stop=s.stop, adapters=[a for _, a in part])

            answering = self.answering_replicas(len(prompts))
            if not answering:  # one call over the round_robin channel, as without replicas
                return on(inference)(prompts, seed)
            if len(answering) == 1:  # the others are down: one call, to the one that answers
                return on(next(iter(answering.values())))(prompts, seed)
            split = generate_split(prompts, seed, {a: on(c) for a, c in answering.items()}, _retryable)
            for address, calls in split.calls.items():
                failed = split.failed[address]
                REPLICA_GENERATE_CALLS.labels(address, "ok").inc(calls - failed)
                REPLICA_GENERATE_CALLS.labels(address, "failed").inc(failed)
            _log.info("step generated over replicas", job_id=s.job_id, prompts_per_replica=split.prompts_per_replica(),
                      calls=dict(split.calls), failed=dict(split.failed),
                      policy_versions=sorted({r.policy_version for r in split.responses}))
            return split.responses

        def answer(prompts, max_tokens: int, n: int, temperature: float, seed: int, adapters: list[str] | None = None):
            return evaluator.generate(prompts, n=n, temperature=temperature, max_tokens=max_tokens, seed=seed,
                                      apply_chat_template=spec.chat_template, assistant_prefix=spec.response_prefix,
                                      stop=spec.stop, adapters=adapters or "")

        def publish(group):
            self.producer.send(kafka.ROLLOUTS, group.group_id, group).get(config.publish_timeout_seconds)

        # before any work (once, when the job is accepted): every evaluated domain is scorable
        if spec.eval.size > 0 and reward is not None and not resumed:
            check_scorable(spec.domains, [d for d in spec.eval_domains if d not in spec.domains], reward.list_domains())
        return Job(spec, generate, publish, self.serving_version, answer=answer if reward else None,
                   score=reward.score if reward else None, journal=self.store, transient=_unavailable,
                   dependency_wait_seconds=config.dependency_wait_seconds)

    def answering_replicas(self, prompts: int) -> dict[str, InferenceClient]:
        """The generation clients of the replicas that answer now, by address ({} when the step is not split:
        ``split_across_replicas`` off, one prompt, one replica named). Only a replica that answers is given a
        chunk, so each serves at least the version the job waited for (``serving_version``: their lowest)."""
        if not self.config.split_across_replicas or prompts <= 1:
            return {}
        clients = self.generators.current()
        if len(clients) <= 1:
            return {}
        infos = {}
        for address, replica in self.replicas.current().items():
            try:
                infos[address] = replica.info()
            except grpc.RpcError:
                continue
        if len(infos) > 1:
            lowest_version(infos)  # replicas of another model or lineage fail the step, naming one
        return {a: clients[a] for a in sorted(infos) if a in clients}

    def serving_version(self) -> int:
        """The lowest policy version over the inference replicas that answer (temper.scheduler.replicas)."""
        infos, error = {}, None
        for address, replica in self.replicas.current().items():
            try:
                infos[address] = replica.info()
            except grpc.RpcError as e:  # down or restarting: generation goes to the others meanwhile
                error = e
        if not infos:
            if error is not None:
                raise error
            raise RuntimeError(f"inference_address {self.config.inference_address!r} names no replica now")
        return lowest_version(infos)

    def checks(self):
        return [lambda: self.consumer.alive]

    def register(self, server) -> list[str]:
        scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(self.servicer, server)
        return [scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"].full_name]
