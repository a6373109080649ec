"""Advantage estimators, policy losses, value loss and KL estimators: small pure functions over
tensors, registered by name so the trainer never branches on an algorithm.

Conventions (padding-free): per-token tensors have shape [T] over the concatenated completion
tokens of a batch, sequence by sequence; ``lengths`` [B] gives each sequence's token count, so
sequence i owns tokens ``offsets[i] : offsets[i] + lengths[i]``. Rewards are per sequence, [B];
process rewards are per step, [S], each with its sequence and the token where it ends.
Log-probabilities are natural logs (nats).

Registries:
- ``ADVANTAGE_ESTIMATORS[name](x: AdvantageInputs, *, gamma, lam, eps) -> (advantages [T], returns [T] | None)``;
  ``returns`` are the critic's regression targets (GAE only).
- ``POLICY_LOSSES[name](logprobs, old_logprobs, advantages, *, agg, clip_low, clip_high, dual_clip, is_weights)
  -> (loss, info)``; ``info`` holds token means over the tokens given (floats).
- ``KL_ESTIMATORS[name](logprobs, ref_logprobs) -> [T]``: per-token estimates of KL(pi || pi_ref) from
  tokens sampled from pi.
- ``PRIORITY_SIGNALS``: what a group's replay priority can be after a step (``group_priorities``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

ADVANTAGE_ESTIMATORS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor | None]]] = {}
POLICY_LOSSES: dict[str, Callable[..., tuple[torch.Tensor, dict[str, float]]]] = {}
KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {}
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
# Advantage estimators that regress a learned value function (the trainer builds a critic for them).
NEEDS_CRITIC = {"gae", "gae_step"}
# Advantage estimators that read per-step rewards (the learner lays out each trajectory's steps for them).
NEEDS_STEPS = {"process_grpo", "grpo_process", "gae_step"}


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


def register_kl(name: str):
    def deco(fn):
        KL_ESTIMATORS[name] = fn
        return fn
    return deco


# -- layout helpers --------------------------------------------------------------------------

def seq_index(lengths: torch.Tensor) -> torch.Tensor:
    """[T]: the sequence each token belongs to."""
    return torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths)


def segment_sum(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """[B]: sum of the per-token ``x`` [T] within each sequence."""
    lengths = lengths.to(x.device)  # losses run on the model's device; lengths may come from the CPU layout
    return torch.zeros(len(lengths), dtype=x.dtype, device=x.device).index_add_(0, seq_index(lengths), x)


def to_padded(x: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T] -> ([B, Lmax] right-padded with 0, bool mask [B, Lmax])."""
    width = int(lengths.max()) if len(lengths) else 0
    lengths = lengths.to(x.device)
    mask = torch.arange(width, device=x.device).unsqueeze(0) < lengths.unsqueeze(1)
    out = torch.zeros(len(lengths), width, dtype=x.dtype, device=x.device)
    out[mask] = x
    return out, mask


def whiten(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(x - mean) / (std + eps) over all elements; std with unbiased=False."""
    return (x - x.mean()) / (x.std(unbiased=False) + eps) if x.numel() > 1 else torch.zeros_like(x)


@dataclass(frozen=True)
class Aggregation:
    """How per-token terms become one scalar loss.

    - ``token_mean``: sum over tokens / number of tokens (long sequences weigh more; DAPO).
    - ``seq_mean_token_mean``: mean over sequences of each sequence's token mean (GRPO paper).
    - ``seq_mean_token_sum``: mean over sequences of each sequence's token sum (Dr.GRPO, with
      advantages not divided by length).

    ``num_tokens``/``num_seqs`` are the denominators of the whole batch: when the batch is split
    into micro-batches, the micro-batch losses then add up exactly to the batch loss, so
    gradient accumulation reproduces the full-batch gradient.
    """

    mode: str
    lengths: torch.Tensor  # [b] tokens per sequence of the tokens given
    num_tokens: int | None = None
    num_seqs: int | None = None
    # a list: every per-token tensor aggregated is appended to it, detached (the trainer reads a
    # policy loss's per-token terms from it for the "loss" priority signal)
    kept: list[torch.Tensor] | None = None

    def __call__(self, per_token: torch.Tensor) -> torch.Tensor:
        if self.kept is not None:
            self.kept.append(per_token.detach())
        if self.mode == "token_mean":
            return per_token.sum() / (self.num_tokens or per_token.numel())
        sums = segment_sum(per_token, self.lengths)
        if self.mode == "seq_mean_token_mean":
            sums = sums / self.lengths.to(sums.dtype)
        elif self.mode != "seq_mean_token_sum":
            raise ValueError(f"unknown aggregation {self.mode!r}; known: {AGGREGATIONS}")
        return sums.sum() / (self.num_seqs or len(self.lengths))


# -- priority signals (prioritized replay) ---------------------------------------------------

PRIORITY_SIGNALS = ("mean_abs_advantage", "loss")


def group_priorities(advantages: torch.Tensor, policy_loss: torch.Tensor, token_group: torch.Tensor,
                     n_groups: int) -> dict[str, torch.Tensor]:
    """[G] per group and signal, from per-token terms [T] (``token_group``: each token's group):

    - ``mean_abs_advantage``: mean of |A_t| over the group's tokens (0 when its rewards are all
      equal: no learning signal, so a prioritized table stops drawing it);
    - ``loss``: mean of |l_t| over the group's tokens, ``l_t`` its per-token policy loss without the
      sample weights (as the step's last epoch computed it: with the ratio of the updated policy, so
      a clipped token counts |clip(rho) A|).

    Both are >= 0 (replay's priorities must be); a group with no tokens gets 0.
    """
    count = torch.bincount(token_group, minlength=n_groups).clamp(min=1).to(advantages.dtype)

    def mean_abs(x: torch.Tensor) -> torch.Tensor:
        x = x.detach().abs().to(advantages.dtype).cpu()
        return torch.zeros(n_groups, dtype=advantages.dtype).index_add_(0, token_group.cpu(), x) / count

    return {"mean_abs_advantage": mean_abs(advantages), "loss": mean_abs(policy_loss)}


# -- advantage estimators -------------------------------------------------------------------

@dataclass
class AdvantageInputs:
    rewards: torch.Tensor  # [B] outcome reward of each sequence
    group_index: torch.Tensor  # [B] group (same prompt) of each sequence, 0..G-1
    lengths: torch.Tensor  # [B] completion tokens of each sequence
    token_rewards: torch.Tensor | None = None  # [T] dense rewards added per token (e.g. -beta * KL)
    values: torch.Tensor | None = None  # [T] critic's V(s_t): value of the state before token t
    # process rewards (Reward.step_rewards): [S] each step's reward, the sequence it belongs to, and the
    # index of its last token within that sequence (non-decreasing per sequence; temper.learner.steps)
    step_rewards: torch.Tensor | None = None
    step_seq: torch.Tensor | None = None
    step_ends: torch.Tensor | None = None

    def steps(self, fallback: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """([S'] step rewards, [S'] their sequence, [S'] the index in [T] of each step's last token).

        With ``fallback``, a sequence with no step rewards counts as one step: its outcome reward (``rewards``),
        ending at its last token, so a batch without any step rewards gives one step per sequence; without it,
        such a sequence has no step.
        """
        starts = torch.cumsum(self.lengths, 0) - self.lengths
        dtype = self.rewards.dtype
        if self.step_rewards is None or self.step_rewards.numel() == 0:
            values, seq, ends = self.rewards[:0], self.group_index[:0], self.lengths[:0]
        else:
            values, seq, ends = self.step_rewards.to(dtype), self.step_seq.long(), self.step_ends.long()
        if fallback:
            without = torch.ones(len(self.lengths), dtype=torch.bool)
            without[seq] = False
            missing = without.nonzero().squeeze(1)
            values = torch.cat([values, self.rewards[missing]])
            seq = torch.cat([seq, missing])
            ends = torch.cat([ends, self.lengths[missing] - 1])
        return values, seq, starts[seq] + ends

    def sequence_scores(self) -> torch.Tensor:
        """[B]: outcome reward plus the sum of the sequence's token rewards."""
        if self.token_rewards is None:
            return self.rewards
        return self.rewards + segment_sum(self.token_rewards, self.lengths)

    def dense_rewards(self) -> torch.Tensor:
        """[T]: token rewards with each sequence's outcome reward added at its last token."""
        dense = torch.zeros(int(self.lengths.sum()), dtype=self.rewards.dtype) if self.token_rewards is None \
            else self.token_rewards.to(self.rewards.dtype).clone()
        dense[torch.cumsum(self.lengths, 0) - 1] += self.rewards
        return dense


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


def rloo_advantages(rewards: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """Leave-one-out baseline: A_i = r_i - mean_{j in g, j != i} r_j = n/(n-1) (r_i - mean_g).

    A group of one has no baseline to compare with: its advantage is 0.
    """
    groups = int(group_index.max().item()) + 1 if group_index.numel() else 0
    count = torch.zeros(groups, dtype=rewards.dtype).index_add_(0, group_index, torch.ones_like(rewards))
    total = torch.zeros(groups, dtype=rewards.dtype).index_add_(0, group_index, rewards)
    n = count[group_index]
    others = (total[group_index] - rewards) / (n - 1).clamp(min=1)
    return torch.where(n > 1, rewards - others, torch.zeros_like(rewards))


def discounted_returns(dense_rewards: torch.Tensor, lengths: torch.Tensor, gamma: float) -> torch.Tensor:
    """[T]: G_t = sum_{k >= t} gamma^(k - t) r_k within each sequence (reward-to-go)."""
    padded, mask = to_padded(dense_rewards, lengths)
    out = torch.zeros_like(padded)
    running = torch.zeros(padded.shape[0], dtype=padded.dtype)
    for t in range(padded.shape[1] - 1, -1, -1):
        running = padded[:, t] + gamma * running * mask[:, t + 1] if t + 1 < padded.shape[1] else padded[:, t]
        out[:, t] = running
    return out[mask]


def gae_advantages(dense_rewards: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor, gamma: float,
                   lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation within each sequence; the state after the last token is terminal.

    delta_t = r_t + gamma V_{t+1} - V_t (V after the last token = 0),
    A_t = delta_t + gamma lam A_{t+1};  returns R_t = A_t + V_t (the critic's targets).
    """
    r, mask = to_padded(dense_rewards, lengths)
    v, _ = to_padded(values.to(r.dtype), lengths)
    adv = torch.zeros_like(r)
    next_adv = torch.zeros(r.shape[0], dtype=r.dtype)
    next_value = torch.zeros(r.shape[0], dtype=r.dtype)
    for t in range(r.shape[1] - 1, -1, -1):
        live = mask[:, t + 1].to(r.dtype) if t + 1 < r.shape[1] else torch.zeros(r.shape[0], dtype=r.dtype)
        delta = r[:, t] + gamma * next_value * live - v[:, t]
        next_adv = delta + gamma * lam * next_adv * live
        next_value = v[:, t]
        adv[:, t] = next_adv
    advantages = adv[mask]
    return advantages, advantages + values.to(r.dtype)


def _per_token(seq_advantages: torch.Tensor, x: AdvantageInputs) -> torch.Tensor:
    return torch.repeat_interleave(seq_advantages, x.lengths)


@register_advantage("grpo")
def grpo(x: AdvantageInputs, *, gamma: float = 1.0, lam: float = 1.0, eps: float = 1e-6):
    """Group-normalised outcome advantage, the same for every token of a sequence."""
    return _per_token(grpo_advantages(x.sequence_scores(), x.group_index, eps), x), None


@register_advantage("dr_grpo")
def dr_grpo(x: AdvantageInputs, *, gamma: float = 1.0, lam: float = 1.0, eps: float = 1e-6):
    """Dr.GRPO: group-centred, not divided by the group's std (pair with ``seq_mean_token_sum``)."""
    return _per_token(grpo_advantages(x.sequence_scores(), x.group_index, eps, scale_by_std=False), x), None


@register_advantage("rloo")
def rloo(x: AdvantageInputs, *, gamma: float = 1.0, lam: float = 1.0, eps: float = 1e-6):
    return _per_token(rloo_advantages(x.sequence_scores(), x.group_index), x), None


@register_advantage("reinforce_pp")
def reinforce_pp(x: AdvantageInputs, *, gamma: float = 1.0, lam: float = 1.0, eps: float = 1e-6):
    """REINFORCE++: per-token discounted reward-to-go, whitened over every token of the batch."""
    return whiten(discounted_returns(x.dense_rewards(), x.lengths, gamma), eps), None


@register_advantage("gae")
def gae(x: AdvantageInputs, *, gamma: float = 1.0, lam: float = 0.95, eps: float = 1e-6):
    """PPO's GAE over the critic's values; advantages whitened over the batch, returns not."""
    if x.values is None:
        raise ValueError("gae needs the critic's values")
    advantages, returns = gae_advantages(x.dense_rewards(), x.values, x.lengths, gamma, lam)
    return whiten(advantages, eps), returns


@register_advantage("process_grpo")
def process_grpo(x: AdvantageInputs, *, gamma: float = 1.0, lam: float = 1.0, eps: float = 1e-6):
    """Process-supervised GRPO (DeepSeekMath, sec. 4.1.3): every step reward of a group is normalised
    by the mean and std (unbiased=False) of all step rewards of that group, r~ = (r - mean_g) / (std_g + eps),
    and token t's advantage is the sum of r~ over the steps of its sequence that end at or after t.

    A trajectory with no step rewards counts as one step, its ``reward.total``, ending at its last token
    (``AdvantageInputs.steps``); a batch without step rewards thus gets exactly ``grpo``'s advantages.
    Token rewards (KL in the reward) are refused by the config: put the KL in the loss.
    """
    return step_advantages(x, *x.steps(), eps), None


def step_advantages(x: AdvantageInputs, values: torch.Tensor, seq: torch.Tensor, ends: torch.Tensor,
                    eps: float) -> torch.Tensor:
    """[T]: the steps (``AdvantageInputs.steps``) normalised by the mean and std of their group's steps, each
    token getting the sum over the steps of its sequence that end at or after it."""
    normalised = grpo_advantages(values, x.group_index[seq], eps)
    dense = torch.zeros(int(x.lengths.sum()), dtype=normalised.dtype).index_add_(0, ends, normalised)
    return discounted_returns(dense, x.lengths, 1.0)


@register_advantage("grpo_process")
def grpo_process(x: AdvantageInputs, *, gamma: float = 1.0, lam: float = 1.0, eps: float = 1e-6):
    """Outcome plus process supervision: token t of sequence i gets GRPO's advantage of the sequence's
    ``reward.total`` (normalised within its group), plus the process advantage of ``process_grpo`` over the
    step rewards -- each step reward normalised by the mean and std of the group's step rewards, summed over
    the steps of the sequence that end at or after t. Only sequences with step rewards have steps here (one
    without gets the outcome part alone), so a batch without step rewards gets exactly ``grpo``'s advantages,
    and a PRM that scores every step alike adds nothing to the outcome's signal.
    """
    outcome = grpo_advantages(x.rewards, x.group_index, eps)[seq_index(x.lengths)]
    if x.step_rewards is None or x.step_rewards.numel() == 0:
        return outcome, None
    return outcome + step_advantages(x, *x.steps(fallback=False), eps), None


@register_advantage("gae_step")
def gae_step(x: AdvantageInputs, *, gamma: float = 1.0, lam: float = 0.95, eps: float = 1e-6):
    """GAE over process rewards: each step's reward is a token reward at the step's last token (plus any
    dense token rewards), then GAE with the critic's values exactly as ``gae``; advantages whitened over
    the batch, returns not. A trajectory with no step rewards has its ``reward.total`` at its last
    token (``AdvantageInputs.steps``), so without step rewards this is ``gae``.
    """
    if x.values is None:
        raise ValueError("gae_step needs the critic's values")
    values, _, ends = x.steps()
    n = int(x.lengths.sum())
    dense = torch.zeros(n, dtype=x.rewards.dtype) if x.token_rewards is None \
        else x.token_rewards.to(x.rewards.dtype).clone()
    dense.index_add_(0, ends, values.to(dense.dtype))
    advantages, returns = gae_advantages(dense, x.values, x.lengths, gamma, lam)
    return whiten(advantages, eps), returns


# -- policy losses --------------------------------------------------------------------------

def _surrogate(ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float,
               dual_clip: float, is_weights: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token PPO loss -min(rho A, clip(rho, 1 - clip_low, 1 + clip_high) A), optionally dual-clipped.

    Dual clip (``dual_clip`` = c > 1): for A < 0 the objective is also bounded below by c A, so a
    huge ratio on a bad token cannot produce an unbounded update.
    """
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    objective = torch.minimum(unclipped, clipped)
    info: dict[str, float] = {}
    with torch.no_grad():
        info["clip_fraction"] = (clipped < unclipped).float().mean().item() if ratio.numel() else 0.0
        info["ratio_mean"] = ratio.detach().mean().item() if ratio.numel() else 1.0
    if dual_clip > 0:
        floor = dual_clip * advantages
        dual = (advantages < 0) & (objective < floor)
        objective = torch.where(advantages < 0, torch.maximum(objective, floor), objective)
        info["dual_clip_fraction"] = dual.float().mean().item() if ratio.numel() else 0.0
    loss = -objective
    if is_weights is not None:
        loss = loss * is_weights
    return loss, info


@register_policy_loss("ppo_clip")
def ppo_clip_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, *,
                  agg: Aggregation | None = None, clip_low: float = 0.2, clip_high: float = 0.2,
                  dual_clip: float = 0.0, is_weights: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level PPO clipped surrogate (asymmetric "clip-higher" when clip_high > clip_low).

    rho_t = exp(logp_t - logp_old_t); per-token loss as in ``_surrogate``, times the truncated
    importance weight when given, aggregated by ``agg`` (token mean when None).
    """
    ratio = torch.exp(logprobs - old_logprobs)
    per_token, info = _surrogate(ratio, advantages, clip_low, clip_high, dual_clip, is_weights)
    return (agg(per_token) if agg is not None else per_token.mean()), info


@register_policy_loss("gspo")
def gspo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, *,
              agg: Aggregation | None = None, clip_low: float = 3e-4, clip_high: float = 4e-4,
              dual_clip: float = 0.0, is_weights: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO: one importance ratio per sequence, s_i = exp(mean_t (logp_t - logp_old_t)), clipped.

    Token form (GSPO-token): s_it = sg[s_i] * pi(y_t) / sg[pi(y_t)], whose value is s_i and whose
    gradient is s_i * grad log pi(y_t); with per-sequence advantages and ``seq_mean_token_mean``
    aggregation this is exactly the sequence-level GSPO objective. Needs ``agg`` (for lengths).
    Clip ranges are on the sequence ratio, so they are small (paper: 3e-4 / 4e-4).
    """
    if agg is None:
        raise ValueError("gspo needs an Aggregation (sequence lengths)")
    log_ratio = logprobs - old_logprobs
    seq_log_ratio = segment_sum(log_ratio.detach(), agg.lengths) / agg.lengths.to(log_ratio.dtype)
    ratio = torch.exp(seq_log_ratio[seq_index(agg.lengths)] + logprobs - logprobs.detach())
    per_token, info = _surrogate(ratio, advantages, clip_low, clip_high, dual_clip, is_weights)
    return agg(per_token), info


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float,
                       agg: Aggregation | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO value loss 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2); c <= 0: unclipped."""
    unclipped = (values - returns) ** 2
    if clip > 0:
        clipped_v = old_values + torch.clamp(values - old_values, -clip, clip)
        clipped = (clipped_v - returns) ** 2
        per_token = 0.5 * torch.maximum(unclipped, clipped)
        frac = (clipped > unclipped).float().mean().item() if values.numel() else 0.0
    else:
        per_token, frac = 0.5 * unclipped, 0.0
    return (agg(per_token) if agg is not None else per_token.mean()), {"value_clip_fraction": frac}


# -- KL estimators (Schulman, "Approximating KL divergence") ---------------------------------
# With tokens x ~ pi and log r = log pi_ref(x) - log pi(x):
#   k1 = -log r                unbiased for KL(pi || pi_ref), can be negative, high variance
#   k2 = (log r)^2 / 2         biased (exact to second order), non-negative, low variance
#   k3 = (r - 1) - log r       unbiased and non-negative, low variance

@register_kl("k1")
def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    return logprobs - ref_logprobs


@register_kl("k2")
def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    return 0.5 * (ref_logprobs - logprobs) ** 2


@register_kl("k3")
def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    log_r = ref_logprobs - logprobs
    return torch.expm1(log_r) - log_r


def entropy(logp: torch.Tensor) -> torch.Tensor:
    """[T]: entropy (nats) of each row of log-probabilities ``logp`` [T, V]."""
    return -(logp.exp() * logp).sum(-1)

