"""Priorities in the loop, without a server: the per-group signals a step computes
(``algos.group_priorities``), the importance weights of replay's draws applied as loss weights, and
the learner loop sending the configured signal to replay and reporting the draws in StepMetrics."""

import copy
import math

import numpy as np
import pytest
import torch

from temper.learner import algos
from temper.learner.config import LearnerConfig
from temper.learner.loop import LearnerLoop, replay_draw_values
from temper.learner.trainer import Trainer, TrainerConfig
from temper.models.tiny import build_tiny_model
from temper.v1 import replay_pb2
from tests.builders import rollout_group, trajectory
from tests.learner.test_trainer import synthetic_batch


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


def test_group_priorities_by_hand():
    # tokens 0-2 belong to group 0, tokens 3-4 to group 1, group 2 has none
    advantages = torch.tensor([0.5, -0.5, 1.0, 2.0, -1.0])
    policy_loss = torch.tensor([-0.5, 0.6, -1.3, 0.0, 4.0])
    token_group = torch.tensor([0, 0, 0, 1, 1])
    p = algos.group_priorities(advantages, policy_loss, token_group, n_groups=3)
    assert p["mean_abs_advantage"].tolist() == pytest.approx([2.0 / 3, 1.5, 0.0])
    assert p["loss"].tolist() == pytest.approx([2.4 / 3, 2.0, 0.0])
    assert set(p) == set(algos.PRIORITY_SIGNALS)


def test_every_priority_signal_is_a_learner_config_choice():
    choices = set(LearnerConfig.model_fields["priority_signal"].annotation.__args__)
    assert choices == {"none", *algos.PRIORITY_SIGNALS}


def test_aggregation_keeps_the_per_token_terms_it_was_given():
    kept: list[torch.Tensor] = []
    agg = algos.Aggregation("token_mean", torch.tensor([2, 1]), kept=kept)
    assert agg(torch.tensor([1.0, 2.0, 6.0])).item() == pytest.approx(3.0)
    assert [t.tolist() for t in kept] == [[1.0, 2.0, 6.0]]


def _on_policy(trainer: Trainer, batch):
    """``batch`` with the trainer's own logprobs as behaviour logprobs: every ratio is exactly 1."""
    b = copy.copy(batch)
    with torch.no_grad():
        b.old_logprobs = torch.cat([trainer._logprobs(trainer.model, mb)[0] for mb in trainer._micro_batches(b)]).cpu()
    return b


def test_loss_signal_on_policy_is_mean_abs_advantage_and_ignores_sample_weights(model_dir):
    """One epoch on its own samples: rho = 1, so each token's loss is -A_t and the group's mean
    |loss| equals its mean |advantage|; the sample weights scale the loss, not the signal."""
    cfg = TrainerConfig(epochs=1, kl_coef=0.0, entropy_coef=0.0)
    batch = synthetic_batch(5, n=12)  # 3 groups of 4
    batch.rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0])  # group 0: flat
    batch.group_ids = ["g0", "g1", "g2"]
    signals = {}
    for w in (1.0, 0.25):
        trainer = Trainer(model_dir, cfg)
        b = _on_policy(trainer, batch)
        b.sample_weights = torch.full((3,), w)
        m = trainer.step(b)
        signals[w] = trainer.group_signals
    s = signals[1.0]
    assert (m["groups"], m["zero_signal_groups"]) == (3.0, 1.0)
    assert s["loss"]["g0"] == 0.0 and s["mean_abs_advantage"]["g0"] == 0.0  # no signal in a flat group
    for g in ("g1", "g2"):
        assert s["loss"][g] > 0
        assert s["loss"][g] == pytest.approx(s["mean_abs_advantage"][g], rel=1e-5)
        assert signals[0.25]["loss"][g] == pytest.approx(s["loss"][g], rel=1e-5)


def test_importance_weights_per_group_weigh_its_sequences_by_hand(model_dir):
    """token_mean loss = sum_t w_g(t) l_t / T: weights (1, 0, 0) leave group 0's share, T0 / T of
    its own token-mean loss; weights (0.5, 0.5, 0.5) halve the loss."""
    cfg = TrainerConfig(epochs=1, kl_coef=0.0, entropy_coef=0.0)
    batch = synthetic_batch(2, n=12)
    batch.rewards = torch.tensor([1.0, 0.0, 0.0, 1.0] * 3)
    batch.group_ids = ["g0", "g1", "g2"]
    lengths = batch.lengths
    t0, total = int(lengths[:4].sum()), int(lengths.sum())

    def loss(b, weights):
        b = copy.copy(b)
        b.sample_weights = None if weights is None else torch.tensor(weights)
        return Trainer(model_dir, cfg).step(b)["policy_loss"]

    only_g0 = batch.subset([0, 1, 2, 3])
    # group advantages are per group (GRPO), so group 0's tokens have the same advantages alone
    assert loss(batch, [1.0, 0.0, 0.0]) == pytest.approx(loss(only_g0, None) * t0 / total, rel=1e-4, abs=1e-7)
    assert loss(batch, [0.5, 0.5, 0.5]) == pytest.approx(0.5 * loss(batch, None), rel=1e-4, abs=1e-7)


def test_replay_draw_values_by_hand():
    draws = (("a", 1.0, 1), ("b", 0.25, 2), ("c", 0.5, 3), ("d", 0.5, 1), ("d", 0.5, 2))
    info = [replay_pb2.SampleInfo(group_id=g, importance_weight=w, times_sampled=n) for g, w, n in draws]
    v = replay_draw_values(info, no_signal={"c", "d"})
    # b and c were drawn in an earlier step; d twice in this batch only (fewest times sampled: 1)
    assert v == {"replay_importance_weight_mean": pytest.approx(2.75 / 5), "replay_importance_weight_min": 0.25,
                 "replay_times_sampled_mean": pytest.approx(9 / 5), "replay_reused_draws": 2.0,
                 "replay_reused_no_signal_draws": 1.0}
    assert replay_draw_values(None) == {} and replay_draw_values([]) == {}


class RecordingReplay:
    """Stands in for the replay client: records UpdatePriorities calls (a unit test of the loop)."""

    def __init__(self, known: set[str]):
        self.known, self.calls = known, []

    def update_priorities(self, priorities, table):
        self.calls.append((table, dict(priorities)))
        return replay_pb2.UpdatePrioritiesResponse(updated=len(self.known & set(priorities)),
                                                   unknown_group_ids=sorted(set(priorities) - self.known))


def _group(gid: str, rewards: list[float], seed: int):
    rng = np.random.default_rng(seed)
    return rollout_group(group_id=gid, job_id="j", trajectories=[
        trajectory(gid, k, tokens=3, reward=r, vocab=20, rng=rng, temperature=1.0) for k, r in enumerate(rewards)])


@pytest.mark.parametrize("signal", ["mean_abs_advantage", "loss"])
def test_the_loop_sends_the_configured_signal_and_reports_the_draws(model_dir, signal):
    trainer = Trainer(model_dir, TrainerConfig(epochs=1))
    replay = RecordingReplay(known={"a", "b"})  # "c" was sampled out meanwhile
    loop = LearnerLoop(trainer, replay, [], None, groups_per_step=3, table="prio", priority_signal=signal)
    groups = [_group("a", [1.0, 0.0, 0.0, 0.0], 1), _group("b", [1.0, 1.0, 1.0, 1.0], 2), _group("c", [0.0, 1.0], 3)]
    info = [replay_pb2.SampleInfo(group_id=g.group_id, importance_weight=w, times_sampled=n)
            for g, w, n in zip(groups, (0.5, 1.0, 0.25), (1, 2, 4))]
    m = loop.train_on(groups, info=info)
    assert m is not None
    [(table, sent)] = replay.calls
    assert table == "prio" and sent == trainer.group_signals[signal] and set(sent) == {"a", "b", "c"}
    assert sent["b"] == 0.0 and sent["a"] > 0 and sent["c"] > 0  # "b" is flat: no learning signal
    assert m.values["priorities_updated"] == 2.0
    assert m.values["replay_importance_weight_mean"] == pytest.approx(1.75 / 3)
    assert m.values["replay_importance_weight_min"] == 0.25
    assert m.values["replay_times_sampled_mean"] == pytest.approx(7 / 3)
    assert (m.values["replay_reused_draws"], m.values["replay_reused_no_signal_draws"]) == (2.0, 1.0)  # b, c; b flat


def test_the_loop_sends_nothing_with_signal_none(model_dir):
    replay = RecordingReplay(known={"a"})
    loop = LearnerLoop(Trainer(model_dir, TrainerConfig(epochs=1)), replay, [], None, groups_per_step=1)
    m = loop.train_on([_group("a", [1.0, 0.0], 1)])
    assert replay.calls == [] and m.values["priorities_updated"] == 0.0
    assert "replay_importance_weight_mean" not in m.values  # no SampleInfo: no draw values
    assert math.isfinite(m.values["loss"])
