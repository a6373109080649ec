"""The learner's policy as a Hugging Face model folder: the start folder's config, tokenizer and chat
template, with the current weights (LoRA merged, HF names) as safetensors in the stored dtype. Per-domain-group
adapters (temper.models.adapters) are not merged: the folder holds the frozen base and each adapter as a PEFT
folder under ``adapters/<name>/`` (transformers + PEFT and vLLM load them over the base)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from temper.models import adapters
from temper.runtime.errors import InvalidArgument, require

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# weights of the start folder are replaced, never copied; a marker of the tiny recipe is not the policy's
SKIP = (".safetensors", ".bin", ".pt", ".gguf")
SKIP_NAMES = {"model.safetensors.index.json", "temper-tiny-recipe.json", "temper-smollm2.json"}


def export_policy(weights: dict[str, torch.Tensor], model_dir: str | Path, path: str | Path, dtype: str = "",
                  meta: dict | None = None) -> int:
    """Write the folder at ``path`` (atomically: a temporary sibling renamed into place); returns bytes written."""
    require("\x00" not in str(path), "path", "must not contain a NUL character")
    target = Path(path)
    require(target.is_absolute(), "path", f"must be absolute, got {str(path)!r}")
    require(not target.exists() or (target.is_dir() and not any(target.iterdir())), "path",
            f"{target} exists and is not empty")
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    stored = config.get("dtype") or config.get("torch_dtype") or "float32"
    name = dtype or stored
    require(name in DTYPES, "dtype", f"unknown dtype {name!r}; known: {sorted(DTYPES)}")
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for f in model_dir.iterdir():
            if f.is_file() and not f.name.endswith(SKIP) and f.name not in SKIP_NAMES:
                shutil.copy2(f, tmp / f.name)
        (tmp / "config.json").write_text(json.dumps({**config, "dtype": name}, indent=2))
        base, groups = adapters.split(weights)
        tensors = {n: t.detach().to(DTYPES[name]).contiguous() for n, t in base.items()}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for adapter, own in groups.items():
            adapters.write(tmp / "adapters" / adapter, own, str(target), DTYPES[name])
        (tmp / "temper-policy.json").write_text(json.dumps({"started_from": str(model_dir), **(meta or {})}, indent=1))
        if target.exists():
            target.rmdir()
        os.replace(tmp, target)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise InvalidArgument(f"cannot write {target}: {e}", field="path") from None
    return sum(f.stat().st_size for f in target.rglob("*") if f.is_file())
