"""Advantage estimators and policy losses: small pure functions over tensors, by name.

Conventions: ``logprobs``/``old_logprobs`` are per token, shape [T] over the concatenated
completion tokens of a batch (padding-free); ``seq_index`` maps each token to its sequence.
Rewards and advantages are per sequence, shape [B].
"""

from __future__ import annotations

from collections.abc import Callable

import torch

ADVANTAGE_ESTIMATORS: dict[str, Callable[..., torch.Tensor]] = {}
POLICY_LOSSES: dict[str, Callable[..., tuple[torch.Tensor, dict[str, float]]]] = {}


def register_advantage(name: str):
    def deco(fn):
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn
    return deco


def register_policy_loss(name: str):
    def deco(fn):
        POLICY_LOSSES[name] = fn
        return fn
    return deco


@register_advantage("grpo")
def grpo_advantages(rewards: torch.Tensor, group_index: torch.Tensor, eps: float = 1e-6,
                    scale_by_std: bool = True) -> torch.Tensor:
    """A_i = (r_i - mean_g) / (std_g + eps) within each group g (std: unbiased=False).

    With ``scale_by_std=False`` this is Dr.GRPO's A_i = r_i - mean_g. A group whose rewards
    are all equal gets advantage 0 for every member (it carries no learning signal).
    """
    groups = int(group_index.max().item()) + 1 if group_index.numel() else 0
    count = torch.zeros(groups, dtype=rewards.dtype).index_add_(0, group_index, torch.ones_like(rewards))
    mean = torch.zeros(groups, dtype=rewards.dtype).index_add_(0, group_index, rewards) / count
    centered = rewards - mean[group_index]
    if not scale_by_std:
        return centered
    var = torch.zeros(groups, dtype=rewards.dtype).index_add_(0, group_index, centered**2) / count
    return centered / (var.sqrt()[group_index] + eps)


@register_policy_loss("ppo_clip")
def ppo_clip_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                  clip_low: float = 0.2, clip_high: float = 0.2) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level PPO clipped surrogate, averaged over tokens.

    L = -mean_t min(rho_t A_t, clip(rho_t, 1 - clip_low, 1 + clip_high) A_t), rho_t = exp(logp - logp_old).
    ``advantages`` here are per token (broadcast from the sequence beforehand).
    """
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    loss = -torch.minimum(unclipped, clipped).mean()
    with torch.no_grad():
        clip_fraction = ((clipped < unclipped).float().mean()).item() if ratio.numel() else 0.0
    return loss, {"clip_fraction": clip_fraction, "ratio_mean": ratio.detach().mean().item()}
