"""The monitor service: `scored` -> reward curves, served over gRPC."""

from __future__ import annotations

from contextlib import ExitStack

from temper.monitor.config import MonitorConfig
from temper.monitor.core import RewardCurves
from temper.monitor.servicer import MonitorServicer
from temper.runtime import kafka
from temper.runtime.service import Service
from temper.v1 import common_pb2, monitor_pb2, monitor_pb2_grpc


class MonitorService(Service[MonitorConfig]):
    name = "monitor"
    config_class = MonitorConfig

    def open(self, stack: ExitStack) -> None:
        config = self.config
        self.curves = RewardCurves()
        kafka.ensure_topics(config.kafka_bootstrap)
        self.consumer = kafka.ProtoConsumer(config.kafka_bootstrap, kafka.SCORED, config.consumer_group,
                                            common_pb2.RolloutGroup, self.curves.add).start()
        stack.callback(self.consumer.stop)

    def register(self, server) -> list[str]:
        monitor_pb2_grpc.add_MonitorServiceServicer_to_server(MonitorServicer(self.curves), server)
        return [monitor_pb2.DESCRIPTOR.services_by_name["MonitorService"].full_name]

    def checks(self):
        return [lambda: self.consumer.alive]
