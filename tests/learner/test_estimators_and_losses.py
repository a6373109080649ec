"""Each advantage estimator, policy loss, value loss and KL estimator against numbers worked out
by hand, and gradients against autograd of naive references or finite differences."""

import math

import pytest
import torch

from temper.learner import algos
from temper.learner.algos import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, POLICY_LOSSES, AdvantageInputs, Aggregation


def close(a, b, tol=1e-6):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64),
                          atol=tol, rtol=tol)


# -- advantages ---------------------------------------------------------------------------------

def test_grpo_broadcasts_group_normalised_scores_including_token_rewards():
    # one group of two sequences (2 and 1 tokens); outcome 1 and 0, token rewards -0.1, -0.1 | -0.3
    # scores: 1 - 0.2 = 0.8 and 0 - 0.3 = -0.3 -> mean 0.25, std 0.55 -> +1, -1 (up to eps)
    x = AdvantageInputs(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), torch.tensor([2, 1]),
                        token_rewards=torch.tensor([-0.1, -0.1, -0.3]))
    adv, returns = ADVANTAGE_ESTIMATORS["grpo"](x, eps=1e-9)
    assert returns is None
    assert close(adv, [1.0, 1.0, -1.0], 1e-5)


def test_grpo_group_without_variance_has_no_signal():
    # group 0: 1, 0, 0, 1 -> mean 0.5, std 0.5 -> +1, -1, -1, +1; group 1: 1, 1 -> std 0 -> 0, not a division by ~0
    x = AdvantageInputs(torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0]), torch.tensor([0, 0, 0, 0, 1, 1]),
                        torch.ones(6, dtype=torch.long))
    adv, _ = ADVANTAGE_ESTIMATORS["grpo"](x, eps=1e-12)
    assert close(adv, [1.0, -1.0, -1.0, 1.0, 0.0, 0.0], 1e-5)


def test_dr_grpo_is_centred_but_not_scaled():
    x = AdvantageInputs(torch.tensor([3.0, 1.0, 2.0, 5.0]), torch.tensor([0, 0, 0, 1]), torch.tensor([1, 2, 1, 1]))
    adv, _ = ADVANTAGE_ESTIMATORS["dr_grpo"](x)
    # group 0 mean 2 -> 1, -1 (two tokens), 0; group 1 alone -> 0
    assert close(adv, [1.0, -1.0, -1.0, 0.0, 0.0])


def test_rloo_uses_the_mean_of_the_others():
    # group 0: 1, 0, 0, 1 -> 1 - 1/3, 0 - 2/3, 0 - 2/3, 1 - 1/3; group 1: 3, 1 -> +2, -2; group 2 alone -> 0
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 7.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    assert close(algos.rloo_advantages(rewards, groups), [2 / 3, -2 / 3, -2 / 3, 2 / 3, 2.0, -2.0, 0.0])
    x = AdvantageInputs(rewards, groups, torch.ones(7, dtype=torch.long))
    assert close(ADVANTAGE_ESTIMATORS["rloo"](x)[0], [2 / 3, -2 / 3, -2 / 3, 2 / 3, 2.0, -2.0, 0.0])


def test_reinforce_pp_discounts_then_whitens_over_the_batch():
    # seq 0: tokens r = 0.1, -0.2 (+ outcome 1 at its last token) = 0.1, 0.8; seq 1: 0.3 (+ outcome 0)
    # gamma 0.5: G = 0.1 + 0.5 * 0.8 = 0.5, 0.8 | 0.3; mean 1.6/3, population std sqrt(0.0422222...)
    x = AdvantageInputs(torch.tensor([1.0, 0.0]), torch.tensor([0, 1]), torch.tensor([2, 1]),
                        token_rewards=torch.tensor([0.1, -0.2, 0.3]))
    adv, _ = ADVANTAGE_ESTIMATORS["reinforce_pp"](x, gamma=0.5, eps=1e-12)
    g = [0.5, 0.8, 0.3]
    mean = sum(g) / 3
    std = math.sqrt(sum((v - mean) ** 2 for v in g) / 3)
    assert math.isclose(std, 0.2054804, rel_tol=1e-6)
    assert close(adv, [(v - mean) / std for v in g], 1e-5)


def test_gae_hand_computed():
    # one sequence, V = 0.5, 0.6, 0.7, reward 1 at the end, gamma 0.9, lambda 0.8:
    # delta_2 = 1 - 0.7 = 0.3; delta_1 = 0.9 * 0.7 - 0.6 = 0.03; delta_0 = 0.9 * 0.6 - 0.5 = 0.04
    # A_2 = 0.3; A_1 = 0.03 + 0.72 * 0.3 = 0.246; A_0 = 0.04 + 0.72 * 0.246 = 0.21712; R = A + V
    adv, ret = algos.gae_advantages(torch.tensor([0.0, 0.0, 1.0]), torch.tensor([0.5, 0.6, 0.7]),
                                    torch.tensor([3]), gamma=0.9, lam=0.8)
    assert close(adv, [0.21712, 0.246, 0.3])
    assert close(ret, [0.71712, 0.846, 1.0])


def test_gae_with_lambda_one_gives_reward_to_go_returns_and_respects_sequence_ends():
    values = torch.tensor([0.2, -0.1, 0.4, 0.9])
    dense = torch.tensor([0.0, 1.0, 0.5, 2.0])  # seq 0 = 2 tokens, seq 1 = 1, seq 2 = 1
    adv, ret = algos.gae_advantages(dense, values, torch.tensor([2, 1, 1]), gamma=1.0, lam=1.0)
    assert close(ret, [1.0, 1.0, 0.5, 2.0])  # Monte-Carlo return: nothing leaks across sequences
    assert close(adv, ret - values)


def test_gae_matches_the_sum_definition_on_random_sequences():
    torch.manual_seed(0)
    lengths = torch.tensor([5, 1, 3, 7])
    T = int(lengths.sum())
    r, v = torch.randn(T, dtype=torch.float64), torch.randn(T, dtype=torch.float64)
    gamma, lam = 0.97, 0.9
    adv, _ = algos.gae_advantages(r, v, lengths, gamma, lam)
    expected, start = [], 0
    for n in lengths.tolist():
        rs, vs = r[start:start + n].tolist(), v[start:start + n].tolist() + [0.0]
        deltas = [rs[t] + gamma * vs[t + 1] - vs[t] for t in range(n)]
        expected += [sum((gamma * lam) ** k * deltas[t + k] for k in range(n - t)) for t in range(n)]
        start += n
    assert close(adv, expected, 1e-10)


def test_registered_gae_whitens_advantages_and_needs_values():
    x = AdvantageInputs(torch.tensor([1.0, 0.0]), torch.tensor([0, 1]), torch.tensor([2, 2]),
                        values=torch.tensor([0.1, 0.2, 0.3, 0.4]))
    adv, ret = ADVANTAGE_ESTIMATORS["gae"](x, gamma=1.0, lam=1.0)
    assert close(ret, [1.0, 1.0, 0.0, 0.0])
    assert abs(adv.mean().item()) < 1e-6 and abs(adv.std(unbiased=False).item() - 1) < 1e-4
    with pytest.raises(ValueError):
        ADVANTAGE_ESTIMATORS["gae"](AdvantageInputs(x.rewards, x.group_index, x.lengths))


# -- aggregation --------------------------------------------------------------------------------

def test_process_grpo_normalises_step_rewards_over_the_group_and_sums_the_steps_still_ahead():
    # group 0: seq A (3 tokens) steps 1 (ends at token 0) and 0 (ends at token 2); seq B (2 tokens) has no
    # step rewards: its total 0 is one step ending at its last token. Group steps 1, 0, 0: mean 1/3,
    # std sqrt(2)/3 -> 1 -> +sqrt(2), 0 -> -1/sqrt(2). A's token 0 sees both steps: sqrt(2) - 1/sqrt(2) =
    # 1/sqrt(2); its tokens 1, 2 only the second; B's tokens its one step.
    # group 1: seq C (2 tokens) steps 0.5, 0.5 at tokens 0, 1; seq D (1 token) step 0.5: all equal -> 0.
    x = AdvantageInputs(torch.tensor([0.7, 0.0, 0.9, 0.1]), torch.tensor([0, 0, 1, 1]), torch.tensor([3, 2, 2, 1]),
                        step_rewards=torch.tensor([1.0, 0.0, 0.5, 0.5, 0.5]),
                        step_seq=torch.tensor([0, 0, 2, 2, 3]), step_ends=torch.tensor([0, 2, 0, 1, 0]))
    adv, returns = ADVANTAGE_ESTIMATORS["process_grpo"](x, eps=1e-12)
    assert returns is None
    h = 1 / math.sqrt(2)
    assert close(adv, [h, -h, -h, -h, -h, 0.0, 0.0, 0.0], 1e-5)


def test_process_grpo_steps_ending_at_one_token_add_and_later_tokens_see_only_later_steps():
    # one group, one sequence of 4 tokens with steps 3, 1 (both end at token 1) and 2 (ends at token 3), and a
    # 1-token sequence with steps 0 and 2 at token 0. Group steps 3, 1, 2, 0, 2: mean 1.6, std sqrt(1.04):
    # normalised 1.4, -0.6, 0.4, -1.6, 0.4 (/ sqrt(1.04)). Tokens 0, 1: 1.4 - 0.6 + 0.4 = 1.2; tokens 2, 3: 0.4;
    # the short sequence: -1.6 + 0.4 = -1.2.
    x = AdvantageInputs(torch.tensor([0.0, 0.0]), torch.tensor([0, 0]), torch.tensor([4, 1]),
                        step_rewards=torch.tensor([3.0, 1.0, 2.0, 0.0, 2.0]),
                        step_seq=torch.tensor([0, 0, 0, 1, 1]), step_ends=torch.tensor([1, 1, 3, 0, 0]))
    adv, _ = ADVANTAGE_ESTIMATORS["process_grpo"](x, eps=1e-12)
    s = math.sqrt(1.04)
    assert close(adv, [1.2 / s, 1.2 / s, 0.4 / s, 0.4 / s, -1.2 / s], 1e-5)


def test_process_grpo_without_step_rewards_is_grpo():
    g = torch.Generator().manual_seed(3)
    rewards = torch.rand(7, generator=g)
    x = AdvantageInputs(rewards, torch.tensor([0, 0, 0, 1, 1, 2, 2]), torch.tensor([2, 3, 1, 4, 2, 1, 5]))
    assert close(ADVANTAGE_ESTIMATORS["process_grpo"](x)[0], ADVANTAGE_ESTIMATORS["grpo"](x)[0], 1e-6)


def test_grpo_process_adds_the_outcome_advantage_to_the_step_advantage_of_sequences_with_steps():
    # one group: seq A (3 tokens, total 1) steps 1 at token 0 and 0 at token 2; seq B (2 tokens, total 0) steps 0
    # at token 1; seq C (1 token, total 0) no steps. Outcome: totals 1, 0, 0: mean 1/3, std sqrt(2)/3 ->
    # A +sqrt(2), B and C -1/sqrt(2) on every token. Steps (A's and B's only) 1, 0, 0: the same normalisation
    # -> +sqrt(2), -1/sqrt(2), -1/sqrt(2). A token 0: sqrt(2) + sqrt(2) - 1/sqrt(2); tokens 1, 2: sqrt(2) -
    # 1/sqrt(2); B: -1/sqrt(2) - 1/sqrt(2) on both tokens; C: the outcome part only.
    x = AdvantageInputs(torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0, 0, 0]), torch.tensor([3, 2, 1]),
                        step_rewards=torch.tensor([1.0, 0.0, 0.0]), step_seq=torch.tensor([0, 0, 1]),
                        step_ends=torch.tensor([0, 2, 1]))
    adv, returns = ADVANTAGE_ESTIMATORS["grpo_process"](x, eps=1e-12)
    assert returns is None
    r, h = math.sqrt(2), 1 / math.sqrt(2)
    assert close(adv, [2 * r - h, r - h, r - h, -2 * h, -2 * h, -h], 1e-5)
    assert "grpo_process" in algos.NEEDS_STEPS and "grpo_process" not in algos.NEEDS_CRITIC


def test_grpo_process_without_step_rewards_is_grpo_and_equal_steps_add_nothing():
    g = torch.Generator().manual_seed(4)
    rewards, groups, lengths = torch.rand(5, generator=g), torch.tensor([0, 0, 1, 1, 1]), torch.tensor([2, 3, 1, 2, 2])
    grpo = ADVANTAGE_ESTIMATORS["grpo"](AdvantageInputs(rewards, groups, lengths))[0]
    assert close(ADVANTAGE_ESTIMATORS["grpo_process"](AdvantageInputs(rewards, groups, lengths))[0], grpo, 1e-6)
    same = AdvantageInputs(rewards, groups, lengths, step_rewards=torch.full((5,), 0.3),
                           step_seq=torch.arange(5), step_ends=lengths - 1)
    assert close(ADVANTAGE_ESTIMATORS["grpo_process"](same)[0], grpo, 1e-6)


def test_gae_step_puts_step_rewards_at_their_last_tokens():
    # seq 0: V = 0.5, 0.6, 0.7, steps 0.2 at token 0 and 1.0 at token 2, KL token reward -0.1 at token 0;
    # seq 1 (1 token, V = 0.4) has no step rewards: its total 1 at its last token. gamma 0.9, lambda 0.8:
    # delta_2 = 1 - 0.7 = 0.3; delta_1 = 0.9 * 0.7 - 0.6 = 0.03; delta_0 = 0.2 - 0.1 + 0.9 * 0.6 - 0.5 = 0.14
    # A_2 = 0.3; A_1 = 0.03 + 0.72 * 0.3 = 0.246; A_0 = 0.14 + 0.72 * 0.246 = 0.31712; seq 1: A = 1 - 0.4 = 0.6
    x = AdvantageInputs(torch.tensor([0.0, 1.0]), torch.tensor([0, 1]), torch.tensor([3, 1]),
                        token_rewards=torch.tensor([-0.1, 0.0, 0.0, 0.0]), values=torch.tensor([0.5, 0.6, 0.7, 0.4]),
                        step_rewards=torch.tensor([0.2, 1.0]), step_seq=torch.tensor([0, 0]),
                        step_ends=torch.tensor([0, 2]))
    adv, returns = ADVANTAGE_ESTIMATORS["gae_step"](x, gamma=0.9, lam=0.8, eps=1e-12)
    raw = torch.tensor([0.31712, 0.246, 0.3, 0.6])
    assert close(returns, [0.81712, 0.846, 1.0, 1.0], 1e-6)
    assert close(adv, (raw - raw.mean()) / raw.std(unbiased=False), 1e-5)
    assert "gae_step" in algos.NEEDS_CRITIC and {"gae_step", "process_grpo"} <= algos.NEEDS_STEPS
    with pytest.raises(ValueError, match="critic"):
        ADVANTAGE_ESTIMATORS["gae_step"](AdvantageInputs(torch.tensor([1.0]), torch.tensor([0]), torch.tensor([1])))


def test_gae_step_without_step_rewards_is_gae():
    g = torch.Generator().manual_seed(5)
    lengths = torch.tensor([3, 1, 4])
    x = AdvantageInputs(torch.rand(3, generator=g), torch.tensor([0, 0, 1]), lengths,
                        token_rewards=torch.rand(8, generator=g) * 0.1, values=torch.rand(8, generator=g))
    step, gae = ADVANTAGE_ESTIMATORS["gae_step"](x, gamma=0.95, lam=0.9), ADVANTAGE_ESTIMATORS["gae"](x, gamma=0.95, lam=0.9)
    assert close(step[0], gae[0], 1e-6) and close(step[1], gae[1], 1e-6)


def test_aggregations_hand_computed_and_micro_batches_add_up():
    per_token = torch.tensor([1.0, 2.0, 3.0, 4.0])
    lengths = torch.tensor([3, 1])
    assert close(Aggregation("token_mean", lengths)(per_token), 2.5)
    assert close(Aggregation("seq_mean_token_mean", lengths)(per_token), (2.0 + 4.0) / 2)
    assert close(Aggregation("seq_mean_token_sum", lengths)(per_token), (6.0 + 4.0) / 2)
    for mode in algos.AGGREGATIONS:
        full = Aggregation(mode, lengths)(per_token)
        parts = (Aggregation(mode, lengths[:1], num_tokens=4, num_seqs=2)(per_token[:3])
                 + Aggregation(mode, lengths[1:], num_tokens=4, num_seqs=2)(per_token[3:]))
        assert close(full, parts), mode


# -- policy losses ------------------------------------------------------------------------------

def test_ppo_clip_asymmetric_hand_computed():
    # ratios e^0.5 = 1.6487 (A=+1 -> clipped at 1.28), e^-0.5 = 0.6065 (A=-1 -> min(-0.6065, -0.8) = -0.8),
    # 0.7 (A=+1 -> min(0.7, 0.8) = 0.7, unclipped), 1.1 (A=-2 -> min(-2.2, -2.2) = -2.2)
    new = torch.tensor([0.5, -0.5, math.log(0.7), math.log(1.1)])
    adv = torch.tensor([1.0, -1.0, 1.0, -2.0])
    loss, info = POLICY_LOSSES["ppo_clip"](new, torch.zeros(4), adv, clip_low=0.2, clip_high=0.28)
    assert math.isclose(loss.item(), -(1.28 - 0.8 + 0.7 - 2.2) / 4, rel_tol=1e-6)
    assert math.isclose(info["clip_fraction"], 2 / 4)


def test_dual_clip_bounds_negative_advantage_tokens():
    # ratio 5 with A = -1: PPO objective min(-5, -1.2) = -5; dual clip c = 3 lifts it to -3 (and no gradient)
    new = torch.tensor([math.log(5.0), 0.1], requires_grad=True)
    adv = torch.tensor([-1.0, 1.0])
    loss, info = POLICY_LOSSES["ppo_clip"](new, torch.zeros(2), adv, dual_clip=3.0)
    assert math.isclose(loss.item(), -(-3.0 + math.exp(0.1)) / 2, rel_tol=1e-6)
    assert info["dual_clip_fraction"] == 0.5
    loss.backward()
    assert new.grad[0].item() == 0.0
    assert math.isclose(new.grad[1].item(), -math.exp(0.1) / 2, rel_tol=1e-6)
    plain, _ = POLICY_LOSSES["ppo_clip"](new.detach(), torch.zeros(2), adv)
    assert math.isclose(plain.item(), -(-5.0 + math.exp(0.1)) / 2, rel_tol=1e-6)


def naive_ppo(new, old, adv, lo, hi, dual, w):
    """Per-token PPO objective written out with Python floats (the reference)."""
    terms = []
    for n, o, a, wi in zip(new, old, adv, w):
        r = torch.exp(n - o)
        obj = torch.minimum(r * a, torch.clamp(r, 1 - lo, 1 + hi) * a)
        if dual and a < 0:
            obj = torch.maximum(obj, dual * a)
        terms.append(-obj * wi)
    return terms


@pytest.mark.parametrize("mode", algos.AGGREGATIONS)
def test_ppo_clip_gradient_matches_naive_reference_and_finite_differences(mode):
    torch.manual_seed(1)
    lengths = torch.tensor([3, 1, 4])
    old = -torch.rand(8, dtype=torch.float64) - 0.1
    adv = torch.randn(8, dtype=torch.float64)
    weights = torch.rand(8, dtype=torch.float64) + 0.5
    new = (old + 0.3 * torch.randn(8, dtype=torch.float64)).requires_grad_()
    agg = Aggregation(mode, lengths)
    kw = dict(agg=agg, clip_low=0.2, clip_high=0.28, dual_clip=2.0, is_weights=weights)
    loss, _ = POLICY_LOSSES["ppo_clip"](new, old, adv, **kw)
    (grad,) = torch.autograd.grad(loss, new)
    ref_new = new.detach().clone().requires_grad_()
    ref_loss = agg(torch.stack(naive_ppo(ref_new, old, adv, 0.2, 0.28, 2.0, weights)))
    (ref_grad,) = torch.autograd.grad(ref_loss, ref_new)
    assert close(loss.detach(), ref_loss.detach(), 1e-12) and close(grad, ref_grad, 1e-12)
    h = 1e-6
    for i in range(8):  # central differences (no token sits on a clip boundary with this seed)
        e = torch.zeros(8, dtype=torch.float64)
        e[i] = h
        up, _ = POLICY_LOSSES["ppo_clip"](new.detach() + e, old, adv, **kw)
        down, _ = POLICY_LOSSES["ppo_clip"](new.detach() - e, old, adv, **kw)
        assert abs((up - down).item() / (2 * h) - grad[i].item()) < 1e-6, i


def test_gspo_sequence_ratio_hand_computed():
    # one sequence of 2 tokens with log-ratios 0.1 and 0.3: s = exp(0.2) = 1.2214 > 1 + 0.1 -> clipped, A = +1
    # second sequence of 1 token with log-ratio -0.05: s = 0.9512, A = -1 -> min(-0.9512, -0.95) = -0.9512
    new = torch.tensor([0.1, 0.3, -0.05])
    adv = torch.tensor([1.0, 1.0, -1.0])
    agg = Aggregation("seq_mean_token_mean", torch.tensor([2, 1]))
    loss, info = POLICY_LOSSES["gspo"](new, torch.zeros(3), adv, agg=agg, clip_low=0.1, clip_high=0.1)
    assert math.isclose(loss.item(), -(1.1 - math.exp(-0.05)) / 2, rel_tol=1e-6)
    assert math.isclose(info["ratio_mean"], (2 * math.exp(0.2) + math.exp(-0.05)) / 3, rel_tol=1e-6)


def test_gspo_gradient_equals_the_sequence_level_objective():
    torch.manual_seed(2)
    lengths = torch.tensor([4, 2, 3])
    old = -torch.rand(9, dtype=torch.float64)
    new = (old + 0.05 * torch.randn(9, dtype=torch.float64)).requires_grad_()
    seq_adv = torch.randn(3, dtype=torch.float64)
    adv = torch.repeat_interleave(seq_adv, lengths)
    agg = Aggregation("seq_mean_token_mean", lengths)
    loss, _ = POLICY_LOSSES["gspo"](new, old, adv, agg=agg, clip_low=0.02, clip_high=0.03)
    (grad,) = torch.autograd.grad(loss, new)
    ref_new = new.detach().clone().requires_grad_()
    s = torch.exp(algos.segment_sum(ref_new - old, lengths) / lengths)  # differentiable sequence ratio
    ref = -torch.minimum(s * seq_adv, torch.clamp(s, 0.98, 1.03) * seq_adv).mean()
    (ref_grad,) = torch.autograd.grad(ref, ref_new)
    assert close(loss.detach(), ref.detach(), 1e-12) and close(grad, ref_grad, 1e-12)


# -- value loss ---------------------------------------------------------------------------------

def test_clipped_value_loss_hand_computed():
    # V 0.6, V_old 0.5, R 1, clip 0.05: unclipped 0.16, clipped (0.55 - 1)^2 = 0.2025 -> 0.5 * 0.2025, no gradient
    v = torch.tensor([0.6], requires_grad=True)
    loss, info = algos.clipped_value_loss(v, torch.tensor([0.5]), torch.tensor([1.0]), clip=0.05)
    assert math.isclose(loss.item(), 0.10125, rel_tol=1e-6) and info["value_clip_fraction"] == 1.0
    loss.backward()
    assert v.grad.item() == 0.0
    # V 1.0, V_old 0.5, R 0: unclipped 1.0 > clipped (0.55)^2 -> 0.5, gradient (V - R) = 1
    v = torch.tensor([1.0], requires_grad=True)
    loss, _ = algos.clipped_value_loss(v, torch.tensor([0.5]), torch.tensor([0.0]), clip=0.05)
    loss.backward()
    assert math.isclose(loss.item(), 0.5) and math.isclose(v.grad.item(), 1.0)
    loss, _ = algos.clipped_value_loss(torch.tensor([0.6]), torch.tensor([0.5]), torch.tensor([1.0]), clip=0.0)
    assert math.isclose(loss.item(), 0.08, rel_tol=1e-6)


# -- KL estimators ------------------------------------------------------------------------------

def exact_kl(p, q):
    return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))


@pytest.mark.parametrize("pair", [([0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]),
                                  ([0.7, 0.1, 0.1, 0.1], [0.1, 0.2, 0.3, 0.4]),
                                  ([0.3, 0.3, 0.4], [0.31, 0.29, 0.4])])
def test_kl_estimators_against_the_exact_kl_of_categoricals(pair):
    p, q = pair
    logp, logq = torch.tensor(p, dtype=torch.float64).log(), torch.tensor(q, dtype=torch.float64).log()
    kl = exact_kl(p, q)
    pt = torch.tensor(p, dtype=torch.float64)
    # expectation over x ~ p, computed exactly (no sampling noise): k1 and k3 are unbiased
    assert math.isclose((pt * KL_ESTIMATORS["k1"](logp, logq)).sum().item(), kl, rel_tol=1e-12)
    assert math.isclose((pt * KL_ESTIMATORS["k3"](logp, logq)).sum().item(), kl, rel_tol=1e-12)
    assert (KL_ESTIMATORS["k3"](logp, logq) >= 0).all() and (KL_ESTIMATORS["k2"](logp, logq) >= 0).all()
    k2 = (pt * KL_ESTIMATORS["k2"](logp, logq)).sum().item()
    # k2 is biased, exact to second order: close for nearby distributions, off for distant ones
    if kl < 0.01:
        assert abs(k2 - kl) < 0.05 * kl
    if kl > 0.5:
        assert abs(k2 - kl) > 0.01


def test_kl_estimators_by_sampling_k3_has_lower_variance_than_k1():
    torch.manual_seed(0)
    p = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    q = torch.tensor([0.15, 0.25, 0.25, 0.35], dtype=torch.float64)
    x = torch.multinomial(p, 200_000, replacement=True)
    logp, logq = p.log()[x], q.log()[x]
    kl = exact_kl(p.tolist(), q.tolist())
    k1, k3 = KL_ESTIMATORS["k1"](logp, logq), KL_ESTIMATORS["k3"](logp, logq)
    se = k1.std().item() / math.sqrt(len(x))
    assert abs(k1.mean().item() - kl) < 4 * se and abs(k3.mean().item() - kl) < 4 * se
    assert k3.var() < k1.var()
    assert (k1 < 0).any()  # k1 is unbiased but individual samples go negative


def test_entropy_of_uniform_and_one_hot():
    uniform = torch.full((1, 8), 1 / 8).log()
    assert math.isclose(algos.entropy(uniform).item(), math.log(8), rel_tol=1e-6)
    peaked = torch.tensor([[0.0, -1e4, -1e4]]).log_softmax(-1)
    assert algos.entropy(peaked).item() < 1e-6
