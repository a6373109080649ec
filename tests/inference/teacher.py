"""Teacher forcing: the reference every engine's logprobs are checked against."""

from __future__ import annotations

import torch


@torch.no_grad()
def teacher_logits(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """Logits [len(completion), vocab] that predict each completion token (teacher forcing)."""
    prompt, completion = list(prompt), list(completion)
    logits = model(torch.tensor([prompt + completion])).logits[0].float()
    return logits[len(prompt) - 1:len(prompt) + len(completion) - 1]


def teacher_logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    logits = teacher_logits(model, prompt, completion) / (temperature or 1.0)
    return logits.log_softmax(-1).gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1)


def max_logprob_error(model, results, temperature: float) -> float:
    worst = 0.0
    for r in results:
        for c in r.completions:
            expected = teacher_logprobs(model, list(r.prompt_token_ids), list(c.token_ids), temperature)
            worst = max(worst, (expected - torch.tensor(c.logprobs)).abs().max().item())
    return worst


def set_weights(model, tensors: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(tensors[name])


def perturbed(model, scale: float = 0.05, seed: int = 0) -> dict[str, torch.Tensor]:
    """A different but plausible set of weights with the model's names and shapes."""
    g = torch.Generator().manual_seed(seed)
    return {n: p.detach() + scale * torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}
