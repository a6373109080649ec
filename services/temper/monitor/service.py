"""The monitor service: `scored` + `metrics` (+ `sandbox-traces`) -> curves, detectors, alerts, over gRPC.

Alerts go to the `alerts` topic, the log (JSON lines) and Prometheus
(``temper_monitor_alerts_total``); a detector whose policy is pause or stop acts on the job
through the scheduler at ``scheduler_address``.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

from temper.client.sdk import SchedulerClient
from temper.monitor.config import MonitorConfig
from temper.monitor.core import DetectorSet, Monitor
from temper.monitor.servicer import MonitorServicer
from temper.runtime import kafka
from temper.runtime.errors import InvalidArgument
from temper.runtime.rpc import client
from temper.runtime.service import Service, StartupError
from temper.v1 import common_pb2, monitor_pb2, monitor_pb2_grpc, sandbox_pb2, scheduler_pb2


class MonitorService(Service[MonitorConfig]):
    name = "monitor"
    config_class = MonitorConfig

    def open(self, stack: ExitStack) -> None:
        config = self.config
        try:
            detectors = DetectorSet(config.detectors)
        except InvalidArgument as e:
            raise StartupError(f"invalid configuration: {e}") from e
        acting = sorted(detectors.policies() - {"warn"})
        if acting and not config.scheduler_address:
            raise StartupError(f"monitor.scheduler_address: a detector's policy is {acting}: the monitor needs the "
                               "scheduler's address")
        self.scheduler = (stack.enter_context(client(SchedulerClient, config.scheduler_address, timeout=10.0))
                          if config.scheduler_address else None)
        kafka.ensure_topics(config.kafka_bootstrap)
        self.producer = kafka.ProtoProducer(config.kafka_bootstrap, client_id="temper-monitor")
        stack.callback(self.producer.close)
        self.monitor = Monitor(Path(config.data_dir) / "monitor.sqlite", detectors, config.groups_per_step,
                               act=self._act if self.scheduler else None, publish=self._publish)
        stack.callback(self.monitor.close)
        self.monitor.flush_pending()
        self.consumers = [
            kafka.ProtoConsumer(config.kafka_bootstrap, kafka.SCORED, config.consumer_group, common_pb2.RolloutGroup,
                                self.monitor.add_scored).start(),
            # a group of its own per topic: members of one group subscribed to different topics make
            # every restart of either a rebalance of both
            kafka.ProtoConsumer(config.kafka_bootstrap, kafka.METRICS, f"{config.consumer_group}.metrics",
                                common_pb2.StepMetrics, self.monitor.add_metrics).start()]
        if config.read_traces:
            self.consumers.append(kafka.ProtoConsumer(
                config.kafka_bootstrap, kafka.SANDBOX_TRACES, f"{config.consumer_group}.traces",
                sandbox_pb2.ExecutionTrace, self.monitor.add_trace).start())
        for c in self.consumers:
            stack.callback(c.stop)

    def _act(self, alert: monitor_pb2.Alert, policy: str) -> str:
        reason = f"monitor alert {alert.alert_id}: {alert.message}"
        status = (self.scheduler.pause_job(alert.job_id, reason) if policy == "pause"
                  else self.scheduler.stop_job(alert.job_id))
        return f"job {status.job_id} {scheduler_pb2.JobState.Name(status.state)}"

    def _publish(self, alert: monitor_pb2.Alert) -> None:
        self.producer.send(kafka.ALERTS, alert.job_id, alert).get(30)

    def register(self, server) -> list[str]:
        monitor_pb2_grpc.add_MonitorServiceServicer_to_server(MonitorServicer(self.monitor), server)
        return [monitor_pb2.DESCRIPTOR.services_by_name["MonitorService"].full_name]

    def checks(self):
        return [lambda: all(c.alive for c in self.consumers)]
