"""gRPC SchedulerService: start, watch and stop jobs."""

from __future__ import annotations

from collections.abc import Callable

from temper.runtime.errors import FailedPrecondition, InvalidArgument, NotFound, reject_unknown_fields
from temper.runtime.logs import get_logger
from temper.scheduler.core import ACTIVE, Job, JobSpec
from temper.scheduler.store import SavedJob
from temper.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

_log = get_logger(component="scheduler")


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServiceServicer):
    """``make_job(spec, resumed)`` builds a job (``resumed``: restored from the store, checked when accepted)."""

    def __init__(self, make_job: Callable[[JobSpec, bool], Job]):
        self.make_job = make_job
        self.jobs: dict[str, Job] = {}

    def resume_saved(self, saved: list[SavedJob], rollouts_in_stream: int | None = None) -> list[str]:
        """Load the jobs a previous scheduler on this data dir saved; start again those it left running or
        paused (returns their ids). A finished one answers GetJob, and its id stays taken.

        ``rollouts_in_stream``: how many messages the `rollouts` topic has ever held. Fewer than an unfinished
        job published means the broker is not the one it published to (a new stack on an old data dir: the
        embedded broker keeps nothing), so its groups and the learner's progress on them are gone; such a job
        is STOPPED, saying why, instead of waiting forever for versions no learner will reach."""
        resumed = []
        for s in saved:
            try:
                job = self.make_job(s.spec, True).restore(s.checkpoint, s.outcomes)
            except Exception:  # noqa: BLE001 - one unreadable job must not keep the scheduler (and the rest) down
                _log.exception("a saved job could not be restored; it is left out", job_id=s.spec.job_id)
                continue
            self.jobs[s.spec.job_id] = job
            if job.state not in ACTIVE:
                continue
            if rollouts_in_stream is not None and rollouts_in_stream < job.groups_published:
                job.abandon(f"not resumed: the broker holds {rollouts_in_stream} rollouts, fewer than the "
                            f"{job.groups_published} this job published (another broker: its stream is gone)")
                continue
            job.start()
            resumed.append(s.spec.job_id)
        return resumed

    def StartJob(self, request, context):
        reject_unknown_fields(request, "request")
        try:
            spec = JobSpec.from_proto(request.spec)
        except InvalidArgument as e:  # JobSpec names its own fields; on the wire they sit under `spec`
            raise InvalidArgument(e.message, field=f"spec.{e.field}") from None
        running = [j for j in self.jobs.values() if j.state in ACTIVE]
        if running:
            raise FailedPrecondition(f"job {running[0].spec.job_id} is still running", field="spec.job_id")
        if spec.job_id in self.jobs:
            raise FailedPrecondition(f"job {spec.job_id} already ran; pick a new id", field="spec.job_id")
        job = self.make_job(spec, False)
        job.save()  # accepted: a scheduler that dies from here on resumes it
        job = self.jobs[spec.job_id] = job.start()
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
        """The process is shutting down: end every job's thread, leaving its saved state to be resumed."""
        for job in self.jobs.values():
            job.halt()
