"""The learner's core: batches of scored groups -> one policy update. No gRPC, no Kafka.

A step: validate the batch (bad batches raise InvalidArgument and are never trained on),
compute group advantages, recompute token logprobs of the sampled completions with the
current weights (teacher forcing, logits scaled by each sample's temperature), take the
clipped surrogate loss, and apply one AdamW step with gradient clipping. A non-finite loss or
gradient skips the step, so no NaN ever reaches the weights.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from temper.learner.algos import ADVANTAGE_ESTIMATORS, POLICY_LOSSES
from temper.runtime.errors import InvalidArgument, require
from temper.v1 import common_pb2


@dataclass
class Batch:
    """Plain tensors of one batch; sequence i = prompts[i] + completions[i]."""

    prompts: list[list[int]]
    completions: list[list[int]]
    old_logprobs: torch.Tensor  # [T] over all completion tokens, in order
    temperatures: torch.Tensor  # [B]
    rewards: torch.Tensor  # [B]
    group_index: torch.Tensor  # [B]
    policy_versions: torch.Tensor  # [B]
    domains: list[str]
    job_id: str


def batch_from_groups(groups: list[common_pb2.RolloutGroup]) -> Batch:
    require(len(groups) > 0, "groups", "empty batch")
    prompts, completions, old, temps, rewards, gidx, versions, domains = [], [], [], [], [], [], [], []
    for g_i, group in enumerate(groups):
        require(len(group.trajectories) > 0, f"groups[{g_i}].trajectories", "empty group")
        for t_i, t in enumerate(group.trajectories):
            field = f"groups[{g_i}].trajectories[{t_i}]"
            require(len(t.completion_token_ids) > 0, f"{field}.completion_token_ids", "empty completion")
            require(len(t.prompt_token_ids) > 0, f"{field}.prompt_token_ids", "empty prompt")
            require(len(t.completion_logprobs) == len(t.completion_token_ids), f"{field}.completion_logprobs",
                    f"{len(t.completion_logprobs)} logprobs for {len(t.completion_token_ids)} tokens")
            require(all(math.isfinite(x) and x <= 0 for x in t.completion_logprobs), f"{field}.completion_logprobs",
                    "must be finite and <= 0")
            require(t.reward.status == common_pb2.REWARD_STATUS_OK, f"{field}.reward.status", "reward not OK")
            require(math.isfinite(t.reward.total), f"{field}.reward.total", "NaN or inf")
            prompts.append(list(t.prompt_token_ids))
            completions.append(list(t.completion_token_ids))
            old.extend(t.completion_logprobs)
            temps.append(t.sampling_temperature if t.sampling_temperature > 0 else 1.0)
            rewards.append(t.reward.total)
            gidx.append(g_i)
            versions.append(t.policy_version)
            domains.append(group.task.domain)
    return Batch(prompts, completions, torch.tensor(old), torch.tensor(temps), torch.tensor(rewards, dtype=torch.float32),
                 torch.tensor(gidx), torch.tensor(versions), domains, groups[0].job_id)


@dataclass
class TrainerConfig:
    advantage: str = "grpo"
    policy_loss: str = "ppo_clip"
    lr: float = 1e-3
    weight_decay: float = 0.0
    clip_low: float = 0.2
    clip_high: float = 0.2
    max_grad_norm: float = 1.0
    epochs: int = 1  # optimisation passes over each batch
    seed: int = 0


class Trainer:
    def __init__(self, model_dir: str | Path, config: TrainerConfig):
        if config.advantage not in ADVANTAGE_ESTIMATORS:
            raise InvalidArgument(f"unknown advantage estimator {config.advantage!r}; known: "
                                  f"{sorted(ADVANTAGE_ESTIMATORS)}", field="advantage")
        if config.policy_loss not in POLICY_LOSSES:
            raise InvalidArgument(f"unknown policy loss {config.policy_loss!r}; known: {sorted(POLICY_LOSSES)}",
                                  field="policy_loss")
        torch.manual_seed(config.seed)
        self.config = config
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        self.step_count = 0
        self.skipped_steps = 0
        pad = self.model.config.pad_token_id
        self.pad_id = int(pad if pad is not None else 0)

    def token_logprobs(self, batch: Batch) -> torch.Tensor:
        """Teacher-forced log p of every completion token, [T] in batch order."""
        lengths = [len(p) + len(c) for p, c in zip(batch.prompts, batch.completions)]
        ids = torch.full((len(lengths), max(lengths)), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (p, c) in enumerate(zip(batch.prompts, batch.completions)):
            ids[i, :lengths[i]] = torch.tensor(p + c)
            mask[i, :lengths[i]] = 1
        logits = self.model(input_ids=ids, attention_mask=mask).logits.float()
        out = []
        for i, (p, c) in enumerate(zip(batch.prompts, batch.completions)):
            # logits at position k predict token k+1: the completion's tokens are predicted by p-1 .. p+c-2
            rows = logits[i, len(p) - 1:len(p) + len(c) - 1] / batch.temperatures[i]
            out.append(rows.log_softmax(-1).gather(-1, torch.tensor(c).unsqueeze(-1)).squeeze(-1))
        return torch.cat(out)

    def step(self, batch: Batch) -> dict[str, float]:
        t0 = time.perf_counter()
        cfg = self.config
        advantages = ADVANTAGE_ESTIMATORS[cfg.advantage](batch.rewards, batch.group_index)
        lengths = torch.tensor([len(c) for c in batch.completions])
        token_adv = torch.repeat_interleave(advantages, lengths)
        metrics: dict[str, float] = {}
        for _ in range(cfg.epochs):
            logprobs = self.token_logprobs(batch)
            loss, info = POLICY_LOSSES[cfg.policy_loss](logprobs, batch.old_logprobs, token_adv,
                                                        clip_low=cfg.clip_low, clip_high=cfg.clip_high)
            self.optimizer.zero_grad(set_to_none=True)
            if not torch.isfinite(loss):
                self.skipped_steps += 1
                raise InvalidArgument("non-finite loss; step skipped", field="batch")
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
            if not torch.isfinite(grad_norm):
                self.optimizer.zero_grad(set_to_none=True)
                self.skipped_steps += 1
                raise InvalidArgument("non-finite gradient; step skipped", field="batch")
            self.optimizer.step()
            with torch.no_grad():
                approx_kl = (batch.old_logprobs - logprobs.detach()).mean().item()
            metrics = {"loss": loss.item(), "grad_norm": float(grad_norm), "approx_kl": approx_kl,
                       "lr": self.optimizer.param_groups[0]["lr"], **info}
        self.step_count += 1
        metrics.update(advantage_mean=advantages.mean().item(), advantage_std=advantages.std().item()
                       if advantages.numel() > 1 else 0.0, tokens=float(lengths.sum()),
                       train_seconds=time.perf_counter() - t0)
        return metrics

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.model.named_parameters()}
