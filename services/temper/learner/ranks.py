"""The learner across ranks: data parallelism over torch.distributed, started by the learner itself.

``[learner] ranks = N`` (N > 1): the learner service is rank 0 (replay, gRPC, pushes, checkpoints, metrics:
everything that talks to other services) and starts N - 1 follower processes on its host. All N join one
gloo group (CUDA: nccl) through a ``FileStore`` in the learner's data folder -- no port is picked or bound
for the rendezvous, so nothing can take it first. Rank 0 sends each step's batch (after its screening) to
the followers, rank r trains micro-batches r, r + N, ... of it, and the gradients are summed over the ranks
before clipping and the AdamW step, so every rank applies the update one rank would (checked against one
rank to float tolerance in tests/learner/test_ranks.py). With ``shard_parameters`` (the default) the
parameters, gradients and AdamW moments are sharded over the ranks with FSDP2 (each decoder layer one unit,
the rest the root), every rank runs the same number of passes, and the weights are gathered to rank 0 after
each step for the push; otherwise every rank holds the whole model and the gradients are all-reduced.
Checkpoints: rank 0 asks the followers to take part ("save") and every rank writes its own shards of the
parameters and moments (torch.distributed.checkpoint, ``shards/``); they are read back at any number of
ranks, one included, each rank reading what it keeps; a restore ("load") is repeated by every rank.

A follower ends when rank 0 says stop, and also when rank 0's process is gone (it watches its parent),
so a learner killed with -9 leaves no rank behind. Not done: ranks on other hosts (torchrun; the FileStore
and the checkpoint folder are the host's); a critic (GAE) or LoRA over sharded ranks.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from temper.runtime.logs import get_logger

_log = get_logger(component="learner-ranks")
TIMEOUT = timedelta(minutes=30)  # a collective waits this long for the other ranks


def init(rank: int, world: int, store: Path, backend: str = "gloo") -> None:
    dist.init_process_group(backend, store=dist.FileStore(str(store), world), rank=rank, world_size=world,
                            timeout=TIMEOUT)


def tell(message: tuple) -> None:
    """Rank 0: send ``message`` to every follower (("step", batch, policy version) | ("load", folder) |
    ("save", folder) | ("stop",))."""
    dist.broadcast_object_list([message], src=0)


def _watch_parent(parent: int) -> None:
    while True:
        if os.getppid() != parent:
            os._exit(3)
        time.sleep(1.0)


def follow(trainer) -> None:
    """A follower's loop: do what rank 0 says until it says stop."""
    from temper.learner import checkpoint

    while True:
        box: list = [None]
        dist.broadcast_object_list(box, src=0)
        message = box[0]
        if message[0] == "stop":
            return
        try:
            if message[0] == "step":
                trainer.policy_version = message[2]
                trainer.step(message[1])
            elif message[0] == "load":
                checkpoint.load(trainer, message[1])
            elif message[0] == "save":  # sharded: every rank takes part in gathering the state
                checkpoint.save(trainer, message[1])
        except Exception as e:  # noqa: BLE001 -- rank 0 got the same error from the same batch and reports it
            _log.info("follower step refused", rank=trainer.rank, error=str(e))


def _follower(rank: int, world: int, store: str, parent: int, model_dir: str, trainer_config: dict) -> None:
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    from temper.learner.trainer import Trainer, TrainerConfig

    config = TrainerConfig(**trainer_config)
    init(rank, world, Path(store), backend=backend_for(config.device))
    trainer = Trainer(model_dir, config)
    try:
        follow(trainer)
    finally:
        dist.destroy_process_group()


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()) else "gloo"


class Ranks:
    """Rank 0's side: start the followers and join the group (before the Trainer is built)."""

    def __init__(self, world: int, data_dir: str | Path, model_dir: str, trainer_config: dict):
        folder = Path(data_dir)
        folder.mkdir(parents=True, exist_ok=True)
        store = folder / f"ranks-{os.getpid()}.store"
        store.unlink(missing_ok=True)
        self.store = store
        ctx = multiprocessing.get_context("spawn")
        self.followers = [ctx.Process(target=_follower, name=f"temper-learner-rank{r}", daemon=True,
                                      args=(r, world, str(store), os.getpid(), model_dir, trainer_config))
                          for r in range(1, world)]
        for p in self.followers:
            p.start()
        init(0, world, store, backend=backend_for(trainer_config.get("device", "auto")))
        _log.info("learner ranks joined", world=world, followers=[p.pid for p in self.followers])

    def close(self) -> None:
        try:
            tell(("stop",))
        finally:
            for p in self.followers:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
            dist.destroy_process_group()
            self.store.unlink(missing_ok=True)
