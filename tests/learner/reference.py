"""A plain PyTorch GRPO + PPO-clip update, written independently of temper.learner: the reference
the trainer's default step is checked against (tests) and timed against (benchmark)."""

from __future__ import annotations

import torch

from temper.learner.batching import Batch


def plain_inputs(batch: Batch, pad_id: int):
    """Right-padded ids + mask, and (row, col, target, temperature) of every completion token."""
    lengths = [len(p) + len(c) for p, c in zip(batch.prompts, batch.completions)]
    ids = torch.full((len(lengths), max(lengths)), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    rows, cols, targets, temps = [], [], [], []
    for i, (p, c) in enumerate(zip(batch.prompts, batch.completions)):
        ids[i, :lengths[i]] = torch.tensor(p + c)
        mask[i, :lengths[i]] = 1
        rows += [i] * len(c)
        cols += range(len(p) - 1, len(p) + len(c) - 1)
        targets += c
        temps += [float(batch.temperatures[i])] * len(c)
    return ids, mask, torch.tensor(rows), torch.tensor(cols), torch.tensor(targets), torch.tensor(temps)


def grpo_token_advantages(batch: Batch, eps: float = 1e-6) -> torch.Tensor:
    adv = torch.empty(len(batch.rewards))
    for g in batch.group_index.unique():
        members = batch.group_index == g
        r = batch.rewards[members]
        adv[members] = (r - r.mean()) / (r.std(unbiased=False) + eps)
    return torch.repeat_interleave(adv, torch.tensor([len(c) for c in batch.completions]))


def plain_step(model, optimizer, batch: Batch, pad_id: int, clip_low: float = 0.2, clip_high: float = 0.2,
               max_grad_norm: float = 1.0, inputs=None) -> float:
    """One update: teacher-forced logprobs, token-mean PPO clip on GRPO advantages, AdamW, grad clip."""
    ids, mask, rows, cols, targets, temps = inputs or plain_inputs(batch, pad_id)
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    logp = (logits[rows, cols] / temps.unsqueeze(-1)).log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    adv = grpo_token_advantages(batch)
    ratio = torch.exp(logp - batch.old_logprobs)
    loss = -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * adv).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    return loss.item()
