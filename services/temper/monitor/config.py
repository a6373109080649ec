"""Configuration of the monitor service (the ``[monitor]`` table)."""

from __future__ import annotations

from pydantic import Field

from temper.runtime.config import ServiceConfig


class MonitorConfig(ServiceConfig):
    section = "monitor"

    consumer_group: str = Field("temper-monitor", description="Kafka consumer group of the `scored` stream")
