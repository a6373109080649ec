"""gRPC SchedulerService: start, watch and stop jobs."""

from __future__ import annotations

from collections.abc import Callable

from temper.runtime.errors import FailedPrecondition, InvalidArgument, NotFound, reject_unknown_fields
from temper.scheduler.core import Job, JobSpec
from temper.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(self, make_job: Callable[[JobSpec], Job]):
        self.make_job = make_job
        self.jobs: dict[str, Job] = {}

    def StartJob(self, request, context):
        reject_unknown_fields(request, "request")
        try:
            spec = JobSpec.from_proto(request.spec)
        except InvalidArgument as e:  # JobSpec names its own fields; on the wire they sit under `spec`
            raise InvalidArgument(e.message, field=f"spec.{e.field}") from None
        running = [j for j in self.jobs.values()
                   if j.state in (scheduler_pb2.JOB_STATE_RUNNING, scheduler_pb2.JOB_STATE_PAUSED)]
        if running:
            raise FailedPrecondition(f"job {running[0].spec.job_id} is still running", field="job_id")
        if spec.job_id in self.jobs:
            raise FailedPrecondition(f"job {spec.job_id} already ran; pick a new id", field="job_id")
        job = self.jobs[spec.job_id] = self.make_job(spec).start()
        return scheduler_pb2.StartJobResponse(job=job.status())

    def _job(self, job_id: str) -> Job:
        if job_id not in self.jobs:
            raise NotFound(f"no job {job_id!r}", field="job_id")
        return self.jobs[job_id]

    def GetJob(self, request, context):
        return scheduler_pb2.GetJobResponse(job=self._job(request.job_id).status())

    def StopJob(self, request, context):
        job = self._job(request.job_id)
        job.stop()
        return scheduler_pb2.StopJobResponse(job=job.status())

    def PauseJob(self, request, context):
        reject_unknown_fields(request, "request")
        job = self._job(request.job_id)
        job.pause(request.reason)
        return scheduler_pb2.PauseJobResponse(job=job.status())

    def ResumeJob(self, request, context):
        reject_unknown_fields(request, "request")
        job = self._job(request.job_id)
        job.resume()
        return scheduler_pb2.ResumeJobResponse(job=job.status())

    def ListJobs(self, request, context):
        reject_unknown_fields(request, "request")
        return scheduler_pb2.ListJobsResponse(jobs=[j.status() for j in list(self.jobs.values())])

    def observe_scored(self, group: common_pb2.RolloutGroup) -> None:
        """A group from the `scored` stream: its job (if this process runs it) learns the outcome."""
        job = self.jobs.get(group.job_id)
        if job is not None:
            job.observe_scored(group)

    def stop_all(self) -> None:
        for job in self.jobs.values():
            job.stop()
