"""The scheduler service: runs jobs (tasks -> inference -> `rollouts`)."""

from __future__ import annotations

from contextlib import ExitStack

from temper.client.sdk import InferenceClient
from temper.runtime import kafka
from temper.runtime.rpc import client
from temper.runtime.service import Service
from temper.scheduler.config import SchedulerConfig
from temper.scheduler.core import Job, JobSpec
from temper.scheduler.servicer import SchedulerServicer
from temper.v1 import scheduler_pb2, scheduler_pb2_grpc


class SchedulerService(Service[SchedulerConfig]):
    name = "scheduler"
    config_class = SchedulerConfig

    def open(self, stack: ExitStack) -> None:
        config = self.config
        self.inference = stack.enter_context(client(InferenceClient, config.inference_address))
        kafka.ensure_topics(config.kafka_bootstrap)
        self.producer = kafka.ProtoProducer(config.kafka_bootstrap, client_id="temper-scheduler")
        stack.callback(self.producer.close)
        self.servicer = SchedulerServicer(self._make_job)
        stack.callback(self.servicer.stop_all)

    def _make_job(self, spec: JobSpec) -> Job:
        inference, config = self.inference, self.config

        def generate(prompts, s: JobSpec, seed: int):
            return inference.generate(prompts, n=s.group_size, temperature=s.temperature, max_tokens=s.max_tokens,
                                      seed=seed)

        def publish(group):
            self.producer.send(kafka.ROLLOUTS, group.group_id, group).get(config.publish_timeout_seconds)

        return Job(spec, generate, publish, inference.policy_version)

    def register(self, server) -> list[str]:
        scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(self.servicer, server)
        return [scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"].full_name]
