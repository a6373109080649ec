"""The current policy on shared storage: what a replica that starts late (or restarts) loads before it
reports SERVING, so it never serves the base weights while the learner is versions ahead.

The learner writes every version here before it pushes it to the replicas (``write``); a replica reads
the newest at start-up (``read``), so one that misses a push (it was down) still starts at the version
the learner pushed last, or at a newer one it gets by the learner's next push. Layout of ``policy_dir``:
``v<version>.safetensors`` (the weights, in the engine's dtype) and ``latest.json`` (``{"version",
"lineage", "file"}``), replaced atomically after the weights are complete; the two newest versions are
kept (a reader that read ``latest.json`` just before a write still finds its file). ``Writer`` (what the learner
writes with) allocates the next version's file while the learner trains, so storing a version is a copy only.

Updates by reference (``read_version``): the learner stores a version under an id of its own (the file's
safetensors metadata ``temper_id``, with ``temper_version`` and ``temper_lineage``) and asks each replica
to install that version from its policy_dir (``UpdateWeightsRequest.stored_id``). A replica whose
policy_dir is this folder maps the file into memory instead of receiving every byte
over gRPC; one whose policy_dir is another folder (another host) finds no file with that id.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import threading
import uuid
from pathlib import Path

import torch
from safetensors.torch import load_file

from temper.inference.weights import MAX_HEADER_BYTES, safetensors_file_parts, tensor_entry
from temper.runtime.logs import get_logger

LATEST = "latest.json"
KEEP = 2
SPARE = ".spare"  # name prefix of a file allocated ahead for the next version (Writer)

_log = get_logger(component="policy-store")


class NotStored(LookupError):
    """The version asked for is not in this folder under that id (a message says which and why)."""


def version_file(policy_dir: str | Path, version: int) -> Path:
    return Path(policy_dir) / f"v{version:08d}.safetensors"


def write(policy_dir: str | Path, tensors: dict[str, torch.Tensor], version: int, lineage: str,
          stored_id: str = "", spare: Path | None = None) -> Path:
    """Store ``tensors`` as ``version`` of ``lineage`` (under ``stored_id``, for updates by reference) and make
    it the latest; returns the weights' file. ``spare``: a file in ``policy_dir`` that no reader knows, whose
    space is allocated already (``Writer``); the version is written into it (and it is gone afterwards)."""
    root = Path(policy_dir)
    root.mkdir(parents=True, exist_ok=True)
    target = version_file(root, version)
    tmp = root / f".{target.name}.{os.getpid()}.tmp"
    metadata = {"temper_id": stored_id, "temper_version": str(version), "temper_lineage": lineage}
    head, views = safetensors_file_parts(tensors, metadata)
    mode = "wb"
    if spare is not None:
        try:
            os.replace(spare, tmp)
            mode = "r+b"  # not truncated: its pages stay allocated
        except FileNotFoundError:
            _log.warning("the spare policy file is gone; writing a new one", spare=str(spare))
    with open(tmp, mode) as f:  # the tensors' bytes straight from their memory: one copy
        f.write(head)
        for view in views:
            f.write(view)
        f.truncate()  # a spare larger than this version: the rest goes
    tmp.replace(target)
    meta = root / f".{LATEST}.{os.getpid()}.tmp"
    meta.write_text(json.dumps({"version": version, "lineage": lineage, "file": target.name}))
    meta.replace(root / LATEST)
    for old in sorted(root.glob("v*.safetensors"))[:-KEEP]:
        old.unlink(missing_ok=True)
    return target


class Writer:
    """Writes each version to ``policy_dir`` (``write``) into a file whose space was allocated after the previous
    write, in a background thread, while the learner trained: on tmpfs, allocating the pages is most of a write's
    time (SmolLM2's 513 MiB here: 0.12 of 0.19 s), so a version is stored, and a replica can read it, sooner. A new
    file, never one a reader may have mapped (files are replaced, never rewritten). Between writes the spare holds
    one version's size on the folder's filesystem; ``close`` removes it. One learner writes a policy_dir: a new
    Writer removes spares left there by a writer that was killed."""

    def __init__(self, policy_dir: str | Path):
        self.policy_dir = Path(policy_dir)
        self._lock = threading.Lock()  # one write at a time
        self._spare: Path | None = None
        self._allocating: threading.Thread | None = None
        for left in self.policy_dir.glob(f"{SPARE}.*.tmp"):
            left.unlink(missing_ok=True)

    def write(self, tensors: dict[str, torch.Tensor], version: int, lineage: str, stored_id: str = "") -> Path:
        with self._lock:
            path = write(self.policy_dir, tensors, version, lineage, stored_id, spare=self._take_spare())
            self._allocating = threading.Thread(target=self._allocate, args=(path.stat().st_size,),
                                                name="policy-spare", daemon=True)
            self._allocating.start()
            return path

    def close(self) -> None:
        with self._lock:
            spare = self._take_spare()
            if spare is not None:
                spare.unlink(missing_ok=True)

    def _take_spare(self) -> Path | None:
        if self._allocating is not None:
            self._allocating.join()
            self._allocating = None
        spare, self._spare = self._spare, None
        return spare

    def _allocate(self, size: int) -> None:
        path = self.policy_dir / f"{SPARE}.{uuid.uuid4().hex}.tmp"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.posix_fallocate(fd, 0, size)
            finally:
                os.close(fd)
        except OSError as e:  # no space for it now: the next version is written into a new file, as without one
            path.unlink(missing_ok=True)
            _log.warning("could not allocate the next policy file ahead", path=str(path), size=size, why=str(e))
            return
        self._spare = path


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


def read_version(policy_dir: str | Path, version: int, stored_id: str, lineage: str,
                 max_bytes: int) -> tuple[dict[str, torch.Tensor], int]:
    """(tensors, file size) of ``version`` as stored under ``stored_id`` for ``lineage``; NotStored when this
    folder has no such file (none of that version, or one another writer stored: another folder than the
    learner's, an older run's), ValueError when the file is larger than ``max_bytes`` or not a safetensors file.
    The tensors are views of the file mapped into memory (copy-on-write, so nothing can write to the file
    through them): installing them copies each byte once. Files are replaced, never rewritten, so the
    mapping keeps this version's bytes even after the file is pruned."""
    path = version_file(policy_dir, version)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > max_bytes:
                raise ValueError(f"{path} is {size} bytes, over this server's update limit of {max_bytes}")
            if size < 8:
                raise ValueError(f"{path} is not a safetensors file: {size} bytes")
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except FileNotFoundError as e:
        raise NotStored(f"{path} does not exist") from e
    head = struct.unpack_from("<Q", mapped)[0]
    if not 0 < head <= min(MAX_HEADER_BYTES, size - 8):
        raise ValueError(f"{path} is not a safetensors file: a header of {head} bytes")
    try:
        header = json.loads(mapped[8:8 + head])
    except ValueError as e:
        raise ValueError(f"{path} is not a safetensors file: {e}") from e
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a safetensors file: its header is not an object")
    meta = header.pop("__metadata__", None) or {}
    if (meta.get("temper_id"), meta.get("temper_version"), meta.get("temper_lineage")) != \
            (stored_id, str(version), lineage):
        raise NotStored(f"{path} holds version {meta.get('temper_version')} stored under id "
                        f"{meta.get('temper_id')!r} (lineage {meta.get('temper_lineage')!r}), not "
                        f"{version} under {stored_id!r} (lineage {lineage!r})")
    base, tensors = 8 + head, {}
    for name, info in header.items():
        try:
            dtype, shape, offset, _ = tensor_entry(info, size - base)
        except ValueError as e:
            raise ValueError(f"{path} is not a safetensors file: entry {name!r}: {e}") from e
        start, numel = base + offset, math.prod(shape)
        if numel == 0:
            tensors[name] = torch.empty(shape, dtype=dtype)
        elif start % dtype.itemsize:  # unaligned for its dtype (another writer's packing): a copy
            tensors[name] = torch.frombuffer(mapped, dtype=torch.uint8, count=numel * dtype.itemsize,
                                             offset=start).clone().view(dtype).reshape(shape)
        else:
            tensors[name] = torch.frombuffer(mapped, dtype=dtype, count=numel, offset=start).reshape(shape)
    return tensors, size
