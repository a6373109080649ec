"""Malformed or out-of-range requests to every implemented method: INVALID_ARGUMENT naming the
field (or the documented status), and the service keeps serving."""

import json

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from temper.client.sdk import (
    InferenceClient,
    LearnerClient,
    MonitorClient,
    ReplayClient,
    RewardClient,
    SchedulerClient,
)
from temper.inference.weights import chunks_from_tensors
from temper.runtime.rpc import check_health
from temper.v1 import common_pb2, learner_pb2, replay_pb2, reward_pb2, scheduler_pb2
from tests.builders import scored_group


def expect(code, field, call, *args, **kwargs):
    with pytest.raises(grpc.RpcError) as e:
        call(*args, **kwargs)
    assert e.value.code() == code, e.value.details()
    if field:
        assert field in e.value.details(), e.value.details()
    return e.value


def clients(stack):
    s = stack.load().services
    return {n: s[n].address for n in s}


def test_inference(stack):
    addr = clients(stack)["inference"]
    c = InferenceClient(addr)
    IA = grpc.StatusCode.INVALID_ARGUMENT
    expect(IA, "prompts", c.generate, [])
    expect(IA, "sampling.n", c.generate, ["copy 1 2 3"], n=0)
    expect(IA, "sampling.max_tokens", c.generate, ["copy 1 2 3"], max_tokens=0)
    expect(IA, "sampling.max_tokens", c.generate, ["copy 1 2 3"], max_tokens=1_000_000)
    expect(IA, "prompts[0]", c.generate, ["copy 1 2 3 " * 60], max_tokens=8)
    expect(IA, "prompts[1].text", c.generate, ["copy 1", ""])
    expect(IA, "sampling.temperature", c.generate, ["copy 1"], temperature=-1)
    expect(IA, "prompts[0].token_ids", c.generate, [[99999]])
    # prompts x n past max_sequences_per_request (4096): refused before any work (it used to run, memory unbounded)
    expect(IA, "sampling.n", c.generate, ["copy 1"], n=2**31 - 1, max_tokens=1)
    expect(IA, "prompts", c.generate, ["copy 1"] * 5000, max_tokens=1)
    # (an unknown sampling field, sent raw, is refused: tests/inference/test_service.py)
    # weight updates: bad checksum, missing tensor, misshapen tensor; the old version keeps serving
    version = c.policy_version()
    args = stack.load().services["inference"].args
    model = AutoModelForCausalLM.from_pretrained(args[args.index("--model-dir") + 1])
    good = {n: p.detach() for n, p in model.named_parameters()}
    name = next(iter(good))
    bad_sum = list(chunks_from_tensors(good))
    bad_sum[0].sha256 = "0" * 64
    expect(IA, f"tensor {name}", c.stub.UpdateWeights, iter(bad_sum), timeout=30)
    push = lambda t, **kw: c.update_weights(chunks_from_tensors(t, **kw))  # noqa: E731
    expect(IA, f"tensor {name}", push, {k: v for k, v in good.items() if k != name})
    expect(IA, f"tensor {name}", push, {**good, name: torch.zeros(2, 2)})
    expect(IA, "tensor", push, {**good, "extra.weight": torch.zeros(2)})
    assert c.policy_version() == version
    assert len(c.generate(["copy 1 2 3"], n=2, max_tokens=2).results[0].completions) == 2
    assert check_health(addr) == "SERVING"


def test_reward(stack, tmp_path):
    addr = clients(stack)["reward"]
    c = RewardClient(addr)
    IA = grpc.StatusCode.INVALID_ARGUMENT
    expect(IA, "group", c.stub.Score, reward_pb2.ScoreRequest(), timeout=10)
    g = common_pb2.RolloutGroup(group_id="g", task=common_pb2.Task(domain="nope", reference_answer="1"),
                                trajectories=[common_pb2.Trajectory(completion_text="1")])
    expect(IA, "group.task.domain", c.score, g)
    g.task.domain, g.task.reference_answer = "toy.copy", ""
    expect(IA, "group.task.reference_answer", c.score, g)
    g.task.reference_answer = "1"
    assert c.score(g).trajectories[0].reward.total == 1.0
    # LoadModel: a slot, a folder that exists, a reward model of that slot; nothing loaded by a refusal
    FP = grpc.StatusCode.FAILED_PRECONDITION
    expect(IA, "slot", c.stub.LoadModel, reward_pb2.LoadModelRequest(model_dir=str(tmp_path)), timeout=10)
    expect(IA, "model_dir", c.load_model, "", slot="prm")
    expect(IA, "model_dir", c.load_model, str(tmp_path / "nope"), slot="prm")
    expect(FP, "model_dir", c.load_model, str(tmp_path), slot="rm")  # a folder without a checkpoint
    policy = stack.load().services["inference"].args
    expect(FP, "model_dir", c.load_model, policy[policy.index("--model-dir") + 1], slot="prm")  # a causal LM
    assert not c.list_domains().process_reward_model_loaded and not c.list_domains().reward_model_loaded
    assert check_health(addr) == "SERVING"


def test_replay(stack):
    addr = clients(stack)["replay"]
    c = ReplayClient(addr)
    IA = grpc.StatusCode.INVALID_ARGUMENT
    expect(IA, "table", c.sample, 1, table="nope", timeout_ms=0)
    expect(IA, "batch_size", c.sample, 0, timeout_ms=0)
    expect(IA, "batch_size", c.sample, -3, timeout_ms=0)
    expect(IA, "timeout_ms", c.sample, 1, timeout_ms=-1)
    expect(IA, "table", c.stats, "nope")
    bad = scored_group("bad")
    bad.trajectories[0].completion_logprobs.append(-1.0)
    expect(IA, "requests[0].groups[0].trajectories[0].completion_logprobs", c.insert, [bad])  # the SDK batches
    expect(IA, "requests[0].group", c.stub.Insert, iter([replay_pb2.InsertRequest(table="default")]), timeout=10)
    expect(IA, "table", c.stub.UpdatePriorities, replay_pb2.UpdatePrioritiesRequest(), timeout=10)
    assert c.stats().table == "default"
    assert check_health(addr) == "SERVING"


def test_scheduler(stack):
    addr = clients(stack)["scheduler"]
    c = SchedulerClient(addr)
    IA = grpc.StatusCode.INVALID_ARGUMENT
    ok = dict(steps=1, prompts_per_step=1, group_size=1, temperature=1.0, max_tokens=1)
    for field, value in [("steps", 0), ("prompts_per_step", -1), ("group_size", 0), ("temperature", 0.0),
                         ("max_tokens", 0), ("max_policy_lag", -1)]:
        expect(IA, field, c.start_job, scheduler_pb2.JobSpec(**{**ok, field: value}))
    expect(IA, "domains", c.start_job, scheduler_pb2.JobSpec(**ok, domains=["nope"]))
    expect(IA, "stop", c.start_job, scheduler_pb2.JobSpec(**ok, stop=["\n\n", ""]))
    expect(IA, "sampling.weights[toy.copy]", c.start_job,
           scheduler_pb2.JobSpec(**ok, domains=["toy.copy"], sampling='{"weights": {"toy.copy": -1}}'))
    expect(IA, "sampling.adaptive.floor", c.start_job,
           scheduler_pb2.JobSpec(**ok, domains=["toy.copy", "toy.next"], sampling='{"adaptive": {"floor": 0.9}}'))
    dataset = {"path": "/nonexistent/rows.jsonl", "prompt_field": "q", "answer_field": "a", "verifier": "exact_answer"}
    expect(IA, "domain_config[data.mine].path", c.start_job,
           scheduler_pb2.JobSpec(**ok, domains=["data.mine"], domain_config={"data.mine": json.dumps(dataset)}))
    expect(IA, "domain_config[data.mine]", c.start_job, scheduler_pb2.JobSpec(**ok, domains=["data.mine"]))
    expect(grpc.StatusCode.NOT_FOUND, "job_id", c.job, "no-such-job")
    expect(grpc.StatusCode.NOT_FOUND, "job_id", c.pause_job, "no-such-job")
    expect(grpc.StatusCode.NOT_FOUND, "job_id", c.resume_job, "no-such-job")
    # an error quoting a huge value keeps its status (details are cut, not dropped with the call)
    e = expect(grpc.StatusCode.NOT_FOUND, "job_id", c.job, "x" * 100_000)
    assert e.details().startswith("job_id: ") and len(e.details()) < 1000, len(e.details())
    assert c.list_jobs() == []  # every StartJob above was refused: no job was made
    assert check_health(addr) == "SERVING"


def test_learner_and_monitor(stack):
    addrs = clients(stack)
    status = LearnerClient(addrs["learner"]).status()
    assert status.algorithm == "grpo+ppo_clip"
    expect(grpc.StatusCode.INVALID_ARGUMENT, "path", LearnerClient(addrs["learner"]).stub.Checkpoint,
           learner_pb2.CheckpointRequest(path="../../outside"), timeout=10)
    for bad in ["a\x00b", "/tmp/\x00x"]:  # NUL in a path: INVALID_ARGUMENT, not ValueError -> INTERNAL
        expect(grpc.StatusCode.INVALID_ARGUMENT, "path", LearnerClient(addrs["learner"]).stub.Checkpoint,
               learner_pb2.CheckpointRequest(path=bad), timeout=10)
        expect(grpc.StatusCode.INVALID_ARGUMENT, "path", LearnerClient(addrs["learner"]).stub.ExportPolicy,
               learner_pb2.ExportPolicyRequest(path=bad), timeout=10)
    monitor = MonitorClient(addrs["monitor"])
    monitor.reward_curve("no-such-domain")  # empty, not an error
    assert monitor.list_alerts(job_id="no-such-job") == []
    for field, kw in [("limit", {"limit": -1}), ("limit", {"limit": 10_001}), ("detector", {"detector": "nope"}),
                      ("min_severity", {"min_severity": 7}), ("since_unix_ms", {"since_unix_ms": -1})]:
        expect(grpc.StatusCode.INVALID_ARGUMENT, field, monitor.list_alerts, **kw)
    assert monitor.list_steps("no-such-job") == []
    for field, kw in [("job_id", {"job_id": ""}), ("last", {"job_id": "j", "last": -1}),
                      ("last", {"job_id": "j", "last": 10_001})]:
        expect(grpc.StatusCode.INVALID_ARGUMENT, field, monitor.list_steps, **kw)
    for name, addr in addrs.items():
        assert check_health(addr) == "SERVING", name


def test_errors_are_counted_on_the_metrics_endpoint(stack):
    import urllib.request

    state = stack.load()
    c = ReplayClient(state.services["replay"].address)
    expect(grpc.StatusCode.INVALID_ARGUMENT, "table", c.stats, "nope")
    port = state.services["replay"].metrics_port
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    line = [x for x in body.splitlines() if x.startswith("temper_rpc_errors_total{")
            and "ReplayService/Stats" in x and "INVALID_ARGUMENT" in x]
    assert line and float(line[0].rsplit(" ", 1)[1]) >= 1.0


def test_undecodable_requests_are_invalid_argument_naming_the_request(stack):
    """Bytes that are no protobuf (a truncated length prefix): INVALID_ARGUMENT naming the request, or the
    stream's item, not gRPC's own INTERNAL "Exception deserializing request!"."""
    s = clients(stack)
    garbage = b"\x0a\xff\xff\xff\xff\x0f"
    for service, method in [("reward", "/temper.v1.RewardService/Score"),
                            ("reward", "/temper.v1.RewardService/LoadModel"),
                            ("scheduler", "/temper.v1.SchedulerService/StartJob"),
                            ("monitor", "/temper.v1.MonitorService/ListAlerts"),
                            ("replay", "/temper.v1.ReplayService/Sample")]:
        with grpc.insecure_channel(s[service]) as ch:
            e = expect(grpc.StatusCode.INVALID_ARGUMENT, "request:", ch.unary_unary(method), garbage, timeout=10)
            assert e.details().startswith("request: not a valid message"), e.details()
    for service, method in [("replay", "/temper.v1.ReplayService/Insert"),
                            ("inference", "/temper.v1.InferenceService/UpdateWeights")]:
        with grpc.insecure_channel(s[service]) as ch:
            e = expect(grpc.StatusCode.INVALID_ARGUMENT, "requests[0]", ch.stream_unary(method), iter([garbage]),
                       timeout=10)
    for name, addr in s.items():
        assert check_health(addr) == "SERVING", name
