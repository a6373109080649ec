"""Process rewards from the reward service: the rule-based exact_steps verifier, per-domain step
delimiters, where each step ends (Reward.step_end_chars), and how several step sources combine."""

from __future__ import annotations

import pytest

from temper.reward.composite import compose
from temper.reward.core import Scorer
from temper.reward.models import RewardModelEngine, build_tiny_reward_model
from temper.reward.settings import DomainSpec, RewardSettings
from temper.reward.verifiers import Check
from temper.v1 import common_pb2
from tests.builders import rollout_group
from tests.reward.conftest import component

OK = common_pb2.REWARD_STATUS_OK


def toy_steps(**spec) -> Scorer:
    return Scorer(RewardSettings(domains={"toy": DomainSpec(weights={"exact_steps": 1.0}, step_delimiter=" ", **spec)}))


def test_exact_steps_scores_each_word_against_the_reference():
    scored = toy_steps().score_group(rollout_group("toy.copy", "4", ["4", "4 7", "7 4", "", "4  "], tokens=1))
    got = [(list(t.reward.step_rewards), list(t.reward.step_end_chars), t.reward.total) for t in scored.trajectories]
    assert got == [([1.0], [1], 1.0),               # the answer and nothing else
                   ([1.0, 0.0], [1, 3], 0.5),       # right, then an extra step
                   ([0.0, 0.0], [1, 3], 0.0),       # the answer in the wrong place
                   ([], [], 0.0),                   # no steps: the learner falls back to the total
                   ([1.0], [3], 1.0)]               # trailing delimiters belong to the last step
    assert component(scored.trajectories[1], "exact_steps").detail == "1/1 steps right, 2 given"
    # a multi-step reference: step i against reference step i
    scored = toy_steps().score_group(rollout_group("toy.add", "1 + 2 = 3", ["1 + 2 = 3", "1 + 5 = 3 3"], tokens=1))
    assert [list(t.reward.step_rewards) for t in scored.trajectories] == [[1.0] * 5, [1.0, 1.0, 0.0, 1.0, 1.0, 0.0]]
    assert scored.trajectories[1].reward.total == pytest.approx(4 / 6)


def test_step_ends_are_offsets_into_the_completion_text_after_a_prefix():
    # the verifier reads prefix + completion ("7 " + "4 9"); a step inside the prefix ends at offset 0
    g = rollout_group("toy.copy", "7 4 9", ["4 9"], metadata={"response_prefix": "7 "}, tokens=1)
    r = toy_steps().score_group(g).trajectories[0].reward
    assert list(r.step_rewards) == [1.0, 1.0, 1.0] and list(r.step_end_chars) == [0, 1, 3]


def test_the_domain_delimiter_wins_over_the_service_default():
    scorer = Scorer(RewardSettings(prm_step_delimiter=" ", domains={
        "toy": DomainSpec(weights={"exact_steps": 1.0}),
        "toy.add": DomainSpec(weights={"exact_steps": 1.0}, step_delimiter=" = ")}))
    assert list(scorer.score_group(rollout_group("toy.copy", "4", ["4 4"], tokens=1))
                .trajectories[0].reward.step_end_chars) == [1, 3]
    r = scorer.score_group(rollout_group("toy.add", "1 + 2 = 3", ["1 + 2 = 3"], tokens=1)).trajectories[0].reward
    assert list(r.step_rewards) == [1.0, 1.0] and list(r.step_end_chars) == [5, 9]


def test_step_sources_combine_by_weight_and_weight_zero_or_failed_ones_do_not_count():
    ends = [2, 5]
    r = compose([Check("a", 0.5, steps=(1.0, 0.0)), Check("b", 0.2, steps=(0.2, 0.6)), Check("c", 1.0)],
                {"a": 2.0, "b": -1.0, "c": 1.0}, ends)
    assert list(r.step_rewards) == pytest.approx([(2 * 1.0 - 0.2) / 3, (0 - 0.6) / 3])
    assert list(r.step_end_chars) == ends and r.total == pytest.approx(1.0 - 0.2 + 1.0)
    r = compose([Check("a", 0.5, steps=(1.0, 0.0)), Check("b", error="down")], {"a": 0.0, "b": 1.0}, ends)
    assert list(r.step_rewards) == [] and list(r.step_end_chars) == []
    with pytest.raises(ValueError, match="2 step scores for 1 steps"):
        compose([Check("a", 0.5, steps=(1.0, 0.0))], {"a": 1.0}, [3])


def test_prm_step_scores_beside_exact_steps_share_the_steps(tmp_path):
    prm = RewardModelEngine(build_tiny_reward_model(tmp_path / "prm", seed=5), max_wait_ms=2)
    try:
        scorer = Scorer(RewardSettings(domains={"toy": DomainSpec(weights={"exact_steps": 1.0, "prm": 1.0},
                                                                  step_delimiter=" ")}), prm=prm)
        r = scorer.score_group(rollout_group("toy.copy", "4", ["4 7"], prompt="copy 1 2 4", tokens=1)).trajectories[0].reward
        scores = prm.score_steps("copy 1 2 4", ["4", " 7"])
        assert r.status == OK and list(r.step_end_chars) == [1, 3]
        assert list(r.step_rewards) == pytest.approx([(1.0 + scores[0]) / 2, (0.0 + scores[1]) / 2], abs=1e-5)
    finally:
        prm.close()
