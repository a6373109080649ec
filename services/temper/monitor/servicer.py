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

    def ListSteps(self, request, context):
        reject_unknown_fields(request, "request")
        return monitor_pb2.ListStepsResponse(series=[
            monitor_pb2.StepSeries(domain=domain, source=source, steps=[
                monitor_pb2.StepPoint(step=s.step, samples=s.samples, values=s.values) for s in steps])
            for source, domain, steps in self.monitor.steps(request.job_id, request.domain, request.last)])
