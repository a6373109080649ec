"""Checkpoints of a Trainer as safetensors and JSON (no pickle), written atomically.

A checkpoint directory holds:
  model.safetensors             policy parameters (LoRA adapters included)
  optimizer.safetensors/.json   AdamW state tensors / hyper-parameters, flattened by torch (keyed by parameter name)
  shards/                       instead of the two above, from a learner sharded over ranks (FSDP2): each rank's
                                shards of parameters and moments (torch.distributed.checkpoint), read back at any
                                number of ranks, one included (each rank reads what it keeps)
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
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, load_model, save_file, save_model
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from temper.learner.ranks import tell
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
# a sharded learner (FSDP2) restoring a whole checkpoint: every rank reads the whole state and keeps its shard
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def _save_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, out: Path, stem: str) -> None:
    flat = get_optimizer_state_dict(model, optimizer, options=_FLAT)
    save_file({k: v.contiguous() for k, v in flat.items() if isinstance(v, torch.Tensor)},
              str(out / f"{stem}.safetensors"))
    (out / f"{stem}.json").write_text(json.dumps({k: v for k, v in flat.items() if not isinstance(v, torch.Tensor)}))


def _load_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, src: Path, stem: str,
                    sharded: bool = False) -> None:
    flat: dict = json.loads((src / f"{stem}.json").read_text())
    for key, value in flat.items():
        if key.endswith(".betas"):  # JSON has no tuples; torch saves betas as one
            flat[key] = tuple(value)
    flat.update(load_file(str(src / f"{stem}.safetensors")))
    if sharded:  # torch reads a flat state back only unsharded: nested by parameter name, then sharded
        set_optimizer_state_dict(model, optimizer, _nested(flat), options=_FULL)
    else:
        set_optimizer_state_dict(model, optimizer, flat, options=_FLAT)


def _nested(flat: dict) -> dict:
    """torch's flat optimizer state ("state.<name>.<key>", "param_groups.<name>.<key>") as its nested form keyed
    by parameter name: {"state": {name: {key: value}}, "param_groups": [{key: value, "params": [names]}]}."""
    state: dict[str, dict] = {}
    per_param: dict[str, dict] = {}
    for key, value in flat.items():
        kind, _, rest = key.partition(".")
        name, _, field = rest.rpartition(".")
        (state if kind == "state" else per_param).setdefault(name, {})[field] = value
    groups: list[dict] = []
    for name, hyper in per_param.items():  # parameters with the same hyper-parameters share a group
        for g in groups:
            if {k: v for k, v in g.items() if k != "params"} == hyper:
                g["params"].append(name)
                break
        else:
            groups.append({**hyper, "params": [name]})
    return {"state": state, "param_groups": groups}


def _sharded_state(trainer) -> dict:
    """The model's and optimizer's state as torch.distributed.checkpoint reads and writes it (sharded ranks:
    each rank's shards; one rank: whole tensors)."""
    return {"model": get_model_state_dict(trainer.model),
            "optimizer": get_optimizer_state_dict(trainer.model, trainer.optimizer)}


def save(trainer, directory: str | Path) -> Path:
    """Write ``trainer``'s full state to ``directory`` (which must not exist yet, or be empty). Sharded over
    ranks: rank 0 asks the followers to take part and every rank writes its own shards of the parameters and
    optimizer moments (``shards/``, torch.distributed.checkpoint); rank 0 writes the rest."""
    final = Path(directory)
    sharded = getattr(trainer, "sharded", False)
    # sharded: one temporary folder every rank can name (the followers write into it before rank 0 renames it)
    tmp = final.parent / f".{final.name}.tmp-{'shards' if sharded else os.getpid()}"
    if not sharded or trainer.rank == 0:
        if final.exists() and any(final.iterdir()):
            raise InvalidArgument(f"{final} exists and is not empty", field="path")
        final.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    if sharded:
        if trainer.rank == 0:
            tell(("save", str(directory)))
        dcp.save(_sharded_state(trainer), storage_writer=dcp.FileSystemWriter(str(tmp / "shards")))
        if trainer.rank != 0:
            return final
    else:
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
        tell(("load", str(src)))
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
    if (src / "shards").is_dir():  # written by sharded ranks: each rank reads what it keeps, at any world size
        state = _sharded_state(trainer)
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(src / "shards")),
                 no_dist=not (dist.is_available() and dist.is_initialized()))  # one process: no group needed
        set_model_state_dict(trainer.model, state["model"])
        set_optimizer_state_dict(trainer.model, trainer.optimizer, state["optimizer"])
    elif getattr(trainer, "sharded", False):  # a whole checkpoint: every rank reads it and keeps its shard
        set_model_state_dict(trainer.model, load_file(str(src / "model.safetensors")), options=_FULL)
        _load_optimizer(trainer.model, trainer.optimizer, src, "optimizer", sharded=True)
    else:
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
    if getattr(trainer, "sharded", False):
        trainer._gather_weights()  # rank 0 pushes the restored weights
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


def version_of(directory: str | Path) -> int | None:
    """The policy version a checkpoint directory holds (None: no complete checkpoint there)."""
    meta = Path(directory) / "trainer.json"
    return int(json.loads(meta.read_text())["policy_version"]) if meta.exists() else None


def prune(root: str | Path, keep: int) -> None:
    """Delete all but the ``keep`` newest ``step-*`` checkpoints under ``root`` (never the latest)."""
    if keep <= 0:
        return
    current = latest(root)
    steps = sorted(p for p in Path(root).glob("step-*") if p.is_dir())
    for p in steps[:-keep]:
        if current is None or p.resolve() != current.resolve():
            shutil.rmtree(p, ignore_errors=True)
