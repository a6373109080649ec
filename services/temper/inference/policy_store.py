"""The current policy on shared storage: what a replica that starts late (or restarts) loads before it
reports SERVING, so it never serves the base weights while the learner is versions ahead.

The learner writes every version here before it pushes it to the replicas (``write``); a replica reads
the newest at start-up (``read``), so one that misses a push (it was down) still starts at the version
the learner pushed last, or at a newer one it gets by the learner's next push. Layout of ``policy_dir``:
``v<version>.safetensors`` (the weights, in the engine's dtype) and ``latest.json`` (``{"version",
"lineage", "file"}``), replaced atomically after the weights are complete; the two newest versions are
kept (a reader that read ``latest.json`` just before a write still finds its file).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LATEST = "latest.json"
KEEP = 2


def write(policy_dir: str | Path, tensors: dict[str, torch.Tensor], version: int, lineage: str) -> Path:
    """Store ``tensors`` as ``version`` of ``lineage`` and make it the latest; returns the weights' file."""
    root = Path(policy_dir)
    root.mkdir(parents=True, exist_ok=True)
    target = root / f"v{version:08d}.safetensors"
    tmp = root / f".{target.name}.{os.getpid()}.tmp"
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp))
    tmp.replace(target)
    meta = root / f".{LATEST}.{os.getpid()}.tmp"
    meta.write_text(json.dumps({"version": version, "lineage": lineage, "file": target.name}))
    meta.replace(root / LATEST)
    for old in sorted(root.glob("v*.safetensors"))[:-KEEP]:
        old.unlink(missing_ok=True)
    return target


def latest(policy_dir: str | Path) -> dict | None:
    """``{"version", "lineage", "file"}`` of the newest stored version; None when nothing is stored."""
    path = Path(policy_dir) / LATEST
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def read(policy_dir: str | Path) -> tuple[dict[str, torch.Tensor], int, str] | None:
    """(tensors, version, lineage) of the newest stored version; None when nothing is stored."""
    for _ in range(3):  # a write may prune the file between reading latest.json and opening it
        meta = latest(policy_dir)
        if meta is None:
            return None
        try:
            return load_file(str(Path(policy_dir) / meta["file"])), int(meta["version"]), str(meta["lineage"])
        except FileNotFoundError:
            continue
    raise RuntimeError(f"{policy_dir}: the latest policy kept changing under the reader")
