"""Checkpoints of a Trainer as safetensors and JSON (no pickle), written atomically.

A checkpoint directory holds:
  model.safetensors             policy parameters (LoRA adapters included)
  optimizer.safetensors/.json   AdamW state tensors / hyper-parameters, flattened by torch (keyed by parameter name)
  critic*.safetensors/.json     the critic and its optimiser (GAE only)
  rng.safetensors               torch's CPU RNG state
  trainer.json                  step, policy version, skipped steps, LR and KL controller state,
                                data position (groups/samples/tokens consumed, last group ids), config
It is written under a temporary name and renamed into place; ``<root>/latest`` names the newest
complete one and is replaced atomically, so a crash mid-write never leaves a half checkpoint
that resume would pick. Restoring one and taking the next step is bit-identical to never having
stopped (same weights, moments, step counters, LR, KL coefficient and RNG).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, load_model, save_file, save_model
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict

from temper.runtime.errors import FailedPrecondition, InvalidArgument

FORMAT = 2  # 2: optimizer state keyed by parameter name (torch's flattening); 1 is not read
LATEST = "latest"
# config fields that change the shape of what is stored: a checkpoint made with others cannot be loaded
STRUCTURAL = ("lora_rank", "lora_target_modules", "advantage")


# torch's own flattening of an optimizer's state (torch.distributed.checkpoint.state_dict): keys
# "state.<parameter name>.<key>" (exp_avg, exp_avg_sq, step) and "param_groups.<parameter name>.<key>"
# (lr, betas, ...), keyed by parameter name rather than by position, so it is checked against the
# model it is loaded into. Tensors go to safetensors, the rest (hyper-parameters) to JSON.
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _save_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, out: Path, stem: str) -> None:
    flat = get_optimizer_state_dict(model, optimizer, options=_FLAT)
    save_file({k: v.contiguous() for k, v in flat.items() if isinstance(v, torch.Tensor)},
              str(out / f"{stem}.safetensors"))
    (out / f"{stem}.json").write_text(json.dumps({k: v for k, v in flat.items() if not isinstance(v, torch.Tensor)}))


def _load_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, src: Path, stem: str) -> None:
    flat: dict = json.loads((src / f"{stem}.json").read_text())
    for key, value in flat.items():
        if key.endswith(".betas"):  # JSON has no tuples; torch saves betas as one
            flat[key] = tuple(value)
    flat.update(load_file(str(src / f"{stem}.safetensors")))
    set_optimizer_state_dict(model, optimizer, flat, options=_FLAT)


def save(trainer, directory: str | Path) -> Path:
    """Write ``trainer``'s full state to ``directory`` (which must not exist yet, or be empty)."""
    final = Path(directory)
    if final.exists() and any(final.iterdir()):
        raise InvalidArgument(f"{final} exists and is not empty", field="path")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_model(trainer.model, str(tmp / "model.safetensors"))
    _save_optimizer(trainer.model, trainer.optimizer, tmp, "optimizer")
    if trainer.critic is not None:
        save_model(trainer.critic, str(tmp / "critic.safetensors"))
        _save_optimizer(trainer.critic, trainer.critic_optimizer, tmp, "critic_optimizer")
    save_file({"cpu": torch.get_rng_state()}, str(tmp / "rng.safetensors"))
    (tmp / "trainer.json").write_text(json.dumps({
        "format": FORMAT, "step": trainer.step_count, "policy_version": trainer.policy_version,
        "skipped_steps": trainer.skipped_steps, "lr_controller": trainer.lr.state_dict(),
        "kl_controller": trainer.kl.state_dict(), "data_position": trainer.data_position,
        "config": trainer.config.model_dump()}, indent=1))
    if final.exists():
        final.rmdir()
    os.replace(tmp, final)
    return final


def load(trainer, directory: str | Path) -> dict:
    """Restore ``trainer`` from ``directory``; returns the checkpoint's trainer.json."""
    src = Path(directory)
    if getattr(trainer, "world", 1) > 1 and trainer.rank == 0:  # the followers restore the same folder
        dist.broadcast_object_list([("load", str(src))], src=0)
    meta_path = src / "trainer.json"
    if not meta_path.exists():
        raise FailedPrecondition(f"{src} is not a checkpoint (no trainer.json)", field="path")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != FORMAT:
        raise FailedPrecondition(f"checkpoint format {meta.get('format')} is not {FORMAT}", field="path")
    for key in STRUCTURAL:
        saved, now = meta["config"].get(key), getattr(trainer.config, key)
        if saved != now:
            raise FailedPrecondition(f"checkpoint was made with {key}={saved!r}, this learner has {now!r}", field=key)
    load_model(trainer.model, str(src / "model.safetensors"), strict=True)
    _load_optimizer(trainer.model, trainer.optimizer, src, "optimizer")
    if trainer.critic is not None:
        load_model(trainer.critic, str(src / "critic.safetensors"), strict=True)
        _load_optimizer(trainer.critic, trainer.critic_optimizer, src, "critic_optimizer")
    torch.set_rng_state(load_file(str(src / "rng.safetensors"))["cpu"])
    trainer.step_count = int(meta["step"])
    trainer.policy_version = int(meta["policy_version"])
    trainer.skipped_steps = int(meta["skipped_steps"])
    trainer.lr.load_state_dict(meta["lr_controller"])
    trainer.kl.load_state_dict(meta["kl_controller"])
    trainer.data_position = meta["data_position"]
    return meta


def mark_latest(root: str | Path, directory: str | Path) -> None:
    """Point ``<root>/latest`` at ``directory`` (atomic replace)."""
    root = Path(root)
    tmp = root / f".{LATEST}.tmp-{os.getpid()}"
    tmp.write_text(str(Path(directory).resolve()))
    os.replace(tmp, root / LATEST)


def latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root``, or None."""
    pointer = Path(root) / LATEST
    if not pointer.exists():
        return None
    path = Path(pointer.read_text().strip())
    return path if (path / "trainer.json").exists() else None


def step_of(directory: str | Path) -> int:
    """The trainer step a checkpoint directory holds."""
    return int(json.loads((Path(directory) / "trainer.json").read_text())["step"])


def prune(root: str | Path, keep: int) -> None:
    """Delete all but the ``keep`` newest ``step-*`` checkpoints under ``root`` (never the latest)."""
    if keep <= 0:
        return
    current = latest(root)
    steps = sorted(p for p in Path(root).glob("step-*") if p.is_dir())
    for p in steps[:-keep]:
        if current is None or p.resolve() != current.resolve():
            shutil.rmtree(p, ignore_errors=True)
