"""In-process RL on the toy tasks: a real tiny model, the HF engine and the exact toy verifiers.

No services: ``generate_batch`` samples groups with temper.inference.engine.HFEngine and scores
them with temper.tasks.toy; ``train`` runs the sample -> step -> weight-sync loop.
"""

from __future__ import annotations

import random

import torch

from temper.inference.engine import HFEngine, SamplingParams
from temper.learner.batching import Batch
from temper.learner.trainer import Trainer
from temper.tasks import toy

DOMAINS = ("toy.copy", "toy.next")


def generate_batch(engine: HFEngine, rng: random.Random, groups: int = 16, group_size: int = 8,
                   temperature: float = 1.0, max_tokens: int = 2, domains=DOMAINS, seed: int | None = None) -> Batch:
    tasks = [toy.make_task(rng.choice(domains), rng, f"t{i}") for i in range(groups)]
    prompts = [engine.encode(t.prompt) for t in tasks]
    results, version = engine.generate(prompts, SamplingParams(n=group_size, temperature=temperature,
                                                               max_tokens=max_tokens, seed=seed))
    p, c, old, rewards, gidx, doms = [], [], [], [], [], []
    for g, (task, result) in enumerate(zip(tasks, results)):
        for comp in result.completions:
            p.append(result.prompt_token_ids)
            c.append(comp.token_ids)
            old.extend(comp.logprobs)
            rewards.append(toy.exact_answer_reward(comp.text, task.reference_answer))
            gidx.append(g)
            doms.append(task.domain)
    n = len(p)
    return Batch(p, c, torch.tensor(old), torch.full((n,), float(temperature)), torch.tensor(rewards),
                 torch.tensor(gidx), torch.full((n,), version, dtype=torch.long), doms, "toy",
                 [f"g{g}" for g in range(groups)])


def train(trainer: Trainer, engine: HFEngine, steps: int, seed: int = 0, **kw) -> list[float]:
    """Mean reward of each step's batch (sampled before that step's update)."""
    rng = random.Random(seed)
    rewards = []
    for s in range(steps):
        batch = generate_batch(engine, rng, seed=seed * 100_003 + s, **kw)
        rewards.append(batch.rewards.mean().item())
        trainer.step(batch)
        engine.apply_weights(trainer.weights(), new_version=trainer.policy_version)
    return rewards
