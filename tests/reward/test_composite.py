"""Composite rewards: the arithmetic of weights, step aggregation, length penalties and safety terms."""

from __future__ import annotations

import pytest

from temper.reward.composite import aggregate_steps, compose, length_penalty
from temper.reward.core import Scorer
from temper.reward.models import RewardModelEngine, build_tiny_reward_model, split_steps
from temper.reward.settings import DomainSpec, LengthPenalty, RewardSettings
from temper.reward.verifiers import Check
from temper.runtime.errors import FailedPrecondition
from temper.v1 import common_pb2
from tests.builders import rollout_group
from tests.reward.conftest import component

OK, ERROR = common_pb2.REWARD_STATUS_OK, common_pb2.REWARD_STATUS_ERROR


def test_pure_arithmetic():
    assert aggregate_steps([0.9, 0.2, 0.7], "min") == 0.2
    assert aggregate_steps([0.9, 0.2, 0.7], "mean") == pytest.approx(0.6)
    assert aggregate_steps([0.9, 0.2, 0.7], "last") == 0.7
    with pytest.raises(ValueError):
        aggregate_steps([], "min")
    spec = LengthPenalty(max_tokens=10, buffer_tokens=4)
    assert [length_penalty(n, spec) for n in (0, 6, 7, 8, 10, 11, 100)] == [0, 0, -0.25, -0.5, -1.0, -1.0, -1.0]
    with pytest.raises(ValueError):
        LengthPenalty(max_tokens=4, buffer_tokens=5)
    r = compose([Check("a", 1.0), Check("b", 0.5), Check("c", error="down"), Check("d", 0.3)],
                {"a": 2.0, "b": -1.0, "c": 0.0, "d": 0.0})
    assert r.total == pytest.approx(2.0 - 0.5) and r.status == OK  # c failed but weighs 0
    assert [(c.name, c.weight, c.status) for c in r.components] == [("a", 2.0, OK), ("b", -1.0, OK), ("c", 0.0, ERROR),
                                                                   ("d", 0.0, OK)]
    r = compose([Check("a", 1.0), Check("c", error="down")], {"a": 1.0, "c": 0.5})
    assert r.status == ERROR and r.total == 1.0 and r.components[1].error == "down" and r.components[1].value == 0


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("composite")
    rm = RewardModelEngine(build_tiny_reward_model(d / "rm", seed=4), max_wait_ms=2)
    prm = RewardModelEngine(build_tiny_reward_model(d / "prm", seed=5), max_wait_ms=2)
    yield rm, prm
    rm.close()
    prm.close()


WEIGHTS = {"exact_answer": 1.0, "rm": 0.5, "prm": 0.25, "length_penalty": 1.0, "safety": 2.0}


def scorer_with(models, how="min", **kw) -> Scorer:
    rm, prm = models
    domains = {"toy": DomainSpec(weights=WEIGHTS, prm_aggregation=how,
                                 length_penalty=LengthPenalty(max_tokens=4, buffer_tokens=2))}
    return Scorer(RewardSettings(domains=domains, **kw), rm=rm, prm=prm)


@pytest.mark.parametrize("how", ["min", "mean", "last"])
def test_weighted_total_of_every_component(models, how):
    rm, prm = models
    scorer = scorer_with(models, how)
    texts = ["4", "4\n\n4 + 1 = 5", "5\n\n5\n\n5", "I can't help with that."]
    scored = scorer.score_group(rollout_group("toy.copy", "4", texts, prompt="copy 1 2 4", tokens=[1, 3, 4, 6]))
    expect_len = [0.0, -0.5, -1.0, -1.0]
    for text, traj, pen in zip(texts, scored.trajectories, expect_len):
        r = traj.reward
        assert r.status == OK
        values = {c.name: c.value for c in r.components}
        assert list(values) == ["exact_answer", "rm", "prm", "length_penalty", "safety"]
        assert values["exact_answer"] == (1.0 if text.split()[0] == "4" else 0.0)
        assert values["rm"] == pytest.approx(rm.score("copy 1 2 4", text), abs=1e-5)
        steps = prm.score_steps("copy 1 2 4", split_steps(text, "\n\n"))
        assert list(r.step_rewards) == pytest.approx(steps, abs=1e-5)
        assert len(r.step_rewards) == len(split_steps(text, "\n\n"))
        assert values["prm"] == pytest.approx(aggregate_steps(list(r.step_rewards), how))
        assert values["length_penalty"] == pen
        assert values["safety"] == (0.0 if text.startswith("I can't") else 1.0)
        assert r.total == pytest.approx(sum(WEIGHTS[k] * v for k, v in values.items()))
        assert {c.name: c.weight for c in r.components} == WEIGHTS


def test_safety_on_flagged_prompts(models):
    scorer = scorer_with(models)
    g = rollout_group("toy.copy", "", ["I'm sorry, but I can't help with that.", "4", "I must decline."],
                      prompt="copy 1 2 4", metadata={"safety": "refuse"}, tokens=[1, 1, 1])
    scored = scorer.score_group(g)  # no reference needed: the target is the refusal
    for traj, refused in zip(scored.trajectories, [True, False, True]):
        names = [c.name for c in traj.reward.components]
        assert "exact_answer" not in names
        assert component(traj, "safety").value == (1.0 if refused else 0.0)
        assert "flagged" in component(traj, "safety").detail


def test_flagged_prompt_in_a_domain_without_a_safety_weight(scorer):
    scored = scorer.score_group(rollout_group("math", "", ["I must decline.", "\\boxed{1}"], metadata={"safety": "true"}))
    assert [[c.name for c in t.reward.components] for t in scored.trajectories] == [["format.boxed", "safety"]] * 2
    assert [t.reward.total for t in scored.trajectories] == [1.0, 0.0]


def test_component_errors_are_explicit(models):
    scorer = scorer_with(models, prm_max_steps=2)
    # no token ids: the length penalty cannot be computed; 3 steps > prm_max_steps; empty: no steps, which the
    # PRM scores 0 (the policy wrote nothing right: a reward, not an error that would refuse its whole group)
    scored = scorer.score_group(rollout_group("toy.copy", "4", ["4", "4\n\n4\n\n4", ""], prompt="copy 1 2 4"))
    for traj in scored.trajectories:
        assert traj.reward.status == ERROR
        lp = component(traj, "length_penalty")
        assert lp.status == ERROR and lp.error == "trajectory has no completion_token_ids" and lp.value == 0
    assert component(scored.trajectories[1], "prm").error == "malformed steps: 3 steps > prm_max_steps 2"
    empty = component(scored.trajectories[2], "prm")
    assert (empty.status, empty.value, empty.error, empty.detail) == (OK, 0.0, "", "no steps (empty completion): 0")
    assert list(scored.trajectories[2].reward.step_rewards) == []
    # OK components still add up, the failed ones count nothing
    t0 = scored.trajectories[0].reward
    assert t0.total == pytest.approx(sum(c.weight * c.value for c in t0.components if c.status == OK))


def test_step_delimiter_is_configurable(models):
    scorer = scorer_with(models, prm_step_delimiter=" = ")
    scored = scorer.score_group(rollout_group("toy.copy", "4", ["1 + 3 = 4 = 4"], prompt="copy 1 2 4", tokens=[1]))
    assert len(scored.trajectories[0].reward.step_rewards) == 3


def test_models_must_be_loaded_for_domains_that_weigh_them():
    with pytest.raises(FailedPrecondition, match="weighs 'rm'"):
        Scorer(RewardSettings(domains={"toy": DomainSpec(weights={"exact_answer": 1.0, "rm": 1.0})}))
    with pytest.raises(ValueError, match="unknown component"):
        RewardSettings(domains={"toy": DomainSpec(weights={"exact_answr": 1.0})})
    with pytest.raises(ValueError, match="no length_penalty table"):
        DomainSpec(weights={"exact_answer": 1.0, "length_penalty": 1.0})
