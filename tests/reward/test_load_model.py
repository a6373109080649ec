"""Loading a reward model into a running Scorer (the LoadModel RPC's core): the new engine is built
first and swapped in at once; a folder that does not load leaves the old model serving; an engine
that a score call still uses is closed only once that call is done."""

from __future__ import annotations

import threading

import pytest

from temper.reward.core import Scorer
from temper.reward.models import RewardModelEngine, build_tiny_reward_model
from temper.reward.settings import DomainSpec, RewardSettings
from temper.reward.steps import split_steps
from temper.runtime.errors import FailedPrecondition, InvalidArgument
from temper.v1 import common_pb2
from tests.builders import rollout_group
from tests.reward.conftest import component

OK = common_pb2.REWARD_STATUS_OK
GROUP = rollout_group("toy.copy", "6", ["1 + 2 = 3 3 * 2 = 6", "7"], prompt="1 + 2, then times 2", tokens=1)


@pytest.fixture(scope="module")
def prms(tmp_path_factory):
    """Two tiny PRMs (different seeds, so different step scores) and an outcome-only sequence classifier."""
    root = tmp_path_factory.mktemp("prms")
    return (build_tiny_reward_model(root / "a", seed=1), build_tiny_reward_model(root / "b", seed=2),
            build_tiny_reward_model(root / "seq", seed=3, sequence_classifier=True))


def settings() -> RewardSettings:
    return RewardSettings(prm_step_delimiter=" ", domains={"toy": DomainSpec(weights={"exact_answer": 1.0,
                                                                                      "prm": 0.5})})


def prm_steps(scorer: Scorer) -> list[float]:
    traj = scorer.score_group(GROUP).trajectories[0]
    assert component(traj, "prm").status == OK
    return list(traj.reward.step_rewards)  # the prm is the only step source: its step scores


def direct_steps(model_dir) -> list[float]:
    engine = RewardModelEngine(model_dir)
    try:
        return engine.score_steps(GROUP.task.prompt, split_steps(GROUP.trajectories[0].completion_text, " "))
    finally:
        engine.close()


def test_swap_serves_the_new_model_and_a_failed_load_keeps_the_old(prms, tmp_path):
    a, b, seq = prms
    scorer = Scorer(settings(), prm=RewardModelEngine(a))
    try:
        before = prm_steps(scorer)
        assert before == pytest.approx(direct_steps(a))
        assert before != pytest.approx(direct_steps(b))

        (tmp_path / "empty").mkdir()
        (tmp_path / "broken").mkdir()
        (tmp_path / "broken" / "config.json").write_text("{not json")
        for slot, folder, error, field in [
                ("prm", str(tmp_path / "nope"), InvalidArgument, "model_dir"),
                ("prm", "", InvalidArgument, "model_dir"),
                ("prm", "x" * 5000, InvalidArgument, "model_dir"),      # a name too long for the file system
                ("prm", "a\0b", InvalidArgument, "model_dir"),
                ("value", str(b), InvalidArgument, "slot"),
                ("prm", str(tmp_path / "empty"), FailedPrecondition, "model_dir"),     # no config.json
                ("prm", str(tmp_path / "broken"), FailedPrecondition, "model_dir"),    # does not parse
                ("prm", str(seq), FailedPrecondition, "model_dir")]:                   # outcome-only head
            with pytest.raises(error) as e:
                scorer.load_model(slot, folder)
            assert e.value.field == field, (folder, e.value)
            assert prm_steps(scorer) == pytest.approx(before)  # the old model still serves
        assert scorer.versions["prm"] == 1

        old = scorer.prm
        loaded = scorer.load_model("prm", str(b))
        assert (loaded.slot, loaded.version, loaded.replaced_dir, loaded.per_token) == ("prm", 2, a, True)
        assert loaded.architecture == "LlamaForTokenClassification" and "step_tag" in loaded.meta
        assert scorer.prm is not old and old.batcher._closed  # nobody used it: closed at once
        assert prm_steps(scorer) == pytest.approx(direct_steps(b))

        # the rm slot takes a sequence classifier; an empty slot reports no replaced folder
        loaded = scorer.load_model("rm", str(seq))
        assert (loaded.version, loaded.replaced_dir, loaded.per_token) == (1, None, False)
    finally:
        scorer.close()


def test_an_engine_in_use_is_closed_by_its_last_user(prms):
    a, b, _ = prms
    scorer = Scorer(settings(), prm=RewardModelEngine(a))
    try:
        with scorer._using() as (_, prm):
            assert prm.model_dir == a
            scorer.load_model("prm", str(b))
            assert scorer.prm.model_dir == b
            # the call that started on the old model still finishes on it
            assert not prm.batcher._closed
            assert len(prm.score_steps("p", ["1 ", "2"])) == 2
        assert prm.batcher._closed and scorer._retired == [] and scorer._users == {}
    finally:
        scorer.close()


def test_concurrent_scores_see_the_old_or_the_new_model_never_a_mix(prms):
    a, b, _ = prms
    expected = {"a": direct_steps(a), "b": direct_steps(b)}
    scorer = Scorer(settings(), prm=RewardModelEngine(a))
    seen, errors = [], []

    def score():
        try:
            for _ in range(6):
                seen.append(prm_steps(scorer))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=score) for _ in range(3)]
    try:
        for t in threads:
            t.start()
        scorer.load_model("prm", str(b))
        for t in threads:
            t.join(120)
        assert errors == [] and len(seen) == 18
        for steps in seen:
            assert any(steps == pytest.approx(v) for v in expected.values()), steps
        assert prm_steps(scorer) == pytest.approx(expected["b"])
    finally:
        scorer.close()


def test_load_later_lets_a_domain_weigh_a_model_that_comes_after_start(prms):
    a, _, _ = prms
    with pytest.raises(FailedPrecondition, match="load_later"):
        Scorer(settings())  # without it, a domain that weighs prm needs a PRM at start
    s = settings()
    s.prm.load_later = True
    scorer = Scorer(s)
    try:
        traj = scorer.score_group(GROUP).trajectories[0]
        prm = component(traj, "prm")
        assert prm.status == common_pb2.REWARD_STATUS_ERROR and "temper reward load --prm" in prm.error
        assert traj.reward.status == common_pb2.REWARD_STATUS_ERROR and not traj.reward.step_rewards
        assert scorer.load_model("prm", str(a)).version == 1
        assert prm_steps(scorer) == pytest.approx(direct_steps(a))
    finally:
        scorer.close()
