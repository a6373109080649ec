"""Token log-probabilities and entropies from hidden states, without the [tokens x vocab] logits.

The LM head's output over a whole micro-batch is the largest tensor of a step (SmolLM2: 49,152
fp32 logits = 192 KiB per token, and log_softmax keeps a second copy for backward). Here the head
runs on ``chunk_tokens`` hidden states at a time: logits of one chunk, upcast to fp32, scaled by
each token's sampling temperature, reduced with logsumexp to log p(target) and the entropy.
With gradients on, every chunk runs under non-reentrant activation checkpointing
(torch.utils.checkpoint), so its logits are freed as soon as its two [n] outputs exist and are
recomputed one chunk at a time during backward: peak memory holds one chunk's logits, forward
or backward (the approach of verl's / prime-rl's chunked log-prob and fused linear cross-entropy,
in plain PyTorch). The numbers are those of ``log_softmax(logits / T).gather(target)``: the same
fp32 reduction over the vocabulary, per row.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from temper.learner import algos


def _chunk(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperatures: torch.Tensor,
           softcap: float | None, entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logits = head(hidden).float()
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits / temperatures.unsqueeze(-1)
    lse = torch.logsumexp(logits, -1)
    token_logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        # -sum p log p over the chunk's log-probabilities: the very reduction of the unchunked code
        # (lse - sum p z is the same number in exact arithmetic, but ~1e-4 off in fp32 over 49k terms)
        entropy = algos.entropy(logits - lse.unsqueeze(-1))
    return token_logp, entropy if entropy_grad else entropy.detach()


def token_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperatures: torch.Tensor,
                   chunk_tokens: int = 1024, softcap: float | None = None, entropy_grad: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p of each target [n] in fp32, entropy of each predicting distribution [n]) from the
    hidden states [n, H] that predict them; ``chunk_tokens`` rows of logits at a time (0: all)."""
    n = hidden.shape[0]
    step = chunk_tokens if chunk_tokens > 0 else max(n, 1)
    grad = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in head.parameters()))
    logps, entropies = [], []
    for start in range(0, n, step):
        args = (hidden[start:start + step], targets[start:start + step], temperatures[start:start + step])
        if grad:
            lp, ent = checkpoint(_chunk, head, *args, softcap, entropy_grad, use_reentrant=False)
        else:
            lp, ent = _chunk(head, *args, softcap, entropy_grad)
        logps.append(lp)
        entropies.append(ent)
    if not logps:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(logps), torch.cat(entropies)
