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
so a learner killed with -9 leaves no rank behind.

Ranks on several hosts: ``torchrun ... -m temper.learner <the same flags>`` (deploy/k8s/overlays/scale). Every
process torchrun starts reads the same configuration; the one with RANK 0 is the service, the others are
followers (``follow_torchrun``, no port bound), all joined through torchrun's rendezvous (``env://``: the
agent's store, bound by the agent itself). ``ranks`` is then torchrun's world (1 or the same number). A
checkpoint is written by every rank into one folder, so ranks on several hosts need ``checkpoint_dir`` on
storage they all mount (a ReadWriteMany volume): checked at start-up (rank 0 writes a marker there that every
rank must read back), a folder some rank cannot see stops every rank with the hosts named. Each process
watches its parent (the torchrun agent), so an agent killed with -9 leaves no rank behind either. Not done:
a critic (GAE) or LoRA over sharded ranks.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from temper.runtime.logs import get_logger

_log = get_logger(component="learner-ranks")
TIMEOUT = timedelta(minutes=30)  # a collective waits this long for the other ranks


def init(rank: int, world: int, store: Path | None, backend: str = "gloo", local_rank: int | None = None) -> None:
    """Join the group: through a FileStore (ranks started by the learner) or, ``store=None``, torchrun's
    environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT). nccl: this process's GPU is its rank on the host."""
    if backend == "nccl":  # "cuda" then means this rank's own GPU (torch.device("cuda") = the current one)
        torch.cuda.set_device(rank if local_rank is None else local_rank)
    if store is None:
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world, timeout=TIMEOUT)
    else:
        dist.init_process_group(backend, store=dist.FileStore(str(store), world), rank=rank, world_size=world,
                                timeout=TIMEOUT)


def torchrun() -> tuple[int, int, int] | None:
    """(rank, world, local rank) when torchrun started this process in a world of several ranks, else None."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0"))


def check_shared(folder: Path) -> None:
    """Every rank must see ``folder`` as one (a checkpoint's shards are written there by every rank and read
    back by any): rank 0 writes a marker that every rank reads back. Collective; raises ValueError on every
    rank, naming the hosts, when some rank cannot see it."""
    folder.mkdir(parents=True, exist_ok=True)
    box = [f".ranks-{uuid.uuid4().hex}" if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    marker = folder / box[0]
    if dist.get_rank() == 0:
        marker.write_text(box[0])
    dist.barrier()
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (socket.gethostname(), marker.is_file() and marker.read_text() == box[0]))
    dist.barrier()
    if dist.get_rank() == 0:
        marker.unlink(missing_ok=True)
    blind = [f"rank {r} on {host}" for r, (host, ok) in enumerate(seen) if not ok]
    if blind:
        raise ValueError(f"checkpoint_dir: {folder} is not shared by every rank ({', '.join(blind)} cannot see "
                         f"what rank 0 on {seen[0][0]} writes there); ranks on several hosts need it on storage "
                         "they all mount (a ReadWriteMany volume)")


def tell(message: tuple) -> None:
    """Rank 0: send ``message`` to every follower (("step", batch, policy version) | ("load", folder) |
    ("save", folder) | ("stop",))."""
    dist.broadcast_object_list([message], src=0)


def _watch_parent(parent: int) -> None:
    while True:
        if os.getppid() != parent:
            os._exit(3)
        time.sleep(1.0)


def watch_parent() -> None:
    """Exit (status 3) when the process that started this one is gone."""
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True, name="watch-parent").start()


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


def follow_torchrun(argv: list[str]) -> None:
    """A follower started by torchrun (RANK > 0): the learner's configuration from the same flags, no port."""
    from grpc_health.v1 import health_pb2
    from pydantic import ValidationError

    from temper.learner.config import LearnerConfig
    from temper.learner.trainer import Trainer
    from temper.runtime.config import describe_errors, load_config
    from temper.runtime.logs import setup_logging
    from temper.runtime.service import serve_health

    rank, world, local_rank = torchrun()
    try:
        config = load_config(LearnerConfig, argv)
    except ValidationError as e:
        sys.exit(f"temper-learner rank {rank}: invalid configuration:\n" + "\n".join(
            describe_errors(LearnerConfig, e, argv)))
    setup_logging(f"learner-rank{rank}", config.log_level)
    try:
        check_world(config, world)
    except ValueError as e:
        sys.exit(f"temper-learner rank {rank}: {e}")
    watch_parent()
    # rank 0 ends the followers ("stop") when torchrun's agent passes it SIGTERM; a follower leaving first
    # would fail rank 0's last collective (its final checkpoint)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # the first process on a host answers the pod's health probes (rank 0's host: the service itself)
    server, health, _ = serve_health(config, "learner") if local_rank == 0 else (None, None, "")
    init(rank, world, None, backend=backend_for(config.device), local_rank=local_rank)
    try:
        check_shared(config.checkpoint_folder())
        trainer = Trainer(config.model_dir, config.trainer_config())
        if health is not None:
            health.set("", health_pb2.HealthCheckResponse.SERVING)
        follow(trainer)
    except ValueError as e:
        sys.exit(f"temper-learner rank {rank}: {e}")
    finally:
        if server is not None:
            server.stop(0)
        dist.destroy_process_group()


def check_world(config, world: int) -> None:
    """A configuration torchrun's ``world`` cannot run (ValueError naming the field): checked by every rank."""
    if config.ranks not in (1, world):
        raise ValueError(f"ranks: {config.ranks}, but torchrun started {world} ranks (set ranks = 1 or {world}, "
                         "or start the learner without torchrun)")
    config.check_world(world)  # what a learner over ranks cannot train


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()) else "gloo"


class Ranks:
    """Rank 0's side: start the followers and join the group (before the Trainer is built); under torchrun
    (``joined``) only join the group torchrun started."""

    @classmethod
    def joined(cls, config) -> Ranks:
        """Rank 0 of a world torchrun started: join it, check the checkpoint folder is shared by every rank."""
        rank, world, local_rank = torchrun()
        watch_parent()
        self = cls.__new__(cls)
        self.followers, self.store = [], None
        init(rank, world, None, backend=backend_for(config.device), local_rank=local_rank)
        _log.info("learner ranks joined (torchrun)", world=world, hosts=os.environ.get("GROUP_WORLD_SIZE", "1"))
        try:
            check_shared(config.checkpoint_folder())
        except ValueError:  # every rank raised it: no collective is left to run
            dist.destroy_process_group()
            raise
        return self

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
            if self.store is not None:
                self.store.unlink(missing_ok=True)
