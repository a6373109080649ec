"""Per-domain-group LoRA adapters as they travel between services: one rule for the learner that trains them,
the inference service that serves them and the exported policy folder.

On the wire (a weight push, the shared policy store) an adapter's tensors are named
``adapters/<name>/<PEFT key>``, the key as PEFT saves it (``base_model.model.<module>.lora_A.weight`` /
``.lora_B.weight``), with the LoRA scaling (alpha / r) already folded into lora_B: an adapter is applied as
``W + B @ A``, so its folder's ``lora_alpha`` equals its rank and nothing but the tensors is needed to load it.
On disk an adapter is a PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``) that PEFT,
transformers and vLLM load; an exported policy keeps them under ``adapters/<name>/`` next to the base weights.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from temper.runtime.errors import require

PREFIX = "adapters/"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_KEY = re.compile(r"base_model\.model\.(?P<module>[A-Za-z0-9_.]+)\.lora_(?P<part>[AB])\.weight")


def split(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """(the tensors not of an adapter, {adapter name: {PEFT key: tensor}})."""
    base: dict[str, torch.Tensor] = {}
    adapters: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        if name.startswith(PREFIX):
            adapter, _, key = name[len(PREFIX):].partition("/")
            adapters.setdefault(adapter, {})[key] = t
        else:
            base[name] = t
    return base, adapters


def check(name: str, tensors: dict[str, torch.Tensor], base_shapes: dict[str, tuple[int, ...]], max_rank: int,
          field: str = "tensor_name") -> int:
    """The rank of adapter ``name``'s ``tensors`` (PEFT keys); InvalidArgument naming ``field`` unless every key is
    lora_A / lora_B of a 2-D weight of the base model (``base_shapes``: HF name -> shape), A is [r, in] and B is
    [out, r] of that weight, every module has both, and r is one rank <= ``max_rank``."""
    require(bool(NAME.fullmatch(name)), field, f"adapter name {name!r} must match {NAME.pattern}")
    require(bool(tensors), field, f"adapter {name!r} has no tensors")
    ranks, parts = set(), {}
    for key, t in tensors.items():
        m = _KEY.fullmatch(key)
        require(m is not None, field, f"{PREFIX}{name}/{key}: not a LoRA tensor (base_model.model.<module>"
                                      ".lora_A.weight / .lora_B.weight)")
        module, part = m["module"], m["part"]
        shape = base_shapes.get(f"{module}.weight")
        require(shape is not None and len(shape) == 2, field, f"{PREFIX}{name}/{key}: the model has no 2-D weight "
                                                               f"{module}.weight")
        out_f, in_f = shape
        dims = tuple(t.shape)
        ok = len(dims) == 2 and (dims[1] == in_f if part == "A" else dims[0] == out_f)
        require(ok, field, f"{PREFIX}{name}/{key}: shape {list(dims)} does not fit {module}.weight {list(shape)}")
        ranks.add(dims[0] if part == "A" else dims[1])
        require(bool(torch.isfinite(t).all()), field, f"{PREFIX}{name}/{key}: non-finite values")
        parts.setdefault(module, set()).add(part)
    missing = sorted(m for m, p in parts.items() if p != {"A", "B"})
    require(not missing, field, f"adapter {name!r}: lora_A and lora_B must both be given for {missing[:3]}")
    require(len(ranks) == 1, field, f"adapter {name!r}: one rank for every module, got {sorted(ranks)}")
    rank = ranks.pop()
    require(0 < rank <= max_rank, field, f"adapter {name!r}: rank {rank} is not in [1, {max_rank}]")
    return rank


def pairs(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """An adapter's PEFT tensors (checked) as {HF weight name: (A [r, in], B [out, r])}: the weight becomes W + B @ A."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.fullmatch(key)
        out.setdefault(f"{m['module']}.weight", {})[m["part"]] = t
    return {name: (p["A"], p["B"]) for name, p in out.items()}


def peft_config(tensors: dict[str, torch.Tensor], base_model: str = "") -> dict:
    """The ``adapter_config.json`` of an adapter given as folded PEFT tensors (scaling 1: lora_alpha = r)."""
    modules = sorted({_KEY.fullmatch(k)["module"].rsplit(".", 1)[-1] for k in tensors})
    rank = next(int(t.shape[0]) for k, t in tensors.items() if ".lora_A." in k)
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": rank,
            "lora_alpha": rank, "lora_dropout": 0.0, "target_modules": modules, "bias": "none",
            "fan_in_fan_out": False, "modules_to_save": None, "inference_mode": True}


def write(folder: str | Path, tensors: dict[str, torch.Tensor], base_model: str = "",
          dtype: torch.dtype | None = None) -> Path:
    """The PEFT folder of one adapter at ``folder`` (written beside it, then renamed into place)."""
    target = Path(folder)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        save_file({k: (t if dtype is None else t.to(dtype)).detach().contiguous().cpu() for k, t in tensors.items()},
                  str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(peft_config(tensors, base_model), indent=1))
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
