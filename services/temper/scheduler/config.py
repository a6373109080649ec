"""Configuration of the scheduler service (the ``[scheduler]`` table)."""

from __future__ import annotations

from pydantic import Field

from temper.runtime.config import ServiceConfig, address_of


class SchedulerConfig(ServiceConfig):
    section = "scheduler"

    inference_address: str = address_of("inference", "127.0.0.1:50051", "host:port of the inference service")
    publish_timeout_seconds: float = Field(30.0, description="how long a rollout group may wait for the broker's "
                                                             "acknowledgement")
