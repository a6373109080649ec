"""The learner's core: batches of scored groups -> one policy update. No gRPC, no Kafka.

A step:
1. validate the batch (bad batches raise InvalidArgument naming the field, never trained on) and
   drop groups staler than ``max_staleness`` policy versions;
2. lay it out as packed (or padded) micro-batches; with ``share_prompts`` a group's samples share
   one copy of their prompt (temper.learner.batching.shared_prompt_layout: same logprobs and
   gradients; GRPO's k samples of a P-token prompt cost P + sum(len - 1) positions, not k * (P + len));
3. without gradients: reference-model logprobs (when a KL penalty is on) and the critic's
   values (GAE);
4. advantages by the configured estimator (KL in the reward enters here as dense token rewards;
   process_grpo / grpo_process / gae_step read each trajectory's step rewards, laid out by the loop with
   ``step_tokens``, and report ``step_reward_trajectories`` / ``step_rewards`` among the metrics);
5. ``epochs`` passes: per micro-batch, teacher-forced token logprobs under the current weights
   (logits scaled by each sample's temperature), the configured policy loss (+ KL in the loss,
   - entropy bonus), backward with batch-level denominators so micro-batches add up to the
   full-batch gradient; then gradient clipping and one AdamW step. Off-policy correction
   ("tis") uses the pre-update logprobs as the proximal policy of the clipped ratio and weights
   each token by min(pi_prox / pi_behaviour, tis_cap);
6. the critic (GAE) regresses the returns with the clipped value loss, on its own optimiser;
7. controllers: LR schedule (+ KL back-off), adaptive KL coefficient.
A non-finite loss or gradient skips the step (counted), so no NaN ever reaches the weights.

Memory and devices: the model runs on ``device`` ("auto": CUDA when present, else CPU) with fp32
master weights and optimiser state; ``autocast`` runs the forward (and so the backward) in bf16
where it pays; ``gradient_checkpointing`` recomputes each decoder layer in backward instead of
keeping its activations; micro-batches hold at most ``micro_batch_tokens`` tokens; the LM head
runs on ``logprob_chunk_tokens`` positions at a time (temper.learner.logprobs), so the fp32
[tokens x vocab] logits of a whole batch never exist. Pushed weights are cast to ``push_dtype``
(the inference engine's: by default the dtype the model folder stores) before they are chunked.

Units: logprobs and KL in nats (KL per token); lr per optimiser step; staleness in policy versions.
"""

from __future__ import annotations

import json
import logging
import re
import resource
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from temper.learner import algos, logprobs
from temper.learner.algos import (ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, NEEDS_CRITIC, NEEDS_STEPS, POLICY_LOSSES,
                                  Aggregation)
from temper.learner.batching import Batch, ModelInputs, batch_from_groups, micro_batches
from temper.learner.ranks import tell
from temper.learner.schedules import KLController, LRController
from temper.learner.steps import StepTokens
from temper.models.adapters import NAME as ADAPTER_NAME
from temper.models.adapters import PREFIX as ADAPTER_PREFIX
from temper.models.dtypes import cpu_has_native_bf16
from temper.runtime.errors import FailedPrecondition, InvalidArgument, require

log = logging.getLogger(__name__)

__all__ = ["Batch", "Trainer", "TrainerConfig", "batch_from_groups"]


class TrainerConfig(BaseModel):
    """Every knob of the update; validated (unknown algorithm names are refused with the field named)."""

    model_config = ConfigDict(extra="forbid")

    # algorithm (registered names: see temper.learner.algos)
    advantage: str = Field("grpo", description="advantage estimator: grpo, dr_grpo, rloo, reinforce_pp, gae; with "
                                               "per-step rewards (Reward.step_rewards): process_grpo, grpo_process "
                                               "(outcome + process), gae_step")
    policy_loss: str = Field("ppo_clip", description="policy loss: ppo_clip, gspo")
    loss_aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"] = Field(
        "token_mean", description="how token losses become the batch loss (seq_mean_token_sum: Dr.GRPO)")
    gamma: float = Field(1.0, ge=0, le=1, description="discount (GAE, REINFORCE++)")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda")
    advantage_eps: float = Field(1e-6, gt=0, description="added to the std that normalises advantages")
    clip_low: float = Field(0.2, ge=0, lt=1, description="ratio clipped to [1 - clip_low, 1 + clip_high]")
    clip_high: float = Field(0.2, ge=0, description="ratio clipped to [1 - clip_low, 1 + clip_high]")
    dual_clip: float = Field(0.0, ge=0, description="0: off; else c > 1 bounds the objective of A < 0 tokens by c * A")
    # critic (GAE)
    value_lr: float = Field(0.0, ge=0, description="critic learning rate (GAE); 0: same as lr")
    value_clip: float = Field(0.2, ge=0, description="critic value clipping (GAE); 0: unclipped value loss")
    # KL to the frozen reference (the initial weights), and entropy bonus
    kl_coef: float = Field(0.0, ge=0, description="KL to the frozen initial policy; 0: no reference model, no KL")
    kl_estimator: str = Field("k3", description="KL estimator: k1, k2, k3")
    kl_in: Literal["loss", "reward"] = Field("loss", description="where the KL term goes: the loss or the reward")
    kl_target: float = Field(0.0, ge=0, description="> 0: adaptive coefficient towards this KL (nats/token)")
    kl_horizon: int = Field(10_000, ge=1, description="horizon of the adaptive KL coefficient (beta moves by n / horizon)")
    entropy_coef: float = Field(0.0, ge=0, description="entropy bonus coefficient")
    # optimisation
    lr: float = Field(1e-3, gt=0, description="learning rate (AdamW)")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    max_grad_norm: float = Field(1.0, gt=0, description="gradients are clipped to this global norm")
    epochs: int = Field(1, ge=1, description="optimisation passes over each batch")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field("constant", description="learning-rate schedule")
    warmup_steps: int = Field(0, ge=0, description="linear warm-up steps of the schedule")
    total_steps: int = Field(0, ge=0, description="steps of the linear/cosine decay")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="the decay ends at lr * min_lr_ratio")
    lr_kl_target: float = Field(0.0, ge=0, description="> 0: LR backs off while the per-step policy shift KL > 2x "
                                                       "this")
    lr_kl_factor: float = Field(1.5, gt=1, description="LR back-off factor of lr_kl_target")
    # memory and devices (module docstring)
    micro_batch_tokens: int = Field(4096, ge=0, description="gradient accumulation budget per micro-batch (prompt + "
                                                            "completion tokens); 0: the whole batch at once, unbounded")
    logprob_chunk_tokens: int = Field(1024, ge=0, description="LM-head rows per chunk of the log-prob pass (the "
                                                              "[tokens x vocab] logits never exist whole); 0: all at once")
    gradient_checkpointing: bool = Field(True, description="recompute decoder layers in backward (HF "
                                                           "gradient_checkpointing_enable, non-reentrant)")
    device: str = Field("auto", description="auto (cuda when available, else cpu), cpu, cuda, cuda:N")
    cpu_threads: int = Field(0, ge=0, description="torch CPU threads of the trainer; 0: as the environment says "
                                                  "(the local launcher starts every service with OMP_NUM_THREADS=1)")
    autocast: Literal["auto", "bf16", "fp32"] = Field(
        "auto", description="compute dtype of forward/backward, fp32 master weights always; auto: bf16 on CUDA with "
                            "bf16 support, on CPU for bf16-stored models where the CPU has native bf16")
    push_dtype: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="dtype of pushed weights (the inference engine's); auto: the model folder's stored dtype, "
                            "fp32 for a bf16/fp16 model on a CPU without native bf16 (as inference's dtype auto)")
    max_sequence_tokens: int = Field(0, ge=0, description="a group with a longer prompt + completion is dropped; "
                                                          "0: the model's context")
    packing: bool = Field(True, description="padding-free rows (block-diagonal attention)")
    pack_length: int = Field(0, ge=0, description="packed row length; 0: the longest sequence of the micro-batch")
    share_prompts: bool = Field(True, description="a group's samples share one copy of their prompt in the "
                                                  "forward pass (a prompt tree under a 4-D attention mask; same "
                                                  "log-probs and gradients, prompt tokens computed once per group)")
    # off-policy
    max_staleness: int = Field(-1, ge=-1, description="drop groups more than this many versions old; -1: keep all")
    off_policy_correction: Literal["none", "tis"] = Field("none", description="tis: truncated importance weights")
    tis_cap: float = Field(2.0, ge=1, description="cap of the truncated importance weights")
    # LoRA (PEFT); 0: full fine-tuning
    lora_rank: int = Field(0, ge=0, description="> 0: LoRA adapters (PEFT) of this rank; 0: full fine-tuning")
    shard_parameters: bool = Field(True, description="over several ranks ([learner] ranks > 1): parameters, gradients "
                                   "and optimizer state sharded over the ranks (FSDP2: each decoder layer and the rest "
                                   "one unit); false: every rank holds them whole and the gradients are all-reduced")
    lora_alpha: float = Field(16.0, gt=0, description="LoRA alpha")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="LoRA dropout")
    lora_target_modules: list[str] = Field(["q_proj", "k_proj", "v_proj", "o_proj"],
                                           description="modules that get LoRA adapters")
    lora_modules_to_save: list[str] = Field([], description="trained in full next to the adapters (e.g. "
                                                            "embed_tokens); ties kept")
    lora_adapters: list[str] = Field([], description="per-domain-group adapters: one LoRA adapter of lora_rank per "
                                     "name over the one frozen base; a group trains the adapter it names "
                                     "(RolloutGroup.adapter) and the adapters are pushed as such, not merged "
                                     "([]: one adapter, merged into the pushed weights)")
    seed: int = Field(0, description="RNG seed of the trainer")

    @field_validator("advantage")
    @classmethod
    def _known_advantage(cls, v: str) -> str:
        if v not in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"unknown advantage estimator {v!r}; known: {sorted(ADVANTAGE_ESTIMATORS)}")
        return v

    @field_validator("policy_loss")
    @classmethod
    def _known_policy_loss(cls, v: str) -> str:
        if v not in POLICY_LOSSES:
            raise ValueError(f"unknown policy loss {v!r}; known: {sorted(POLICY_LOSSES)}")
        return v

    @field_validator("kl_estimator")
    @classmethod
    def _known_kl(cls, v: str) -> str:
        if v not in KL_ESTIMATORS:
            raise ValueError(f"unknown KL estimator {v!r}; known: {sorted(KL_ESTIMATORS)}")
        return v

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", v):
            raise ValueError(f"must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {v!r}")
        return v

    @field_validator("dual_clip")
    @classmethod
    def _dual_clip(cls, v: float) -> float:
        if v != 0 and v <= 1:
            raise ValueError(f"must be 0 (off) or > 1, got {v}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> TrainerConfig:
        if self.lr_schedule != "constant" and self.total_steps <= self.warmup_steps:
            raise ValueError(f"total_steps: must be > warmup_steps ({self.warmup_steps}) for lr_schedule "
                             f"{self.lr_schedule!r}, got {self.total_steps}")
        if self.advantage in ("process_grpo", "grpo_process") and self.kl_coef > 0 and self.kl_in == "reward":
            raise ValueError(f"kl_in: {self.advantage} normalises step rewards per group and takes no token rewards; "
                             "use kl_in = 'loss'")
        if self.kl_target > 0 and self.kl_coef <= 0:
            raise ValueError("kl_coef: an adaptive KL (kl_target > 0) needs an initial kl_coef > 0")
        if self.lora_adapters:
            if self.lora_rank <= 0:
                raise ValueError("lora_rank: per-domain-group adapters (lora_adapters) need lora_rank > 0")
            for i, name in enumerate(self.lora_adapters):
                if not ADAPTER_NAME.fullmatch(name):
                    raise ValueError(f"lora_adapters[{i}]: {name!r} must match {ADAPTER_NAME.pattern}")
            if len(set(self.lora_adapters)) != len(self.lora_adapters):
                raise ValueError(f"lora_adapters: names must be unique, got {self.lora_adapters}")
            if self.lora_modules_to_save:
                raise ValueError("lora_modules_to_save: modules trained in full would be shared by every adapter "
                                 "of lora_adapters (no isolation); leave it empty")
        return self


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# ``autocast = "auto"`` on CPU: bf16 for models stored in bf16 (real checkpoints such as SmolLM2, which the
# inference engine serves in bf16 anyway) when the CPU has native bf16 (AVX512-BF16 / AMX), else fp32.
# By the numbers of tests/bench/test_learner_bench.py: SmolLM2, one GRPO step of 8 x 512 tokens on the
# 2-core AVX512-BF16 machine, bf16 autocast 15.6 train tok/s and 3.8 GiB peak RSS vs fp32 8.0 tok/s and
# 4.5 GiB (a loaded machine; same run). fp32-stored models (the tiny test models) keep exact fp32.
def resolve_device(name: str) -> torch.device:
    """``TrainerConfig.device`` -> a torch device; InvalidArgument (field ``device``) if it is absent."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidArgument(f"{name!r} asked for, but this torch build / machine has no CUDA", field="device")
        if (device.index or 0) >= torch.cuda.device_count():
            raise InvalidArgument(f"{name!r}: only {torch.cuda.device_count()} CUDA device(s)", field="device")
    return device


def autocast_dtype(setting: str, device: torch.device, stored: torch.dtype = torch.float32) -> torch.dtype | None:
    """The autocast compute dtype for ``TrainerConfig.autocast`` on ``device`` for a model stored in
    ``stored`` (None: plain fp32)."""
    cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    if setting == "fp32":
        return None
    if setting == "bf16":
        if device.type == "cuda" and not cuda_bf16:
            raise InvalidArgument(f"{device} does not support bf16", field="autocast")
        return torch.bfloat16
    if device.type == "cuda":
        return torch.bfloat16 if cuda_bf16 else None
    return torch.bfloat16 if stored == torch.bfloat16 and cpu_has_native_bf16() else None


def push_dtype(setting: str, device: torch.device, stored: torch.dtype) -> torch.dtype:
    """The dtype weights are pushed in for ``TrainerConfig.push_dtype``. "auto" is the dtype an inference engine
    with ``dtype = "auto"`` serves in: as stored, but fp32 for a half-precision model on a CPU without native
    bf16 (temper.models.dtypes; the rule assumes the engine's CPU is like the learner's, as on one machine)."""
    if setting != "auto":
        return DTYPES[setting]
    if device.type == "cpu" and stored in (torch.bfloat16, torch.float16) and not cpu_has_native_bf16():
        return torch.float32
    return stored


def stored_dtype(model_dir: str | Path) -> torch.dtype:
    """The dtype the model folder's config.json says its weights are stored in (fp32 if unsaid);
    inference engines with ``dtype = "auto"`` serve in this dtype."""
    path = Path(model_dir) / "config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name), None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32


class Critic(torch.nn.Module):
    """Value function: the policy's architecture (initialised from the same weights) with a scalar
    head; V(s_t) is read at the position whose hidden state predicts completion token t."""

    def __init__(self, model_dir: str | Path, gradient_checkpointing: bool = False):
        super().__init__()
        lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        if gradient_checkpointing:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.backbone = lm.get_decoder()
        self.head = torch.nn.Linear(lm.config.hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, mb: ModelInputs) -> torch.Tensor:
        hidden = self.backbone(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                               position_ids=mb.position_ids, use_cache=False).last_hidden_state
        return self.head(hidden[mb.rows, mb.cols]).squeeze(-1)


def _with_lora(model, config: TrainerConfig):
    """``model`` with one LoRA adapter, or one per name of ``lora_adapters`` (initialised in order from the
    trainer's seeded RNG; B = 0: every adapter starts as the base model)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:  # pragma: no cover - peft is a dependency of the project
        raise InvalidArgument("lora_rank > 0 needs PEFT: .venv/bin/pip install peft==0.21.2", field="lora_rank") from e
    lora = LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                      target_modules=list(config.lora_target_modules),
                      modules_to_save=list(config.lora_modules_to_save) or None,
                      ensure_weight_tying=bool(config.lora_modules_to_save))
    names = list(config.lora_adapters) or ["default"]
    model = get_peft_model(model, lora, adapter_name=names[0])
    for name in names[1:]:
        model.add_adapter(name, lora)
    return model


class _PolicyForward(torch.nn.Module):
    """The policy's token log-probs as one module call: sharded (FSDP2), this module is the root unit, so its
    hooks gather the parameters outside the decoder layers (embeddings, final norm, LM head) for the forward
    and reduce-scatter their gradients after the backward, although the LM head is applied in chunks by
    ``temper.learner.logprobs`` rather than called."""

    def __init__(self, model, chunk_tokens: int, softcap):
        super().__init__()
        self.model, self.chunk_tokens, self.softcap = model, chunk_tokens, softcap

    def forward(self, mb: ModelInputs, entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.model.get_decoder()(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                                          position_ids=mb.position_ids, use_cache=False).last_hidden_state
        return logprobs.token_logprobs(self.model.get_output_embeddings(), hidden[mb.rows, mb.cols], mb.targets,
                                       mb.temperatures, self.chunk_tokens, self.softcap, entropy_grad)


def _shard(model, chunk_tokens: int) -> _PolicyForward:
    """FSDP2 over the default process group: each decoder layer one unit, the rest (under the forward module)
    the root unit."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.get_decoder().layers:
        fully_shard(layer)
    root = _PolicyForward(model, chunk_tokens, getattr(model.config, "final_logit_softcapping", None))
    fully_shard(root)
    return root


def _local(t):
    """A DTensor's full value (a collective: every rank calls it), else the tensor."""
    return t.full_tensor() if isinstance(t, DTensor) else t


class Trainer:
    def __init__(self, model_dir: str | Path, config: TrainerConfig):
        torch.manual_seed(config.seed)
        if config.cpu_threads:
            torch.set_num_threads(config.cpu_threads)
        self.config = config
        self.device = resolve_device(config.device)
        stored = stored_dtype(model_dir)
        self.compute_dtype = autocast_dtype(config.autocast, self.device, stored)
        self.push_dtype = push_dtype(config.push_dtype, self.device, stored)
        if self.push_dtype in (torch.bfloat16, torch.float16) and config.lr < 1e-4:
            # measured on SmolLM2 (bf16-stored): one Adam step at lr 1e-5 changed 2.0 % of the pushed bf16 weights
            log.warning("pushing %s weights at lr %g: most updates are below half precision's resolution, so the "
                        "served policy lags the trained one; serve and push fp32 (inference dtype = \"float32\", "
                        "push_dtype = \"fp32\") to train what is served", self.push_dtype, config.lr)
        # fp32 master weights always: autocast only changes the dtype the matmuls compute in
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        if config.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model.to(self.device)
        # a prompt tree needs a custom 4-D attention mask, which flash-attention kernels do not take
        attn = getattr(self.model.config, "_attn_implementation", "eager")
        self.share_prompts = config.share_prompts and attn in ("sdpa", "eager")
        if config.share_prompts and not self.share_prompts:
            log.warning("share_prompts off: attention implementation %r takes no 4-D mask", attn)
        self.lora = config.lora_rank > 0
        self.adapters = list(config.lora_adapters)  # per-domain-group adapters; []: one policy
        if self.lora:
            self.model = _with_lora(self.model, config)
        self.model.train()
        # data parallelism over the ranks of torch.distributed's default group (temper.learner.ranks): rank r runs
        # micro-batches r, r + W, ... of each step and the gradients are summed over the ranks before clipping,
        # so every rank applies the update one rank would. Sharded (FSDP2): each rank keeps 1/W of every
        # parameter, gradient and optimizer moment, the layers gathered for their forward and backward
        self.world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.rank = dist.get_rank() if self.world > 1 else 0
        self.sharded = self.world > 1 and config.shard_parameters
        self._full_weights: dict[str, torch.Tensor] | None = None  # sharded: the gathered weights (rank 0)
        self._forward = None
        if self.world > 1:
            if self.sharded and self.lora:
                raise InvalidArgument("LoRA adapters are not sharded over ranks: shard_parameters = false with "
                                      "lora_rank > 0", field="shard_parameters")
            for t in self.model.state_dict().values():  # the same starting weights everywhere
                dist.broadcast(t, 0)
            if self.sharded:
                self._forward = _shard(self.model, config.logprob_chunk_tokens)
        if self.adapters:  # PEFT leaves only the active adapter trainable; every adapter is
            self.params = [p for n, p in self.model.named_parameters() if ".lora_" in n]
            for p in self.params:
                p.requires_grad_(True)
        else:
            self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr, weight_decay=config.weight_decay)
        self.lr = LRController(config.lr, config.lr_schedule, config.warmup_steps, config.total_steps,
                               config.min_lr_ratio, config.lr_kl_target, config.lr_kl_factor)
        self.kl = KLController(config.kl_coef, config.kl_target, config.kl_horizon)
        # the frozen reference is the initial policy: with LoRA, the base model with the adapter off
        self.reference = None
        if config.kl_coef > 0 and not self.lora:
            self.reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            self.reference.requires_grad_(False)
            self.reference.to(self.device)
        self.critic = self.critic_optimizer = None
        if config.advantage in NEEDS_CRITIC:
            self.critic = Critic(model_dir, config.gradient_checkpointing).train().to(self.device)
            self.critic_optimizer = torch.optim.AdamW(self.critic.parameters(), lr=config.value_lr or config.lr,
                                                      weight_decay=config.weight_decay)
        # step-reward estimators: step ends (characters of the completion) map to tokens with the policy's tokenizer
        self.step_tokens = StepTokens.from_model_dir(model_dir) if config.advantage in NEEDS_STEPS else None
        self.step_count = 0  # updates applied
        self.policy_version = 0  # version of the current weights (= step_count unless bumped by the service)
        self.group_signals: dict[str, dict[str, float]] = {}  # signal -> group id -> value, of the last step
        self.skipped_steps = 0
        self.data_position: dict = {"groups": 0, "samples": 0, "tokens": 0, "last_group_ids": []}
        lm_config = self.model.config
        pad = lm_config.pad_token_id
        self.pad_id = int(pad if pad is not None else 0)
        self.vocab_size = int(lm_config.vocab_size)
        self.context_length = getattr(lm_config, "max_position_embeddings", None)
        # groups with a longer sequence are dropped before training (temper.learner.batching.screen_groups)
        self.max_sequence_tokens = config.max_sequence_tokens or self.context_length or 0
        self.softcap = getattr(lm_config, "final_logit_softcapping", None)
        if self.world > 1 and self.critic is not None:
            raise InvalidArgument(f"advantage {config.advantage!r} trains a critic; a learner over {self.world} "
                                  "ranks trains critic-free estimators only (grpo, rloo, ...)", field="ranks")
        self._gather_weights()
        self._set_lr()

    # -- forward passes ----------------------------------------------------------------------
    def _autocast(self) -> AbstractContextManager:
        if self.compute_dtype is None:
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype)

    def _logprobs(self, model, mb: ModelInputs, entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(log p of each completion token [t], entropy of each predicting distribution [t]), fp32, on the device."""
        mb = mb.to(self.device)
        if model is self.model and self.adapters:
            self._use_adapter(mb.adapter)
        if model is self.model and self._forward is not None:  # through the FSDP root: its hooks gather the rest
            with self._autocast():
                return self._forward(mb, entropy_grad)
        with self._autocast():
            hidden = model.get_decoder()(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                                         position_ids=mb.position_ids, use_cache=False).last_hidden_state
            return logprobs.token_logprobs(model.get_output_embeddings(), hidden[mb.rows, mb.cols], mb.targets,
                                           mb.temperatures, self.config.logprob_chunk_tokens, self.softcap,
                                           entropy_grad)

    def _use_adapter(self, name: str) -> None:
        """Make ``name`` the adapter the next forward runs (and trains: PEFT marks only the active adapter
        trainable; the gradients other adapters collected this step stay)."""
        require(name in self.adapters, "adapter", f"{name!r} is not one of the learner's adapters {self.adapters}")
        if name != self.model.active_adapter:
            self.model.set_adapter(name)

    def _values(self, mb: ModelInputs) -> torch.Tensor:
        with self._autocast():
            return self.critic(mb.to(self.device)).float()

    @torch.no_grad()
    def _reference_logprobs(self, mbs: list[ModelInputs]) -> torch.Tensor:
        if self.lora:
            with self.model.disable_adapter():
                return torch.cat([self._logprobs(self.model, mb)[0] for mb in mbs])
        return torch.cat([self._logprobs(self.reference, mb)[0] for mb in mbs])

    def _micro_batches(self, batch: Batch) -> list[ModelInputs]:
        cfg = self.config
        return micro_batches(batch, self.pad_id, cfg.packing, cfg.pack_length, cfg.micro_batch_tokens,
                             self.share_prompts)

    def token_logprobs(self, batch: Batch) -> torch.Tensor:
        """Teacher-forced log p of every completion token under the current weights, [T] in batch order."""
        self._check_adapters(batch)
        return torch.cat([self._logprobs(self.model, mb)[0] for mb in self._micro_batches(batch)]).cpu()

    def _check_adapters(self, batch: Batch) -> None:
        """InvalidArgument naming ``adapters[i]`` unless every sequence names one of the learner's adapters
        (per-domain-group adapters), or none does (one policy)."""
        names = batch.adapters if batch.adapters is not None else [""] * len(batch.completions)
        for i, name in enumerate(names):
            if self.adapters:
                require(name in self.adapters, f"adapters[{i}]",
                        f"{name!r} is not one of the learner's adapters {self.adapters}")
            else:
                require(not name, f"adapters[{i}]", f"{name!r}: this learner trains one policy (no lora_adapters)")

    def _by_adapter(self, batch: Batch) -> Batch:
        """``batch`` with each adapter's sequences together (groups in their order within an adapter), so
        micro-batches never mix adapters."""
        if batch.adapters is None:
            return batch
        rank = {name: i for i, name in enumerate(self.adapters)}
        order = sorted(range(len(batch.adapters)), key=lambda i: (rank[batch.adapters[i]], i))
        return batch if order == list(range(len(order))) else batch.subset(order)

    # -- the update --------------------------------------------------------------------------
    def drop_stale(self, batch: Batch) -> tuple[Batch, int]:
        """Drop whole groups with a sample more than ``max_staleness`` versions behind the current weights."""
        if self.config.max_staleness < 0:
            return batch, 0
        staleness = self.policy_version - batch.policy_versions
        stale_groups = set(batch.group_index[staleness > self.config.max_staleness].tolist())
        if not stale_groups:
            return batch, 0
        keep = [i for i, g in enumerate(batch.group_index.tolist()) if g not in stale_groups]
        if not keep:
            raise InvalidArgument(f"all {len(stale_groups)} groups are more than max_staleness="
                                  f"{self.config.max_staleness} versions behind policy version {self.policy_version}",
                                  field="policy_version")
        return batch.subset(keep), len(stale_groups)

    def _skip(self, message: str) -> InvalidArgument:
        self.optimizer.zero_grad(set_to_none=True)
        if self.critic_optimizer is not None:
            self.critic_optimizer.zero_grad(set_to_none=True)
        self.skipped_steps += 1
        return InvalidArgument(f"{message}; step skipped", field="batch")

    def _set_lr(self) -> float:
        lr = self.lr.lr(self.step_count)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def step(self, batch: Batch) -> dict[str, float]:
        t0 = time.perf_counter()
        cfg = self.config
        dev = self.device
        if self.world > 1 and self.rank == 0:  # the followers train the same batch (temper.learner.ranks), from
            # the same policy version (the service may have bumped rank 0's): the same stale groups drop everywhere
            tell(("step", batch, self.policy_version))
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        batch.validate(self.vocab_size, self.context_length)
        self._check_adapters(batch)
        staleness = (self.policy_version - batch.policy_versions).float()
        batch, stale_groups = self.drop_stale(batch)
        batch = self._by_adapter(batch)
        lengths = batch.lengths
        n_seqs, n_tokens = len(lengths), int(lengths.sum())
        mbs = self._micro_batches(batch)

        def agg(mb: ModelInputs) -> Aggregation:
            return Aggregation(cfg.loss_aggregation, mb.lengths.to(dev), n_tokens, n_seqs)

        kl_fn = KL_ESTIMATORS[cfg.kl_estimator]
        ref_logprobs = self._reference_logprobs(mbs) if cfg.kl_coef > 0 else None
        old_values = None
        if self.critic is not None:
            with torch.no_grad():
                old_values = torch.cat([self._values(mb) for mb in mbs])
        token_rewards = None
        if ref_logprobs is not None and cfg.kl_in == "reward":
            token_rewards = -self.kl.coef * kl_fn(batch.old_logprobs, ref_logprobs.cpu())
        # advantages: small [B]/[T] bookkeeping on the CPU; the per-token loss terms then move to the device
        advantages, returns = ADVANTAGE_ESTIMATORS[cfg.advantage](
            algos.AdvantageInputs(batch.rewards, batch.group_index, lengths, token_rewards,
                                  None if old_values is None else old_values.cpu(), **batch.step_inputs()),
            gamma=cfg.gamma, lam=cfg.lam, eps=cfg.advantage_eps)
        advantages = advantages.to(torch.float32)
        seq_group = batch.group_index
        token_group = seq_group.repeat_interleave(lengths)
        n_groups = int(seq_group.max()) + 1
        # the last epoch's per-token policy loss without sample weights: the "loss" priority signal
        loss_tokens = torch.zeros_like(advantages)
        # importance weights of the groups' draws, per token, multiplied into the policy loss
        sample_weights = batch.sample_weights[token_group].to(dev) if batch.sample_weights is not None else None
        adv_dev, old_all = advantages.to(dev), batch.old_logprobs.to(dev, torch.float32)
        returns_dev = None if returns is None else returns.to(dev)
        lr = self._set_lr()
        pre_update: dict[int, torch.Tensor] = {}  # epoch 0's logprobs: the weights before this step
        metrics: dict[str, float] = {}
        mine: list[tuple[int | None, ModelInputs]] = [(i, mb) for i, mb in enumerate(mbs) if i % self.world == self.rank]
        if self.sharded:  # every rank the same number of forward/backward passes (their collectives pair up)
            smallest = min(mbs, key=lambda m: m.real_tokens)
            mine += [(None, smallest)] * (-(-len(mbs) // self.world) - len(mine))
        scale = float(self.world) if self.sharded else 1.0  # FSDP averages the gradients over the ranks: a sum
        for epoch in range(cfg.epochs):
            self.optimizer.zero_grad(set_to_none=True)
            sums: dict[str, float] = {}
            bad = ""
            for i, mb in mine:
                if i is None:  # no micro-batch left for this rank: a pass that adds nothing, for the collectives
                    self._logprobs(self.model, mb)[0].sum().mul(0.0).backward()
                    continue
                share = mb.lengths.sum().item() / n_tokens
                logprobs, entropy = self._logprobs(self.model, mb, entropy_grad=cfg.entropy_coef > 0)
                old = old_all[mb.tokens]
                if epoch == 0:
                    pre_update[i] = logprobs.detach()
                ratio_base, is_weights = old, None
                if cfg.off_policy_correction == "tis":
                    ratio_base = pre_update[i]
                    is_weights = torch.exp(ratio_base - old).clamp(max=cfg.tis_cap)
                a = agg(mb)
                loss_weights = is_weights
                if sample_weights is not None:
                    w = sample_weights[mb.tokens]
                    loss_weights = w if is_weights is None else is_weights * w
                policy_agg = replace(a, kept=[]) if epoch == cfg.epochs - 1 else a
                policy_loss, info = POLICY_LOSSES[cfg.policy_loss](
                    logprobs, ratio_base, adv_dev[mb.tokens], agg=policy_agg, clip_low=cfg.clip_low,
                    clip_high=cfg.clip_high, dual_clip=cfg.dual_clip, is_weights=loss_weights)
                if policy_agg.kept:  # the per-token terms, the sample weights divided out (weight 0: 0)
                    terms = policy_agg.kept[0]
                    if sample_weights is not None:
                        w = sample_weights[mb.tokens]
                        terms = torch.where(w > 0, terms / w.clamp(min=1e-30), torch.zeros_like(terms))
                    loss_tokens[mb.tokens] = terms.float().cpu()
                loss = policy_loss
                if ref_logprobs is not None:
                    kl_tokens = kl_fn(logprobs, ref_logprobs[mb.tokens])
                    if cfg.kl_in == "loss":
                        loss = loss + self.kl.coef * a(kl_tokens)
                    info["kl_ref"] = kl_tokens.detach().mean().item()
                if cfg.entropy_coef > 0:
                    loss = loss - cfg.entropy_coef * a(entropy)
                if not torch.isfinite(loss):
                    bad = "non-finite loss"
                    if not self.sharded:
                        break
                (loss * scale).backward()
                with torch.no_grad():
                    info["entropy"] = entropy.detach().mean().item()
                    info["approx_kl"] = (old - logprobs.detach()).mean().item()
                    # |behaviour - learner| per token: on-policy, the training / inference mismatch (first order,
                    # where approx_kl is second); with lag it includes the staleness
                    info["logprob_diff_abs_mean"] = (old - logprobs.detach()).abs().mean().item()
                    if is_weights is not None:
                        info["is_weight_mean"] = is_weights.mean().item()
                        info["is_weight_truncated"] = (torch.exp(ratio_base - old) > cfg.tis_cap).float().mean().item()
                info["loss"], info["policy_loss"] = loss.item(), policy_loss.item()
                for k, v in info.items():
                    sums[k] = sums.get(k, 0.0) + v * (1.0 if k in ("loss", "policy_loss") else share)
            if self.world > 1:
                bad, sums = self._reduce_ranks(bad, sums)
            if bad:
                raise self._skip(bad)
            grad_norm = _local(torch.nn.utils.clip_grad_norm_(self.params, cfg.max_grad_norm))
            if not torch.isfinite(grad_norm):
                raise self._skip("non-finite gradient")
            self.optimizer.step()
            if self.critic is not None:
                sums.update(self._critic_step(mbs, old_values, returns_dev, agg))
            metrics = {**sums, "grad_norm": float(grad_norm)}
        if self.world > 1:  # each rank filled its own micro-batches' tokens
            dist.all_reduce(loss_tokens)
        # per-group priority signals for prioritized replay (the loop sends the configured one)
        signals = algos.group_priorities(advantages, loss_tokens, token_group, n_groups)
        self.group_signals = {name: dict(zip(batch.group_ids or [], values.tolist())) for name, values in signals.items()}
        # groups trained on, and those without a learning signal (every advantage 0: all-equal rewards)
        metrics["groups"] = float(n_groups)
        metrics["zero_signal_groups"] = float((signals["mean_abs_advantage"] == 0).sum())
        if cfg.lr_kl_target > 0:  # how far this step moved the policy: KL(pi_before || pi_after), k3
            with torch.no_grad():
                after = [(i, self._logprobs(self.model, mb)[0]) for i, mb in mine]  # dummies too: collectives
                kl_sum = torch.tensor([sum(algos.kl_k3(pre_update[i], lp).sum().item() for i, lp in after
                                           if i is not None)], dtype=torch.float64)
            if self.world > 1:
                dist.all_reduce(kl_sum)
            metrics["update_kl"] = kl_sum.item() / n_tokens
            self.lr.observe_kl(metrics["update_kl"])
        if ref_logprobs is not None:
            self.kl.update(metrics.get("kl_ref", 0.0), n_seqs)
        self.step_count += 1
        self.policy_version += 1
        self._gather_weights()
        self._advance_data_position(batch, n_tokens)
        seconds = time.perf_counter() - t0
        real = sum(mb.real_tokens for mb in mbs)
        grid = sum(mb.grid_tokens for mb in mbs)
        metrics.update(
            lr=lr, lr_scale=self.lr.scale, kl_coef=self.kl.coef,
            advantage_mean=advantages.mean().item(),
            advantage_std=advantages.std().item() if advantages.numel() > 1 else 0.0,
            advantage_min=advantages.min().item(), advantage_max=advantages.max().item(),
            staleness_mean=staleness.mean().item(), staleness_max=staleness.max().item(),
            stale_groups_dropped=float(stale_groups), tokens=float(n_tokens), input_tokens=float(real),
            padding_fraction=1.0 - real / grid, micro_batches=float(len(mbs)), train_seconds=seconds,
            tokens_per_second=real * cfg.epochs / seconds)
        # memory high-water marks: the device allocator's for this step on CUDA; on CPU the process's
        # peak RSS so far (getrusage: it only grows, so a step's own peak shows where it is the largest)
        if dev.type == "cuda":
            metrics["peak_memory_bytes"] = float(torch.cuda.max_memory_allocated(dev))
        metrics["peak_rss_bytes"] = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        if returns is not None:
            metrics["return_mean"] = returns.mean().item()
        if batch.step_rewards is not None:  # how much of the batch the step-reward estimator saw as steps
            metrics["step_reward_trajectories"] = float(sum(1 for r in batch.step_rewards if r))
            metrics["step_rewards"] = float(sum(len(r) for r in batch.step_rewards))
        return metrics

    def _reduce_ranks(self, bad: str, sums: dict[str, float]) -> tuple[str, dict[str, float]]:
        """Sum the gradients (unsharded: one flat buffer; sharded, FSDP reduce-scattered them already) and the
        metric sums over the ranks; a rank's non-finite loss skips the step on every rank."""
        if not self.sharded:
            # a parameter no rank's micro-batches reached (an adapter no group of this step names) keeps no
            # gradient, as on one rank: AdamW then leaves it exactly as it is (a zero gradient would move it)
            touched = [float(p.grad is not None) for p in self.params]
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            flat = torch.cat([p.grad.reshape(-1) for p in self.params])
            touched = torch.tensor(touched, device=flat.device)  # nccl reduces device tensors only
            dist.all_reduce(flat)
            dist.all_reduce(touched)
            offset = 0
            for p, used in zip(self.params, touched.tolist()):
                n = p.numel()
                p.grad = flat[offset:offset + n].view_as(p) if used else None  # views of the summed buffer
                offset += n
        gathered: list = [None] * self.world
        dist.all_gather_object(gathered, (bad, sums))
        total: dict[str, float] = {}
        for _, part in gathered:
            for k, v in part.items():
                total[k] = total.get(k, 0.0) + v
        return next((b for b, _ in gathered if b), ""), total

    def _critic_step(self, mbs: list[ModelInputs], old_values: torch.Tensor, returns: torch.Tensor, agg
                     ) -> dict[str, float]:
        self.critic_optimizer.zero_grad(set_to_none=True)
        out = {"value_loss": 0.0, "value_clip_fraction": 0.0, "value_mean": 0.0}
        n_tokens = len(returns)
        for mb in mbs:
            values = self._values(mb)
            loss, info = algos.clipped_value_loss(values, old_values[mb.tokens], returns[mb.tokens].to(values.dtype),
                                                  self.config.value_clip, agg(mb))
            if not torch.isfinite(loss):
                raise self._skip("non-finite value loss")
            loss.backward()
            share = len(values) / n_tokens
            out["value_loss"] += loss.item()
            out["value_clip_fraction"] += info["value_clip_fraction"] * share
            out["value_mean"] += values.detach().mean().item() * share
        grad_norm = torch.nn.utils.clip_grad_norm_(self.critic.parameters(), self.config.max_grad_norm)
        if not torch.isfinite(grad_norm):
            raise self._skip("non-finite value gradient")
        self.critic_optimizer.step()
        out["value_grad_norm"] = float(grad_norm)
        return out

    def _advance_data_position(self, batch: Batch, n_tokens: int) -> None:
        pos = self.data_position
        pos["groups"] += int(batch.group_index.max()) + 1
        pos["samples"] += len(batch.completions)
        pos["tokens"] += n_tokens
        pos["last_group_ids"] = list(batch.group_ids or [])

    # -- weights -----------------------------------------------------------------------------
    def push_weights(self) -> dict[str, torch.Tensor]:
        """``weights()`` cast to the inference engine's dtype (``push_dtype``), ready to chunk."""
        return {n: t.to(self.push_dtype) for n, t in self.weights().items()}

    def _gather_weights(self) -> None:
        """Sharded: the whole weights, gathered on every rank (a collective) and kept by rank 0 for pushes and
        exports until the next step."""
        if not self.sharded:
            return
        full = {n: _local(p.detach()) for n, p in self.model.named_parameters()}
        self._full_weights = full if self.rank == 0 else None

    def weights(self) -> dict[str, torch.Tensor]:
        """The policy's tensors under the base model's names (LoRA adapters merged in). Per-domain-group adapters:
        only the adapters (the base is frozen), each tensor as ``adapters/<name>/<PEFT key>`` with the LoRA
        scaling (alpha / r) folded into lora_B, so a loader applies them with scaling 1."""
        if self.adapters:
            return self.adapter_weights()
        if self.sharded:
            if self._full_weights is None:
                raise FailedPrecondition("the weights of a sharded learner are gathered on rank 0 only", field="rank")
            return self._full_weights
        if not self.lora:
            return {n: p.detach() for n, p in self.model.named_parameters()}
        merged = {}
        modules = dict(self.model.named_modules())
        adapter = self.model.active_adapter
        for name, p in self.model.named_parameters():
            if ".lora_" in name or ".original_module." in name:
                continue
            base = name.removeprefix("base_model.model.").replace(f".modules_to_save.{adapter}.", ".")
            tensor = p.detach()
            if ".base_layer." in name:
                base = base.replace(".base_layer.", ".")
                owner = modules[name.rsplit(".base_layer.", 1)[0]]
                if name.endswith(".base_layer.weight") and adapter in getattr(owner, "lora_A", {}):
                    with torch.no_grad():
                        tensor = tensor + owner.get_delta_weight(adapter)
            merged[base] = tensor
        return merged

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        """The per-domain-group adapters as pushed (``weights``); {} without them."""
        if not self.adapters:
            return {}
        from peft import get_peft_model_state_dict

        scale = self.config.lora_alpha / self.config.lora_rank
        out = {}
        for name in self.adapters:
            for key, t in get_peft_model_state_dict(self.model, adapter_name=name).items():
                out[f"{ADAPTER_PREFIX}{name}/{key}"] = t.detach() * scale if ".lora_B." in key else t.detach()
        return out

    def base_weights(self) -> dict[str, torch.Tensor]:
        """The frozen base model's tensors under their HF names (per-domain-group adapters: what the adapters
        apply to); with one policy, ``weights``."""
        if not self.adapters:
            return self.weights()
        return {name.removeprefix("base_model.model.").replace(".base_layer.", "."): p.detach()
                for name, p in self.model.named_parameters() if ".lora_" not in name}
