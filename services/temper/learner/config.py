"""Configuration of the learner service (the ``[learner]`` table): the service's own settings plus
every field of ``TrainerConfig`` (algorithms, clipping, KL, LR schedule, micro-batching, packing,
off-policy correction, LoRA); unknown algorithm names are refused at start-up with the field named."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from temper.learner.algos import NEEDS_CRITIC
from temper.learner.trainer import TrainerConfig
from temper.runtime.config import ServiceConfig, address_of, from_job, model_dir, shared_dir


class LearnerConfig(ServiceConfig, TrainerConfig):
    section = "learner"

    model_dir: str = model_dir(".temper/models/tiny", "folder of the HF causal LM to train (the launcher: the job's "
                                                      "[model])")
    replay_address: str = address_of("replay", "127.0.0.1:50054", "host:port of the replay service; several "
                                     "(a:p,b:q or ipv4:a:p,b:q): replay shards, sampled as one table "
                                     "(temper.client.shards)")
    inference_addresses: list[str] = address_of("inference", ["127.0.0.1:50051"],
                                                "inference replicas that get the weights after each step: "
                                                "host:port entries, or targets re-resolved before every push "
                                                "(dns:///inference-headless:50051 = every pod of a headless "
                                                "Service; temper.client.discovery)")
    policy_dir: str = shared_dir("policy", "", "folder where each version is stored before it is pushed, which an "
                                 "inference replica that starts late or restarts loads before SERVING (the "
                                 "inference's policy_dir; shared storage in a cluster); \"\": none")
    lora_adapters: list[str] = from_job("adapters", [], "per-domain-group LoRA adapters (TrainerConfig.lora_adapters; "
                                        "the launcher: the names of the job's [job.adapters] table)")
    groups_per_step: int = from_job("prompts_per_step", 16, "GRPO groups per update (the launcher: "
                                                            "[job].prompts_per_step)")
    ranks: int = Field(1, ge=1, le=64, description="data-parallel ranks on this host: the service is rank 0 and "
                       "starts ranks - 1 followers; each step's micro-batches are split over them and the gradients "
                       "summed (temper.learner.ranks; gloo on CPU, nccl on CUDA). Started by torchrun (several "
                       "hosts), the ranks are torchrun's: 1 or torchrun's world")
    table: str = Field("default", description="the replay table the learner samples")
    sample_lease_seconds: float = Field(60.0, ge=0, le=86_400, description="> 0: each batch is sampled with a "
                                        "replay lease of this length, renewed every third of it while its step runs "
                                        "and acknowledged after it, so a learner killed mid-step loses no group "
                                        "(replay gives the batch back when the lease runs out, to the restarted "
                                        "learner: at least once); 0: draws final at once (a learner killed "
                                        "mid-step loses its batch)")
    checkpoint_dir: str = Field("", description='"": <data_dir>/checkpoints')
    checkpoint_every: int = Field(0, description="steps between checkpoints; 0: only on request (gRPC Checkpoint)")
    keep_checkpoints: int = Field(3, description="newest checkpoints kept")
    resume: bool = Field(True, description="restore the newest checkpoint of checkpoint_dir at start-up")
    # what each sampled group's priority becomes after a step (prioritized tables): "none" sends
    # nothing; "mean_abs_advantage" = mean |advantage| over the group's tokens (0 for a group whose
    # rewards are all equal: it teaches nothing, so a prioritized table stops drawing it); "loss" =
    # mean |per-token policy loss| of the group in the step's last epoch, sample weights divided out
    # (temper.learner.algos.group_priorities)
    priority_signal: Literal["none", "mean_abs_advantage", "loss"] = Field(
        "none", description="per-group priority sent to replay after each step")
    checkpoint_url: str = Field("", description="object storage (s3://bucket/prefix or a path) every checkpoint is "
                                                "uploaded to; a learner whose checkpoint_dir is empty (a new pod) "
                                                "resumes from its newest one; \"\" = checkpoint_dir only")
    dependency_wait_seconds: float = Field(120.0, description="at start-up, how long to wait for inference replicas "
                                                              "that are still starting before resuming")

    @model_validator(mode="after")
    def _ranks_without_critic(self):
        self.check_world(self.ranks)
        return self

    def check_world(self, world: int) -> None:
        """What a learner over ``world`` ranks cannot train (ValueError naming the field); torchrun's world is
        checked by the service, the configured ``ranks`` here."""
        if world > 1 and self.advantage in NEEDS_CRITIC:
            raise ValueError(f"ranks: {world} ranks train critic-free estimators only; advantage "
                             f"{self.advantage!r} trains a critic (use ranks = 1, or grpo, rloo, ...)")
        if world > 1 and self.shard_parameters and self.lora_rank > 0:
            raise ValueError("shard_parameters: LoRA adapters are not sharded over ranks; with lora_rank > 0 and "
                             "ranks > 1 set shard_parameters = false")

    def checkpoint_folder(self) -> Path:
        """Where checkpoints go: ``checkpoint_dir``, else ``<data_dir>/checkpoints``."""
        return Path(self.checkpoint_dir) if self.checkpoint_dir else Path(self.data_dir) / "checkpoints"

    def trainer_config(self) -> TrainerConfig:
        return TrainerConfig(**self.model_dump(include=set(TrainerConfig.model_fields)))
