"""gRPC MonitorService: reward curves; alerts arrive with the monitor issue."""

from __future__ import annotations

from temper.monitor.core import RewardCurves
from temper.runtime.errors import Unimplemented
from temper.v1 import monitor_pb2, monitor_pb2_grpc


class MonitorServicer(monitor_pb2_grpc.MonitorServiceServicer):
    def __init__(self, curves: RewardCurves):
        self.curves = curves

    def RewardCurve(self, request, context):
        return monitor_pb2.RewardCurveResponse(points=[
            monitor_pb2.CurvePoint(domain=d, policy_version=v, mean_reward=m, samples=n)
            for d, v, m, n in self.curves.points(request.domain)])

    def ListAlerts(self, request, context):
        raise Unimplemented("reward-hacking and anomaly alerts arrive with the monitor issue")
