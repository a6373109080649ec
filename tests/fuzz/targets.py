"""What the fuzz suite aims at: which stack process serves each temper.v1 service, a valid request of each
method (the seeds its fuzz cases mutate), and the message type of each Kafka topic. ``test_strategies.py``
fails when a service, a method or a topic is missing here."""

from dataclasses import dataclass
from pathlib import Path

from temper.runtime import kafka
from temper.v1 import (
    common_pb2,
    inference_pb2,
    learner_pb2,
    monitor_pb2,
    replay_pb2,
    reward_pb2,
    sandbox_pb2,
    scheduler_pb2,
)
from tests import builders
from tests.fuzz import strategies

SERVICE_OF = {
    "temper.v1.InferenceService": "inference",
    "temper.v1.SandboxService": "sandbox",
    "temper.v1.RewardService": "reward",
    "temper.v1.ReplayService": "replay",
    "temper.v1.LearnerService": "learner",
    "temper.v1.SchedulerService": "scheduler",
    "temper.v1.MonitorService": "monitor",
}
TOPIC_TYPES = {
    kafka.ROLLOUTS: common_pb2.RolloutGroup, kafka.SCORED: common_pb2.RolloutGroup,
    kafka.METRICS: common_pb2.StepMetrics, kafka.SANDBOX_TRACES: sandbox_pb2.ExecutionTrace,
    kafka.ALERTS: monitor_pb2.Alert,
}

# topic -> the consumer groups of the stack that read it (the services' ``consumer_group`` defaults);
# the fuzz suite fails if the broker knows a group not named here
CONSUMERS = {
    kafka.ROLLOUTS: ["temper-reward"],
    kafka.SCORED: ["temper-replay", "temper-monitor", "temper-scheduler"],
    kafka.METRICS: ["temper-monitor.metrics"],
    kafka.SANDBOX_TRACES: ["temper-monitor.traces"],
}


def covered_methods() -> list[strategies.Method]:
    """Every method of the descriptors whose service the stack serves."""
    return [m for m in strategies.methods() if m.service.full_name in SERVICE_OF]


@dataclass
class Context:
    """What a seed may need of the stack under test."""

    model_dir: Path   # the model the inference service and the learner loaded
    tmp: Path         # a folder the services may write into (export paths)


def _weights(ctx: Context) -> list[list[inference_pb2.UpdateWeightsRequest]]:
    from safetensors.torch import load_file

    from temper.inference.weights import chunks_from_tensors

    tensors = {}
    for f in sorted(ctx.model_dir.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return [list(chunks_from_tensors(tensors, chunk_bytes=1 << 16))]


def _tiny_prm(ctx: Context) -> Path:
    from temper.reward.models import build_tiny_reward_model

    folder = ctx.tmp / "fuzz-prm"
    return folder if (folder / "config.json").exists() else build_tiny_reward_model(folder)


def _job(**kw) -> scheduler_pb2.StartJobRequest:
    return scheduler_pb2.StartJobRequest(spec=scheduler_pb2.JobSpec(
        steps=1, prompts_per_step=1, group_size=2, temperature=1.0, max_tokens=2, domains=["toy.copy"], **kw))


_program = sandbox_pb2.ExecuteRequest(language="python3", files=[sandbox_pb2.SourceFile(path="main.py",
                                      content=b"print(input())")], stdin=b"hi\n",
                                      limits=sandbox_pb2.Limits(wall_seconds=5, cpu_seconds=5, memory_mb=256))
_tests = sandbox_pb2.RunTestsRequest(program=_program, tests=[sandbox_pb2.TestCase(stdin=b"a\n", expected_stdout=b"a\n")])

# method id -> the valid requests its fuzz cases start from (a client stream's: a list of requests)
SEEDS = {
    "InferenceService.Generate": lambda ctx: [
        inference_pb2.GenerateRequest(prompts=[inference_pb2.Prompt(text="copy 1 2 3")],
                                      sampling=inference_pb2.SamplingParams(n=2, temperature=1.0, max_tokens=4)),
        inference_pb2.GenerateRequest(prompts=[inference_pb2.Prompt(token_ids=inference_pb2.TokenIds(ids=[1, 2]),
                                                                    apply_chat_template=True)],
                                      sampling=inference_pb2.SamplingParams(n=1, max_tokens=2, top_p=0.5, top_k=3,
                                                                            stop=["2"], seed=1))],
    "InferenceService.UpdateWeights": _weights,
    "InferenceService.GetPolicyVersion": lambda ctx: [inference_pb2.GetPolicyVersionRequest()],
    "SandboxService.Execute": lambda ctx: [_program],
    "SandboxService.RunTests": lambda ctx: [_tests],
    "SandboxService.RunTestsBatch": lambda ctx: [sandbox_pb2.RunTestsBatchRequest(programs=[_tests, _tests])],
    "RewardService.Score": lambda ctx: [reward_pb2.ScoreRequest(group=builders.rollout_group(
        "toy.copy", reference="1 2", texts=["1 2", "2"], group_id="fuzz-score"))],
    "RewardService.ListDomains": lambda ctx: [reward_pb2.ListDomainsRequest()],
    "RewardService.LoadModel": lambda ctx: [reward_pb2.LoadModelRequest(slot=reward_pb2.MODEL_SLOT_PRM,
                                                                        model_dir=str(_tiny_prm(ctx)))],
    "ReplayService.Insert": lambda ctx: [[replay_pb2.InsertRequest(table="default", group=builders.scored_group("fz-1")),
                                          replay_pb2.InsertRequest(table="default", groups=[builders.scored_group("fz-2")],
                                                                   priorities=[1.0])]],
    "ReplayService.Sample": lambda ctx: [replay_pb2.SampleRequest(table="default", batch_size=1, timeout_ms=0),
                                         replay_pb2.SampleRequest(table="default", batch_size=1, timeout_ms=0,
                                                                  lease_ms=1_000)],
    "ReplayService.SampleStream": lambda ctx: [replay_pb2.SampleStreamRequest(table="default", batch_size=1, timeout_ms=0,
                                                                              lease_ms=1_000, count=2)],
    "ReplayService.AckSample": lambda ctx: [replay_pb2.AckSampleRequest(lease_id="fz-lease"),
                                            replay_pb2.AckSampleRequest(
                                                lease_id="fz-lease", action=replay_pb2.AckSampleRequest.ACTION_EXTEND,
                                                extend_ms=1_000)],
    "ReplayService.UpdatePriorities": lambda ctx: [replay_pb2.UpdatePrioritiesRequest(table="default",
                                                                                     priorities={"fz-1": 2.0})],
    "ReplayService.Stats": lambda ctx: [replay_pb2.StatsRequest(table="default")],
    "ReplayService.Checkpoint": lambda ctx: [replay_pb2.ReplayServiceCheckpointRequest()],
    "ReplayService.Restore": lambda ctx: [replay_pb2.ReplayServiceRestoreRequest(checkpoint_id="none")],
    "LearnerService.Status": lambda ctx: [learner_pb2.StatusRequest()],
    "LearnerService.Checkpoint": lambda ctx: [learner_pb2.CheckpointRequest(), learner_pb2.CheckpointRequest(path="fz")],
    "LearnerService.Pause": lambda ctx: [learner_pb2.PauseRequest()],
    "LearnerService.Resume": lambda ctx: [learner_pb2.ResumeRequest()],
    "LearnerService.ExportPolicy": lambda ctx: [learner_pb2.ExportPolicyRequest(path=str(ctx.tmp / "export"))],
    "SchedulerService.StartJob": lambda ctx: [_job(), _job(sampling='{"weights": {"toy.copy": 1}}',
                                                           eval=scheduler_pb2.EvalSpec(size=1, seed=7))],
    "SchedulerService.GetJob": lambda ctx: [scheduler_pb2.GetJobRequest(job_id="j")],
    "SchedulerService.StopJob": lambda ctx: [scheduler_pb2.StopJobRequest(job_id="j")],
    "SchedulerService.PauseJob": lambda ctx: [scheduler_pb2.PauseJobRequest(job_id="j", reason="fuzz")],
    "SchedulerService.ResumeJob": lambda ctx: [scheduler_pb2.ResumeJobRequest(job_id="j")],
    "SchedulerService.ListJobs": lambda ctx: [scheduler_pb2.ListJobsRequest()],
    "MonitorService.RewardCurve": lambda ctx: [monitor_pb2.RewardCurveRequest(domain="toy.copy")],
    "MonitorService.ListAlerts": lambda ctx: [monitor_pb2.ListAlertsRequest(limit=10, domain="toy.copy")],
    "MonitorService.ListSteps": lambda ctx: [monitor_pb2.ListStepsRequest(job_id="j", last=5)],
}
