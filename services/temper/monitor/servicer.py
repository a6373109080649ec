"""gRPC MonitorService: reward curves and alerts (the logic lives in temper.monitor.core)."""

from __future__ import annotations

from temper.monitor.core import Monitor
from temper.runtime.errors import reject_unknown_fields
from temper.v1 import monitor_pb2, monitor_pb2_grpc


class MonitorServicer(monitor_pb2_grpc.MonitorServiceServicer):
    def __init__(self, monitor: Monitor):
        self.monitor = monitor

    def RewardCurve(self, request, context):
        reject_unknown_fields(request, "request")
        return monitor_pb2.RewardCurveResponse(points=[
            monitor_pb2.CurvePoint(domain=d, policy_version=v, mean_reward=m, samples=n)
            for d, v, m, n in self.monitor.points(request.domain)])

    def ListAlerts(self, request, context):
        reject_unknown_fields(request, "request")
        return monitor_pb2.ListAlertsResponse(alerts=self.monitor.list_alerts(request))
