"""Learner ranks benchmark (`make bench`): train tokens/s of one step on 1 rank (1 thread, and 2 threads)
against 2 ranks (1 thread each, gloo, two processes), same batches, same run. On a 2-core machine this is
the most 2 ranks can show: both cores used by data parallelism instead of by intra-op threads."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest
import torch

from temper.learner.trainer import Trainer, TrainerConfig
from temper.models.tiny import build_tiny_model
from tests.learner.test_memory_and_devices import random_batch

pytestmark = pytest.mark.bench
STEPS, SEQS = 4, 64
CONFIG = {"micro_batch_tokens": 1024, "autocast": "fp32", "device": "cpu", "gradient_checkpointing": False}


def _batches():
    return [random_batch(s, SEQS, vocab=25, prompt=(20, 40), completion=(20, 60)) for s in range(STEPS + 1)]


def _timed(trainer: Trainer) -> float:
    """Train tokens/s over STEPS steps after a warm-up step."""
    batches = _batches()
    trainer.step(batches[0])
    t0, tokens = time.perf_counter(), 0
    for b in batches[1:]:
        tokens += trainer.step(b)["input_tokens"]
    return tokens / (time.perf_counter() - t0)


def _rank(rank: int, store: str, model_dir: str, out: str, sharded: bool) -> None:
    from temper.learner import ranks

    ranks.init(rank, 2, Path(store))
    trainer = Trainer(model_dir, TrainerConfig(**CONFIG, cpu_threads=1, shard_parameters=sharded))
    if rank == 0:
        rate = _timed(trainer)
        ranks.tell(("stop",))
        Path(out).write_text(str(rate))
    else:
        ranks.follow(trainer)


def test_two_ranks_against_one(tmp_path):
    model_dir = str(build_tiny_model(tmp_path / "m", hidden_size=256, layers=4, heads=4, seed=0))
    one = {threads: _timed(Trainer(model_dir, TrainerConfig(**CONFIG, cpu_threads=threads))) for threads in (1, 2)}
    ctx = multiprocessing.get_context("spawn")
    two = {}
    for sharded in (True, False):
        store, rate = tmp_path / f"store-{sharded}", tmp_path / f"rate-{sharded}"
        procs = [ctx.Process(target=_rank, args=(r, str(store), model_dir, str(rate), sharded)) for r in (0, 1)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=600)
        assert [p.exitcode for p in procs] == [0, 0]
        two[sharded] = float(rate.read_text())
    torch.set_num_threads(2)
    print(f"\nlearner ranks, {SEQS} sequences of 40-100 tokens per step (tiny model 256 x 4 layers): 1 rank x 1 "
          f"thread {one[1]:.0f} tokens/s, 1 rank x 2 threads {one[2]:.0f}; 2 ranks x 1 thread, sharded (FSDP2) "
          f"{two[True]:.0f} ({two[True] / one[1]:.2f}x of 1 x 1, {two[True] / one[2]:.2f}x of 1 x 2), replicated "
          f"{two[False]:.0f} ({two[False] / one[1]:.2f}x, {two[False] / one[2]:.2f}x)")
    assert all(v > 0 for v in two.values())
