"""The sampling policy on scripted reward streams: curriculum, difficulty filter, adaptive weights with a
floor, dynamic sampling in a job's step, bad [job.sampling] tables refused naming the field."""

import json
import random

import pytest

from temper.runtime.errors import InvalidArgument
from temper.scheduler.core import Job, JobSpec
from temper.scheduler.sampling import SamplingConfig, SamplingPolicy
from temper.scheduler.servicer import SchedulerServicer
from temper.v1 import common_pb2, inference_pb2, scheduler_pb2

LADDER = [{"min_terms": 2, "max_terms": 2}, {"min_terms": 2, "max_terms": 3}, {"min_terms": 2, "max_terms": 4}]


def policy(domains, **sampling):
    config = SamplingConfig.from_dict(sampling)
    config.validate(domains, {})
    return SamplingPolicy(config, domains)


def feed(p, domain, pass_fraction, groups, size=8, level=None):
    """``groups`` scored groups of ``domain`` in which ``pass_fraction`` of the trajectories pass."""
    passed = round(pass_fraction * size)
    for _ in range(groups):
        lvl = p.stats[domain].level if level is None else level
        p.observe(domain, lvl, f"{domain} prompt {random.random()}", [1.0] * passed + [0.0] * (size - passed))


def test_curriculum_raises_a_domain_that_becomes_easy_and_not_one_that_stays_hard():
    p = policy(["rg.chain_sum", "rg.basic_arithmetic"],
               curriculum={"window": 4, "raise_above": 0.8, "lower_below": 0.2,
                           "ladders": {"rg.chain_sum": LADDER, "rg.basic_arithmetic": LADDER}})
    feed(p, "rg.chain_sum", 0.5, 8)  # learning, not yet easy
    feed(p, "rg.basic_arithmetic", 0.5, 8)
    assert p.stats["rg.chain_sum"].level == 0 and p.stats["rg.basic_arithmetic"].level == 0
    feed(p, "rg.chain_sum", 1.0, 4)  # it became easy
    feed(p, "rg.basic_arithmetic", 0.5, 4)
    assert p.stats["rg.chain_sum"].level == 1
    assert p.stats["rg.basic_arithmetic"].level == 0
    assert p.options("rg.chain_sum") == LADDER[1]
    domain, level, options = p.draw(random.Random(0))
    assert level in (0, 1) and options == LADDER[level]
    feed(p, "rg.chain_sum", 1.0, 100)  # stays easy: climbs to the top and stops there
    assert p.stats["rg.chain_sum"].level == len(LADDER) - 1
    view = {d["domain"]: d for d in p.domain_view()}
    assert view["rg.chain_sum"]["difficulty"] == 2 and view["rg.chain_sum"]["max_difficulty"] == 2
    assert view["rg.basic_arithmetic"]["difficulty"] == 0 and view["rg.basic_arithmetic"]["level_changes"] == 0


def test_curriculum_lowers_a_level_that_collapses_and_ignores_groups_of_an_older_level():
    p = policy(["rg.chain_sum"], curriculum={"window": 4, "start_level": 2, "ladders": {"rg.chain_sum": LADDER}})
    assert p.stats["rg.chain_sum"].level == 2
    feed(p, "rg.chain_sum", 0.0, 4)
    assert p.stats["rg.chain_sum"].level == 1
    feed(p, "rg.chain_sum", 1.0, 10, level=2)  # in flight when the level moved: counted, not for level 1
    assert p.stats["rg.chain_sum"].level == 1
    assert p.stats["rg.chain_sum"].groups == 14


def test_curriculum_uses_reasoning_gyms_own_ladder():
    p = policy(["rg.chain_sum"], curriculum={"window": 2})
    ladder = p.ladders["rg.chain_sum"]
    assert len(ladder) > 2 and ladder[0]["max_terms"] < ladder[-1]["max_terms"]
    feed(p, "rg.chain_sum", 1.0, 2)
    assert p.options("rg.chain_sum") == ladder[1]


def test_difficulty_filter_moves_weight_off_a_domain_outside_the_band_and_refuses_solved_prompts():
    p = policy(["toy.copy", "toy.next", "toy.add"], difficulty_filter={"low": 0.1, "high": 0.9, "window": 4,
                                                                      "outside_weight": 0.1})
    assert p.probabilities()["toy.copy"] == pytest.approx(1 / 3)
    feed(p, "toy.copy", 1.0, 4)  # solved
    feed(p, "toy.next", 0.5, 4)  # in the band
    feed(p, "toy.add", 0.0, 3)  # hopeless, but not measured over a full window yet
    probs = p.probabilities()
    assert probs["toy.copy"] == pytest.approx(0.1 / 2.1)
    assert probs["toy.next"] == probs["toy.add"] == pytest.approx(1 / 2.1)
    feed(p, "toy.add", 0.0, 1)
    assert p.probabilities()["toy.add"] == pytest.approx(p.probabilities()["toy.copy"])
    # prompt level: a prompt every sample of which passed is refused (and counted), one in the band kept
    p.observe("toy.next", 0, "next 1 2 3", [1.0] * 8)
    p.observe("toy.next", 0, "next 4 5 6", [1.0] * 4 + [0.0] * 4)
    assert not p.keep_prompt("toy.next", "next 1 2 3")
    assert p.keep_prompt("toy.next", "next 4 5 6")
    assert p.keep_prompt("toy.next", "next 7 8 9")  # never seen
    assert p.stats["toy.next"].filtered_prompts == 1


def test_difficulty_filter_never_excludes_every_domain():
    p = policy(["toy.copy", "toy.next"], difficulty_filter={"window": 2, "outside_weight": 0.0})
    feed(p, "toy.copy", 1.0, 2)
    feed(p, "toy.next", 0.0, 2)
    assert p.probabilities() == {"toy.copy": 0.5, "toy.next": 0.5}


def rising(p, domain, groups, start=0.0, slope=0.0, size=10):
    for i in range(groups):
        frac = min(1.0, max(0.0, start + slope * i))
        feed(p, domain, frac, 1, size=size)


def test_adaptive_weights_follow_learning_progress_and_respect_the_floor():
    domains = ["toy.copy", "toy.next", "toy.add"]
    p = policy(domains, adaptive={"window": 8, "floor": 0.1})
    assert all(v == pytest.approx(1 / 3) for v in p.probabilities().values())
    rising(p, "toy.copy", 8, start=0.1, slope=0.1)  # learning fast
    rising(p, "toy.next", 8, start=0.5, slope=0.0)  # flat: no progress
    rising(p, "toy.add", 8, start=0.2, slope=0.025)  # learning slowly
    probs = p.probabilities()
    assert probs["toy.copy"] > probs["toy.add"] > probs["toy.next"]
    assert probs["toy.next"] == pytest.approx(0.1)  # no progress: exactly the floor, never less
    assert sum(probs.values()) == pytest.approx(1.0)
    # the fast domain saturates (progress 0) while the slow one keeps learning: weight moves over
    rising(p, "toy.copy", 8, start=1.0)
    rising(p, "toy.add", 8, start=0.4, slope=0.025)
    later = p.probabilities()
    assert later["toy.add"] > later["toy.copy"] and later["toy.copy"] == pytest.approx(0.1)
    assert min(later.values()) >= 0.1 - 1e-12


def test_learnability_weights_favour_domains_whose_groups_disagree():
    """signal = "learnability": a domain always failed (or always solved) carries no GRPO signal and drops
    to the floor; one whose groups split half and half gets the most."""
    domains = ["toy.copy", "toy.next", "toy.add"]
    p = policy(domains, adaptive={"window": 4, "floor": 0.1, "signal": "learnability"})
    feed(p, "toy.copy", 0.5, 4)  # 4 of 8 pass: spread 0.5
    feed(p, "toy.next", 0.0, 4)  # never: 0
    feed(p, "toy.add", 0.125, 4)  # 1 of 8: sqrt(1/8 * 7/8) = 0.33
    assert p.learning_progress("toy.copy") == pytest.approx(0.5)
    assert p.learning_progress("toy.add") == pytest.approx((7 / 64) ** 0.5)
    probs = p.probabilities()
    assert probs["toy.copy"] > probs["toy.add"] > probs["toy.next"] == pytest.approx(0.1)
    assert sum(probs.values()) == pytest.approx(1.0)
    feed(p, "toy.copy", 1.0, 4)  # solved every time now: no signal left
    later = p.probabilities()
    assert later["toy.copy"] == pytest.approx(0.1) and later["toy.add"] == pytest.approx(0.8)


def test_learnability_explores_an_unmeasured_domain_and_round_trips():
    kw = {"adaptive": {"window": 1, "floor": 0.0, "signal": "learnability"}}  # one group is enough to measure
    p = policy(["toy.copy", "toy.next"], **kw)
    feed(p, "toy.copy", 0.25, 1)
    assert p.probabilities()["toy.next"] == pytest.approx(0.5)  # not measured: the best signal of the others
    q = policy(["toy.copy", "toy.next"], **kw)
    q.load_state(json.loads(json.dumps(p.state())))
    assert q.probabilities() == p.probabilities() and q.domain_view() == p.domain_view()


def test_adaptive_weights_multiply_fixed_weights_and_a_new_domain_is_explored():
    p = policy(["toy.copy", "toy.next"], weights={"toy.copy": 3.0}, adaptive={"window": 4, "floor": 0.0})
    assert p.probabilities()["toy.copy"] == pytest.approx(0.75)
    rising(p, "toy.copy", 4, start=0.0, slope=0.25)
    # toy.next is not measured yet: it gets toy.copy's progress, so the fixed weights decide
    assert p.probabilities()["toy.copy"] == pytest.approx(0.75)


def test_state_round_trips():
    domains = ["toy.copy", "rg.chain_sum"]
    kw = {"curriculum": {"window": 2, "domains": ["rg.chain_sum"]}, "adaptive": {"window": 4},
          "difficulty_filter": {"window": 2}}
    p = policy(domains, **kw)
    feed(p, "rg.chain_sum", 1.0, 5)
    rising(p, "toy.copy", 6, slope=0.1)
    p.observe("toy.copy", 0, "copy 1 2 3", [1.0] * 8)
    q = policy(domains, **kw)
    q.load_state(json.loads(json.dumps(p.state())))
    assert q.domain_view() == p.domain_view()
    assert not q.keep_prompt("toy.copy", "copy 1 2 3")


def test_repeated_prompts_are_counted_per_domain_remembered_and_round_trip(monkeypatch):
    from temper.scheduler import sampling

    p = policy(["toy.copy", "toy.next"])
    assert [p.note_drawn("toy.copy", x) for x in ("copy 1 2 3", "copy 4 5 6", "copy 1 2 3", "copy 1 2 3")] == \
        [False, False, True, True]
    assert not p.note_drawn("toy.next", "next 1 2 3")
    assert p.note_drawn("toy.next", "copy 4 5 6")  # a prompt is a prompt, whichever domain drew it first
    assert p.stats["toy.copy"].repeated_prompts == 2 and p.stats["toy.next"].repeated_prompts == 1
    view = {d["domain"]: d for d in p.domain_view()}
    assert view["toy.copy"]["repeated_prompts"] == 2
    q = policy(["toy.copy", "toy.next"])
    q.load_state(json.loads(json.dumps(p.state())))
    assert q.domain_view() == p.domain_view()
    assert q.note_drawn("toy.next", "next 1 2 3") and not q.note_drawn("toy.next", "next 7 7 7")
    # the memory keeps the most recently drawn prompts: the least recent is forgotten first
    monkeypatch.setattr(sampling, "DRAWN_MEMORY", 2)
    r = policy(["toy.copy"])
    for x in ("copy 1 1 1", "copy 2 2 2", "copy 1 1 1", "copy 3 3 3"):  # 2 2 2 is now the least recent
        r.note_drawn("toy.copy", x)
    assert r.note_drawn("toy.copy", "copy 1 1 1") and not r.note_drawn("toy.copy", "copy 2 2 2")


@pytest.mark.parametrize("drawn", ["not base64!", "AAAA", 7])
def test_a_saved_state_with_bad_drawn_prompts_is_refused_naming_the_field(drawn):
    with pytest.raises(InvalidArgument) as e:
        policy(["toy.copy"]).load_state({"drawn": drawn})
    assert e.value.field == "state.drawn"


def test_a_job_counts_the_training_prompts_it_draws_again_and_warns_once(monkeypatch):
    from structlog.testing import capture_logs

    from temper.scheduler import core

    monkeypatch.setattr(core, "REPEAT_WARN_MIN_DRAWS", 8)
    monkeypatch.setattr(core, "REPEAT_WARN_SHARE", 0.01)  # the first repeat after 8 draws
    # one-digit products of two terms: 100 distinct problems, so 40 draws repeat some
    spec = JobSpec(job_id="rep", steps=5, prompts_per_step=8, group_size=2, domains=["rg.products"],
                   domain_config={"rg.products": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}})
    job, published = scripted_job(spec, lambda task, k: k == 0)
    with capture_logs() as logs:
        for step in range(5):
            job.run_step(step)
    distinct = len({g.task.prompt for g in published})
    (d,) = job.status().domains
    assert d.drawn == len(published) == 40 and d.repeated_prompts == 40 - distinct > 0
    warned = [e for e in logs if e["event"] == "training prompts repeat"]
    assert len(warned) == 1 and warned[0]["domain"] == "rg.products" and warned[0]["drawn"] >= 8


@pytest.mark.parametrize("sampling, field", [
    ({"weights": {"toy.copy": -1.0}}, "sampling.weights[toy.copy]"),
    ({"weights": {"toy.copy": 0.0}}, "sampling.weights[toy.copy]"),
    ({"weights": {"toy.copy": float("inf")}}, "sampling.weights[toy.copy]"),
    ({"weights": {"toy.nope": 1.0}}, "sampling.weights[toy.nope]"),
    ({"weights": {"toy.copy": "a lot"}}, "sampling.weights[toy.copy]"),
    ({"weigths": {}}, "sampling.weigths"),
    ({"curriculum": {"raise_above": 0.2, "lower_below": 0.5}}, "sampling.curriculum.raise_above"),
    ({"curriculum": {"window": 0}}, "sampling.curriculum.window"),
    ({"curriculum": {"windo": 3}}, "sampling.curriculum.windo"),
    ({"curriculum": {"domains": ["toy.copy"]}}, "sampling.curriculum.domains"),  # toy has no ladder
    ({"curriculum": {"ladders": {"rg.chain_sum": [{"max_terms": 2}]}}}, "sampling.curriculum.ladders[rg.chain_sum]"),
    ({"curriculum": {"ladders": {"rg.chain_sum": [{"min_terms": 2}, {"max_termz": 3}]}}},
     "sampling.curriculum.ladders[rg.chain_sum][1].max_termz"),
    ({"adaptive": {"floor": 0.6}}, "sampling.adaptive.floor"),
    ({"adaptive": {"window": 1.5}}, "sampling.adaptive.window"),
    ({"adaptive": {"window": 1}}, "sampling.adaptive.window"),  # progress compares two halves
    ({"adaptive": {"signal": "vibes"}}, "sampling.adaptive.signal"),
    ({"adaptive": {"signal": 1}}, "sampling.adaptive.signal"),
    ({"difficulty_filter": {"low": 0.9, "high": 0.1}}, "sampling.difficulty_filter.low"),
    ({"dynamic_sampling": {"max_refill_ratio": -1}}, "sampling.dynamic_sampling.max_refill_ratio"),
])
def test_bad_sampling_tables_are_refused_naming_the_field(sampling, field):
    with pytest.raises(InvalidArgument) as e:
        JobSpec.from_dict({"domains": ["toy.copy", "rg.chain_sum"], "sampling": sampling}).validate()
    assert e.value.field == field, e.value


def test_a_knob_set_by_both_domain_config_and_the_curriculum_is_refused():
    with pytest.raises(InvalidArgument) as e:
        JobSpec.from_dict({"domains": ["rg.chain_sum"], "domain_config": {"rg.chain_sum": {"max_terms": 3}},
                           "sampling": {"curriculum": {}}}).validate()
    assert e.value.field == "domain_config[rg.chain_sum].max_terms"


def test_start_job_refuses_a_bad_sampling_table_naming_the_field():
    servicer = SchedulerServicer(lambda spec, resumed: pytest.fail("no job may start"))
    bad = JobSpec(domains=["toy.copy"], sampling={"weights": {"toy.copy": -2}}).to_proto()
    with pytest.raises(InvalidArgument) as e:
        servicer.StartJob(scheduler_pb2.StartJobRequest(spec=bad), None)
    assert e.value.field == "spec.sampling.weights[toy.copy]"
    not_json = scheduler_pb2.JobSpec(domains=["toy.copy"], sampling="{weights")
    with pytest.raises(InvalidArgument) as e:
        servicer.StartJob(scheduler_pb2.StartJobRequest(spec=not_json), None)
    assert e.value.field == "spec.sampling"


def scripted_job(spec, solved):
    """A Job whose generate answers every prompt with group_size completions and whose score marks a
    trajectory right when ``solved(task, k)``; returns (job, published groups)."""
    published = []

    def generate(prompts, s, seed):
        return inference_pb2.GenerateResponse(policy_version=0, results=[inference_pb2.PromptResult(
            prompt_token_ids=[1], completions=[inference_pb2.Completion(text="x", token_ids=[1], logprobs=[-0.1])
                                               for _ in range(s.group_size)]) for _ in prompts])

    def score(group):
        out = common_pb2.RolloutGroup()
        out.CopyFrom(group)
        for k, t in enumerate(out.trajectories):
            t.reward.status = common_pb2.REWARD_STATUS_OK
            t.reward.total = 1.0 if solved(group.task, k) else 0.0
        return out

    return Job(spec, generate, published.append, lambda: 0, score=score), published


def test_dynamic_sampling_publishes_only_groups_with_a_signal_and_counts_the_rest():
    # toy.copy: every sample right (no signal); toy.next: half right
    spec = JobSpec(job_id="ds", steps=1, prompts_per_step=4, group_size=4, domains=["toy.copy", "toy.next"],
                   sampling={"weights": {"toy.copy": 3.0}, "dynamic_sampling": {"max_refill_ratio": 10.0}})
    job, published = scripted_job(spec, lambda task, k: task.domain == "toy.copy" or k % 2 == 0)
    job.run_step(0)
    assert len(published) == 4 and {g.task.domain for g in published} == {"toy.next"}
    assert all(g.step_groups == 4 for g in published)
    assert not any(t.HasField("reward") for g in published for t in g.trajectories)  # the stream scores them
    status = job.status()
    dropped = status.zero_variance_groups_dropped
    assert dropped >= 1 and status.refill_groups == dropped and status.unfilled_groups == 0
    view = {d.domain: d for d in status.domains}
    assert view["toy.copy"].zero_variance_groups == dropped == view["toy.copy"].groups == view["toy.copy"].drawn
    assert view["toy.next"].groups == 4 and view["toy.next"].pass_rate == 0.5
    assert status.groups_scored == 4 + dropped
    assert len({g.group_id for g in published}) == 4


def test_dynamic_sampling_fills_the_step_when_the_refill_budget_runs_out():
    spec = JobSpec(job_id="ds2", steps=1, prompts_per_step=4, group_size=4, domains=["toy.copy"],
                   sampling={"dynamic_sampling": {"max_refill_ratio": 0.5}})
    job, published = scripted_job(spec, lambda task, k: False)  # nothing ever solved
    job.run_step(0)
    status = job.status()
    assert len(published) == 4  # the learner still gets its step: the job never stalls
    assert status.refill_groups == 2 and status.unfilled_groups == 4 and status.zero_variance_groups_dropped == 2
    assert status.groups_scored == 6


def test_dynamic_sampling_needs_a_reward_service():
    spec = JobSpec(job_id="ds3", domains=["toy.copy"], sampling={"dynamic_sampling": {}})
    with pytest.raises(InvalidArgument) as e:
        Job(spec, None, None, lambda: 0)
    assert e.value.field == "sampling.dynamic_sampling"


def test_a_job_draws_at_its_curriculum_level_and_learns_from_the_scored_stream():
    spec = JobSpec(job_id="cur", steps=1, prompts_per_step=8, group_size=4, domains=["rg.chain_sum"],
                   sampling={"curriculum": {"window": 8}})
    job, published = scripted_job(spec, lambda task, k: True)
    job.run_step(0)
    assert {g.task.metadata["temper.difficulty"] for g in published} == {"0"}
    assert all(json.loads(g.task.metadata["rg.config"])["max_terms"] == 2 for g in published)
    for g in published:  # as the `scored` stream delivers them
        scored = common_pb2.RolloutGroup()
        scored.CopyFrom(g)
        for t in scored.trajectories:
            t.reward.status, t.reward.total = common_pb2.REWARD_STATUS_OK, 1.0
        job.observe_scored(scored)
    job.run_step(1)
    assert {g.task.metadata["temper.difficulty"] for g in published[8:]} == {"1"}
    assert all(json.loads(g.task.metadata["rg.config"])["max_terms"] == 3 for g in published[8:])
    (d,) = job.status().domains
    assert d.difficulty == 1 and d.groups == 8 and json.loads(d.difficulty_options)["max_terms"] == 3


def test_loss_weights_give_a_lagging_domain_more_gradient_within_bounds():
    p = policy(["toy.copy", "toy.next", "toy.add"],
               loss_weighting={"weights": {"toy.add": 2.0}, "lagging": 2.0, "min_weight": 0.5, "max_weight": 3.0})
    assert p.loss_weight("toy.copy") == 1.0 and p.loss_weight("toy.add") == 2.0  # nothing measured yet
    feed(p, "toy.copy", 1.0, 4)  # ahead
    feed(p, "toy.next", 0.25, 4)  # lagging
    # mean pass rate 0.625: copy 1 + 2 * (0.625 - 1) = 0.25 -> min 0.5; next 1 + 2 * 0.375 = 1.75
    assert p.loss_weight("toy.copy") == 0.5
    assert p.loss_weight("toy.next") == pytest.approx(1.75)
    assert p.loss_weight("toy.add") == 2.0  # not measured: its fixed weight
    feed(p, "toy.add", 0.0, 4)
    assert p.loss_weight("toy.add") == 3.0  # 2 * (1 + 2 * 0.4167) = 3.67 -> max 3


def test_published_groups_carry_their_domains_loss_weight():
    spec = JobSpec(job_id="lw", steps=1, prompts_per_step=6, group_size=2, domains=["toy.copy", "toy.next"],
                   sampling={"loss_weighting": {"weights": {"toy.next": 1.5}}})
    job, published = scripted_job(spec, lambda task, k: False)
    job.run_step(0)
    assert {(g.task.domain, g.loss_weight) for g in published} <= {("toy.copy", 1.0), ("toy.next", 1.5)}
    assert {d.domain: d.loss_weight for d in job.status().domains} == {"toy.copy": 1.0, "toy.next": 1.5}


@pytest.mark.parametrize("table, field", [
    ({"weights": {"toy.copy": 0}}, "sampling.loss_weighting.weights[toy.copy]"),
    ({"weights": {"toy.zzz": 1}}, "sampling.loss_weighting.weights[toy.zzz]"),
    ({"lagging": -1.0}, "sampling.loss_weighting.lagging"),
    ({"min_weight": 2.0}, "sampling.loss_weighting.min_weight"),
])
def test_bad_loss_weighting_is_refused_naming_the_field(table, field):
    with pytest.raises(InvalidArgument) as e:
        JobSpec.from_dict({"domains": ["toy.copy"], "sampling": {"loss_weighting": table}}).validate()
    assert e.value.field == field


def test_a_jobs_sampling_state_round_trips_through_json():
    spec = JobSpec(job_id="st", steps=1, prompts_per_step=4, group_size=4, domains=["toy.copy", "toy.next"],
                   sampling={"adaptive": {"window": 2}, "dynamic_sampling": {"max_refill_ratio": 1.0}})
    job, _ = scripted_job(spec, lambda task, k: k == 0)
    job.run_step(0)
    again, _ = scripted_job(spec, lambda task, k: k == 0)
    again.load_sampling_state(json.loads(json.dumps(job.sampling_state())))
    assert again.status().domains == job.status().domains
    assert again.groups_scored == job.groups_scored == 4


def rm_scored(group: common_pb2.RolloutGroup, rm_agrees: bool | None, with_verifier: bool = True
              ) -> common_pb2.RolloutGroup:
    """``group`` as the `scored` stream delivers it: trajectory k right (exact_answer 1) when k is even; an
    ``rm`` score of 0.9 for a right one and 0.1 for a wrong one where ``rm_agrees`` (the reverse where not;
    no rm component where None)."""
    out = common_pb2.RolloutGroup()
    out.CopyFrom(group)
    ok = common_pb2.REWARD_STATUS_OK
    for k, t in enumerate(out.trajectories):
        right = float(k % 2 == 0)
        t.reward.status, t.reward.total = ok, right
        if with_verifier:
            t.reward.components.add(name="exact_answer", value=right, weight=1.0, status=ok)
        t.reward.components.add(name="format.boxed", value=1.0, status=ok)  # not a verifier of the answer
        if rm_agrees is not None:
            t.reward.components.add(name="rm", value=(0.9 if right else 0.1) if rm_agrees else (0.1 if right else 0.9),
                                    weight=0.5, status=ok)
    return out


def test_group_rm_confidence_is_agreement_with_the_verifier_else_the_score_margin():
    from temper.scheduler.sampling import group_rm_confidence

    group = common_pb2.RolloutGroup(group_id="g", trajectories=[common_pb2.Trajectory() for _ in range(4)])
    assert group_rm_confidence(rm_scored(group, True).trajectories) == pytest.approx(0.9)  # 1 - |0.9 - 1|, ...
    assert group_rm_confidence(rm_scored(group, False).trajectories) == pytest.approx(0.1)
    assert group_rm_confidence(rm_scored(group, None).trajectories) is None  # no RM: no confidence
    # no verifier: the margin |2 rm - 1| of scores 0.9 / 0.1, whichever way round
    assert group_rm_confidence(rm_scored(group, False, with_verifier=False).trajectories) == pytest.approx(0.8)
    undecided = rm_scored(group, True, with_verifier=False)
    for t in undecided.trajectories:
        t.reward.components[-1].value = 0.5
    assert group_rm_confidence(undecided.trajectories) == 0.0
    failed = rm_scored(group, True)
    for t in failed.trajectories:
        t.reward.components[-1].status = common_pb2.REWARD_STATUS_ERROR  # an RM that failed says nothing
    assert group_rm_confidence(failed.trajectories) is None


def test_rm_confidence_shifts_weight_and_loss_weight_away_from_a_domain_whose_rm_disagrees():
    spec = JobSpec(job_id="rmc", steps=2, prompts_per_step=12, group_size=4,
                   domains=["toy.copy", "toy.next", "toy.add"], sampling={"rm_confidence": {"window": 4}})
    job, published = scripted_job(spec, lambda task, k: False)
    job.run_step(0)
    assert {g.loss_weight for g in published} == {1.0}  # nothing measured yet: factor 1
    agrees = {"toy.copy": True, "toy.next": False, "toy.add": None}  # toy.add: no reward model
    for g in published:
        job.observe_scored(rm_scored(g, agrees[g.task.domain]))
    view = {d.domain: d for d in job.status().domains}
    assert set(view) == set(agrees) and all(view[d].groups > 0 for d in view)  # the seeded draws hit all three
    assert view["toy.copy"].rm_confidence == pytest.approx(0.9)
    assert view["toy.next"].rm_confidence == pytest.approx(0.1)
    assert view["toy.add"].rm_confidence == -1.0
    # factors: min_factor 0.1 + 0.9 * confidence; a domain without RM keeps 1
    factors = {"toy.copy": 0.1 + 0.9 * 0.9, "toy.next": 0.1 + 0.9 * 0.1, "toy.add": 1.0}
    total = sum(factors.values())
    for d, f in factors.items():
        assert view[d].weight == pytest.approx(f / total)
        assert view[d].loss_weight == pytest.approx(f)
    assert view["toy.next"].weight < view["toy.copy"].weight < view["toy.add"].weight
    before = len(published)
    job.run_step(1)
    assert {(g.task.domain, round(g.loss_weight, 6)) for g in published[before:]} <= {
        (d, round(f, 6)) for d, f in factors.items()}
    # the learned confidences are part of the job's state
    again, _ = scripted_job(spec, lambda task, k: False)
    again.load_sampling_state(json.loads(json.dumps(job.sampling_state())))
    assert again.status().domains == job.status().domains


def test_rm_confidence_multiplies_the_loss_weighting():
    p = policy(["toy.copy", "toy.next"], rm_confidence={"window": 2, "min_factor": 0.5},
               loss_weighting={"weights": {"toy.copy": 2.0}})
    p.observe("toy.copy", 0, "a", [1.0, 0.0], rm_confidence=0.0)
    assert p.loss_weight("toy.copy") == pytest.approx(2.0 * 0.5) and p.loss_weight("toy.next") == 1.0
    p.observe("toy.copy", 0, "b", [1.0, 0.0], rm_confidence=1.0)
    assert p.rm_confidence("toy.copy") == 0.5 and p.loss_weight("toy.copy") == pytest.approx(2.0 * 0.75)


@pytest.mark.parametrize("table, field", [
    ({"window": 0}, "sampling.rm_confidence.window"),
    ({"min_factor": 0.0}, "sampling.rm_confidence.min_factor"),
    ({"min_factor": 1.5}, "sampling.rm_confidence.min_factor"),
    ({"min_factor": "high"}, "sampling.rm_confidence.min_factor"),
    ({"margin": 1}, "sampling.rm_confidence.margin"),
])
def test_bad_rm_confidence_is_refused_naming_the_field(table, field):
    with pytest.raises(InvalidArgument) as e:
        JobSpec.from_dict({"domains": ["toy.copy"], "sampling": {"rm_confidence": table}}).validate()
    assert e.value.field == field
