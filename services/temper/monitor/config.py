"""Configuration of the monitor service (the ``[monitor]`` table)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from temper.runtime.config import ServiceConfig, address_of


class MonitorConfig(ServiceConfig):
    section = "monitor"

    consumer_group: str = Field("temper-monitor", description="Kafka consumer group of the `scored` stream "
                                                              "(`metrics` is read as <group>.metrics)")
    scheduler_address: str = address_of("scheduler", "", "host:port of the scheduler, where pause/stop policies act "
                                                         "on a job (needed once a detector's policy is pause or stop)")
    groups_per_step: int = Field(0, description="groups of one scheduler step, for groups that do not say "
                                                "(RolloutGroup.step_groups = 0); 0: such a step closes when the "
                                                "next one starts")
    read_traces: bool = Field(True, description="consume the sandbox's execution traces (`sandbox-traces`, as "
                                                "<group>.traces): the code_exploit detector's evidence from the runs")
    detectors: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="detector settings, the [monitor.detectors.<name>] tables: enabled, "
        "policy (warn | pause | stop), severity, cooldown_steps, the detector's parameters, and per-domain overrides in "
        "[monitor.detectors.<name>.domains.\"<prefix>\"] (see temper.monitor.core.DetectorSet)")
