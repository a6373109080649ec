"""Entry point: python -m temper.scheduler — runs jobs: tasks -> inference -> `rollouts`."""

from __future__ import annotations

import sys

from temper.client.sdk import InferenceClient
from temper.runtime import kafka
from temper.runtime.config import ServiceConfig, load_config
from temper.runtime.rpc import Service, client, serve
from temper.scheduler.core import Job, JobSpec
from temper.scheduler.servicer import SchedulerServicer
from temper.v1 import scheduler_pb2, scheduler_pb2_grpc


class SchedulerConfig(ServiceConfig):
    section = "scheduler"
    inference_address: str = "127.0.0.1:50051"
    publish_timeout_seconds: float = 30.0


def main(argv: list[str] | None = None) -> None:
    config = load_config(SchedulerConfig, sys.argv[1:] if argv is None else argv)
    inference = client(InferenceClient, config.inference_address)
    state: dict = {}

    def make_job(spec: JobSpec) -> Job:
        def generate(prompts, s: JobSpec, seed: int):
            return inference.generate(prompts, n=s.group_size, temperature=s.temperature, max_tokens=s.max_tokens,
                                      seed=seed)

        def publish(group):
            state["producer"].send(kafka.ROLLOUTS, group.group_id, group).get(config.publish_timeout_seconds)

        return Job(spec, generate, publish, inference.policy_version)

    servicer = SchedulerServicer(make_job)

    def on_start():
        kafka.ensure_topics(config.kafka_bootstrap)
        state["producer"] = kafka.ProtoProducer(config.kafka_bootstrap, client_id="temper-scheduler")

    def on_stop():
        servicer.stop_all()
        state["producer"].close()

    def register(server):
        scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(servicer, server)
        return [scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"].full_name]

    serve(config, Service("scheduler", register, on_start=on_start, on_stop=on_stop))


if __name__ == "__main__":
    main()
