"""Configuration of the scheduler service (the ``[scheduler]`` table)."""

from __future__ import annotations

from pydantic import Field

from temper.runtime.config import ServiceConfig, address_of


class SchedulerConfig(ServiceConfig):
    section = "scheduler"

    inference_address: str = address_of("inference", "127.0.0.1:50051", "the inference replicas: host:port, "
                                        "ipv4:a:p,b:q (what `temper up` passes for [inference] replicas > 1) or "
                                        "dns:///name:port (a headless Service); generation is spread over them "
                                        "round_robin, the serving version is the lowest of theirs")
    reward_address: str = address_of("reward", "", "host:port of the reward service, which scores held-out "
                                                   "evaluations; empty: jobs without evaluation only")
    split_across_replicas: bool = Field(True, description="with more than one inference replica answering, split "
                                                          "each step's groups into one chunk per replica, generated "
                                                          "concurrently (a failed chunk goes to another replica); "
                                                          "false: one Generate call per step over the round_robin "
                                                          "channel")
    generate_timeout_seconds: float = Field(600.0, description="how long one step's generate call may take (a real "
                                                               "model on CPU takes minutes)")
    eval_timeout_seconds: float = Field(600.0, description="how long one evaluation's generate call may take")
    dependency_wait_seconds: float = Field(600.0, gt=0, description="how long a job waits, retrying, for inference "
                                           "or reward while it is down (killed, restarting) before the job fails")
    publish_timeout_seconds: float = Field(30.0, description="how long a rollout group may wait for the broker's "
                                                             "acknowledgement")
    consumer_group: str = Field("temper-scheduler", description="Kafka consumer group of the `scored` stream, from "
                                                                "which a job's sampling policy learns its outcomes")
    persist_jobs: bool = Field(True, description="keep each job's state (spec, steps done, counters, sampling state, "
                                                 "evaluations) in <data_dir>/jobs.sqlite, so a scheduler restarted "
                                                 "after a crash resumes its unfinished job; false: jobs live in "
                                                 "memory only")
