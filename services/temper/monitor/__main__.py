"""Entry point: python -m temper.monitor — `scored` -> reward curves."""

from __future__ import annotations

import sys

from temper.monitor.core import RewardCurves
from temper.monitor.servicer import MonitorServicer
from temper.runtime import kafka
from temper.runtime.config import ServiceConfig, load_config
from temper.runtime.rpc import Service, serve
from temper.v1 import common_pb2, monitor_pb2, monitor_pb2_grpc


class MonitorConfig(ServiceConfig):
    section = "monitor"
    consumer_group: str = "temper-monitor"


def main(argv: list[str] | None = None) -> None:
    config = load_config(MonitorConfig, sys.argv[1:] if argv is None else argv)
    curves = RewardCurves()
    state: dict = {}

    def on_start():
        kafka.ensure_topics(config.kafka_bootstrap)
        state["consumer"] = kafka.ProtoConsumer(config.kafka_bootstrap, kafka.SCORED, config.consumer_group,
                                                common_pb2.RolloutGroup, curves.add).start()

    def on_stop():
        state["consumer"].stop()

    def register(server):
        monitor_pb2_grpc.add_MonitorServiceServicer_to_server(MonitorServicer(curves), server)
        return [monitor_pb2.DESCRIPTOR.services_by_name["MonitorService"].full_name]

    serve(config, Service("monitor", register, on_start=on_start, on_stop=on_stop,
                          checks=[lambda: state["consumer"].alive]))


if __name__ == "__main__":
    main()
