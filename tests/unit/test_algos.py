import math

import torch

from temper.learner.algos import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, grpo_advantages, ppo_clip_loss


def test_grpo_advantages_hand_computed():
    # group 0: rewards 1, 0, 0, 1 -> mean 0.5, std 0.5 -> +1, -1, -1, +1
    # group 1: rewards 1, 1 -> std 0 -> advantages 0 (no signal)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    adv = grpo_advantages(rewards, groups, eps=0.0 + 1e-12)
    assert torch.allclose(adv[:4], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-6)
    assert torch.allclose(adv[4:], torch.zeros(2))


def test_dr_grpo_variant_has_no_std_scaling():
    rewards = torch.tensor([3.0, 1.0, 2.0])
    adv = grpo_advantages(rewards, torch.zeros(3, dtype=torch.long), scale_by_std=False)
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, 0.0]))


def test_ppo_clip_loss_hand_computed():
    # ratios: e^0 = 1, e^0.5 = 1.6487 (clipped at 1.2 for A>0), e^-0.5 = 0.6065 (clipped at 0.8 for A<0 -> min picks 0.8*-1)
    old = torch.zeros(3)
    new = torch.tensor([0.0, 0.5, -0.5])
    adv = torch.tensor([1.0, 1.0, -1.0])
    loss, info = ppo_clip_loss(new, old, adv, clip_low=0.2, clip_high=0.2)
    # objective terms: min(1*1, 1*1)=1; min(1.6487, 1.2)=1.2; min(-0.6065, -0.8)=-0.8
    expected = -(1.0 + 1.2 - 0.8) / 3
    assert math.isclose(loss.item(), expected, rel_tol=1e-6)
    assert math.isclose(info["clip_fraction"], 2 / 3, rel_tol=1e-6)


def test_ppo_clip_gradient_matches_naive_reference():
    torch.manual_seed(0)
    old = torch.randn(7).clamp(max=-0.1)
    adv = torch.randn(7)
    new = (old + 0.1 * torch.randn(7)).requires_grad_()
    loss, _ = ppo_clip_loss(new, old, adv, clip_low=0.2, clip_high=0.28)
    loss.backward()
    # naive: per-element objective, gradient exists only where the unclipped term is the min
    grads = []
    for i in range(7):
        r = math.exp(new[i].item() - old[i].item())
        unclipped, clipped = r * adv[i].item(), min(max(r, 0.8), 1.28) * adv[i].item()
        grads.append(-(r * adv[i].item()) / 7 if unclipped <= clipped else 0.0)
    assert torch.allclose(new.grad, torch.tensor(grads), atol=1e-6)


def test_registries_name_the_defaults():
    assert "grpo" in ADVANTAGE_ESTIMATORS
    assert "ppo_clip" in POLICY_LOSSES
