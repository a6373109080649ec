"""Per-domain-group LoRA adapters on the job side (no processes): the [job.adapters] table's rules, its proto
round trip, every group and prompt of a step tagged with its domain's adapter, the evaluation answering each
domain with its adapter, and the launcher giving the names to the learner and inference (and refusing a job whose
learner trains no LoRA)."""

from __future__ import annotations

import pytest

from temper.models import check_service_tables
from temper.runtime.errors import InvalidArgument
from temper.runtime.launcher import Launcher
from temper.scheduler.core import Job, JobSpec
from temper.scheduler.evaluation import EvalSets, evaluate
from temper.v1 import common_pb2, inference_pb2

ADAPTERS = {"copying": ["toy.copy"], "counting": ["toy.next"]}


def spec(**fields) -> JobSpec:
    values = dict(job_id="j", steps=2, prompts_per_step=6, group_size=2, domains=["toy.copy", "toy.next"],
                  max_tokens=2, adapters=ADAPTERS)
    return JobSpec(**{**values, **fields})


def test_the_spec_round_trips_and_maps_each_domain_to_its_adapter():
    s = spec()
    s.validate()
    back = JobSpec.from_proto(s.to_proto())
    assert back.adapters == ADAPTERS
    assert [back.adapter_of(d) for d in ("toy.copy", "toy.next", "toy.add")] == ["copying", "counting", ""]
    assert JobSpec.from_proto(spec(adapters={}).to_proto()).adapters == {}


@pytest.mark.parametrize("adapters, field, message", [
    ({"copying": ["toy.copy"]}, "adapters", "toy.next"),  # a trained domain in no adapter
    ({"a": ["toy.copy", "toy.next"], "b": ["toy.next"]}, "adapters.b", "one adapter per domain"),
    ({"a": ["toy.copy", "toy.next", "toy.add"]}, "adapters.a", "neither trains nor evaluates"),
    ({"a": []}, "adapters.a", "non-empty"),
    ({"a": "toy.copy"}, "adapters.a", "non-empty"),
    ({"a/b": ["toy.copy", "toy.next"]}, "adapters.a/b", "must match"),
])
def test_a_table_that_cannot_work_is_refused_naming_the_field(adapters, field, message):
    with pytest.raises(InvalidArgument, match=message) as e:
        spec(adapters=adapters).validate()
    assert e.value.field == field


def test_every_group_and_prompt_of_a_step_carries_its_domains_adapter():
    seen = []

    def generate(prompts, s, seed, adapters=None):
        seen.append(list(adapters))
        return inference_pb2.GenerateResponse(policy_version=0, results=[inference_pb2.PromptResult(
            prompt_token_ids=[1], completions=[inference_pb2.Completion(text="x", token_ids=[1], logprobs=[-0.1])
                                               for _ in range(s.group_size)]) for _ in prompts])

    published: list[common_pb2.RolloutGroup] = []
    s = spec()
    Job(s, generate, published.append, lambda: 0).run_step(0)
    assert len(published) == 6 and len({g.task.domain for g in published}) > 1
    assert all(g.adapter == s.adapter_of(g.task.domain) != "" for g in published)
    assert seen == [[g.adapter for g in published]]


def test_job_status_names_each_domains_adapter():
    job = Job(spec(domains=["toy.copy", "toy.next", "toy.add"], adapters={"copying": ["toy.copy"],
                                                                          "rest": ["toy.next", "toy.add"]}),
              lambda *a, **k: None, lambda g: None, lambda: 0)
    assert {d.domain: d.adapter for d in job.status().domains} == {"toy.copy": "copying", "toy.next": "rest",
                                                                   "toy.add": "rest"}
    shared = Job(spec(adapters={}), lambda *a, **k: None, lambda g: None, lambda: 0)
    assert [d.adapter for d in shared.status().domains] == ["", ""]  # one shared policy


def test_the_evaluation_answers_each_domain_with_its_adapter():
    s = spec()
    sets = EvalSets(["toy.copy", "toy.next", "toy.add"], 2, 7, {})  # toy.add: eval-only, in no adapter
    asked = []

    def answer(prompts, max_tokens, n, temperature, seed, adapters=None):
        asked.append(list(adapters))
        return inference_pb2.GenerateResponse(policy_version=0, results=[inference_pb2.PromptResult(
            prompt_token_ids=[1], completions=[inference_pb2.Completion(text="x", token_ids=[1], logprobs=[-0.1])])
            for _ in prompts])

    def score(group):
        for t in group.trajectories:
            t.reward.status, t.reward.total = common_pb2.REWARD_STATUS_OK, 0.0
        return group

    evaluate(sets, answer, score, 2, "before", adapters={d: s.adapter_of(d) for d in sets.sets})
    assert asked == [["copying"] * 2 + ["counting"] * 2 + [""] * 2]


def test_the_launcher_gives_the_adapter_names_to_learner_and_inference(tmp_path):
    launcher = Launcher(home=tmp_path / "home")
    cfg = {"job": {"adapters": ADAPTERS}, "learner": {"lora_rank": 4}}
    for name, flag in (("learner", "--lora-adapters"), ("inference", "--lora-adapters")):
        args = launcher.service_flags(name, cfg, None, {}, "")
        assert args[args.index(flag) + 1] == "copying,counting"
    assert "--lora-adapters" not in launcher.service_flags("learner", {"job": {}}, None, {}, "")
    from temper.inference.config import InferenceConfig
    from temper.learner.config import LearnerConfig
    from temper.runtime.config import load_config

    assert load_config(LearnerConfig, ["--lora-adapters", "copying,counting", "--lora-rank", "4"]).lora_adapters == [
        "copying", "counting"]
    assert load_config(InferenceConfig, ["--lora-adapters", "copying,counting"]).lora_adapters == [
        "copying", "counting"]


@pytest.mark.parametrize("cfg, field", [
    ({"job": {"adapters": ADAPTERS}}, "learner.lora_rank"),
    ({"job": {"adapters": ADAPTERS}, "learner": {"lora_rank": 32}}, "inference.max_lora_rank"),
])
def test_a_job_with_adapters_and_no_way_to_train_or_serve_them_is_refused_before_start(tmp_path, cfg, field):
    with pytest.raises(InvalidArgument) as e:
        check_service_tables(cfg, tmp_path)
    assert e.value.field == field
    check_service_tables({"job": {"adapters": ADAPTERS}, "learner": {"lora_rank": 8}}, tmp_path)
