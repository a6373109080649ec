"""The learner over 2 ranks (gloo, two real processes, a FileStore rendezvous) applies the update one rank
applies: same loss and weights up to float tolerance, over steps with several epochs and micro-batches; a
checkpoint restored on rank 0 is restored by the follower; a critic over ranks is refused naming the field;
per-domain-group LoRA adapters over 2 replicated ranks train as on one; the learner service with ``ranks = 2``
trains through its gRPC surface with a follower process."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from temper.learner.trainer import Trainer, TrainerConfig
from temper.models.tiny import build_tiny_model
from tests.learner.test_adapters import with_adapters
from tests.learner.test_memory_and_devices import random_batch

pytestmark = pytest.mark.slow

CONFIG = {"micro_batch_tokens": 120, "epochs": 2, "autocast": "fp32", "device": "cpu", "lr": 0.01,
          "gradient_checkpointing": False, "cpu_threads": 1}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


def _rank0(world: int, store: str, model_dir: str, out: str, checkpoint_dir: str, sharded: bool, whole: str) -> None:
    from temper.learner import checkpoint, ranks

    ranks.init(0, world, Path(store))
    trainer = Trainer(model_dir, TrainerConfig(**CONFIG, shard_parameters=sharded))
    assert trainer.sharded == sharded
    metrics = [trainer.step(random_batch(s, 16, vocab=25, completion=(4, 20))) for s in (1, 2)]
    checkpoint.save(trainer, checkpoint_dir)
    trainer.step(random_batch(3, 16, vocab=25, completion=(4, 20)))
    checkpoint.load(trainer, checkpoint_dir)           # back to after step 2, on both ranks
    metrics.append(trainer.step(random_batch(4, 16, vocab=25, completion=(4, 20))))
    weights = {n: p.clone() for n, p in trainer.weights().items()}
    checkpoint.load(trainer, whole)                    # one rank's checkpoint after step 2: the same step again
    metrics.append(trainer.step(random_batch(4, 16, vocab=25, completion=(4, 20))))
    ranks.tell(("stop",))
    final = {n: p.clone() for n, p in trainer.weights().items()}
    torch.save({"metrics": metrics, "weights": weights, "final": final}, out)


def _follower(world: int, store: str, model_dir: str, out: str, sharded: bool) -> None:
    from temper.learner import ranks

    ranks.init(1, world, Path(store))
    trainer = Trainer(model_dir, TrainerConfig(**CONFIG, shard_parameters=sharded))
    ranks.follow(trainer)
    # sharded: this rank's half of each parameter (a DTensor's local shard); else the whole parameter
    torch.save({n: (p.to_local() if sharded else p).detach().clone() for n, p in trainer.model.named_parameters()},
               out)


@pytest.mark.parametrize("sharded", [True, False], ids=["fsdp", "replicated"])
def test_two_ranks_apply_the_update_of_one(model_dir, tmp_path, sharded):
    from temper.learner import checkpoint

    one = Trainer(model_dir, TrainerConfig(**CONFIG))
    expected = [one.step(random_batch(s, 16, vocab=25, completion=(4, 20))) for s in (1, 2)]
    checkpoint.save(one, tmp_path / "whole")           # a one-rank checkpoint, restored by the two ranks below
    ctx = multiprocessing.get_context("spawn")
    store, out0, out1 = str(tmp_path / "store"), str(tmp_path / "r0.pt"), str(tmp_path / "r1.pt")
    procs = [ctx.Process(target=_rank0, args=(2, store, str(model_dir), out0, str(tmp_path / "ckpt"), sharded,
                                              str(tmp_path / "whole"))),
             ctx.Process(target=_follower, args=(2, store, str(model_dir), out1, sharded))]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    assert [p.exitcode for p in procs] == [0, 0]

    # the checkpoint the two ranks wrote after step 2 resumes on one rank: same weights, moments, counters
    if sharded:  # each rank wrote its own shards
        assert sorted(p.name for p in (tmp_path / "ckpt" / "shards").glob("*.distcp")) == ["__0_0.distcp",
                                                                                           "__1_0.distcp"]
    resumed = Trainer(model_dir, TrainerConfig(**CONFIG))
    assert checkpoint.load(resumed, tmp_path / "ckpt")["step"] == 2
    for n, p in one.model.named_parameters():
        assert torch.allclose(dict(resumed.model.named_parameters())[n], p, atol=1e-5), n
    assert resumed.step_count == 2
    expected.append(one.step(random_batch(4, 16, vocab=25, completion=(4, 20))))
    # ... and the moments: its next step is the one-rank step
    again = resumed.step(random_batch(4, 16, vocab=25, completion=(4, 20)))
    assert again["grad_norm"] == pytest.approx(expected[2]["grad_norm"], rel=1e-4)
    for n, p in one.model.named_parameters():
        assert torch.allclose(dict(resumed.model.named_parameters())[n], p, atol=1e-5), n
    got = torch.load(out0)
    assert got["metrics"][0]["micro_batches"] > 2     # both ranks had micro-batches to train
    expected.append(expected[2])                      # the step after restoring the one-rank checkpoint
    for e, g in zip(expected, got["metrics"]):
        for key in ("loss", "policy_loss", "grad_norm", "entropy", "clip_fraction"):
            assert g[key] == pytest.approx(e[key], rel=1e-4, abs=1e-6), key
    follower = torch.load(out1)
    for n, p in one.model.named_parameters():
        assert torch.allclose(got["weights"][n], p, atol=1e-5), n      # rank 0 = one rank
        assert torch.allclose(got["final"][n], p, atol=1e-5), n        # the one-rank checkpoint's step too
        if sharded:  # the follower holds the second half of dim 0 (FSDP2 shards dim 0 evenly, rank 0 first)
            half = -(-p.shape[0] // 2)
            assert torch.equal(follower[n], got["final"][n][half:]), n
        else:        # every rank holds the same weights
            assert torch.equal(follower[n], got["final"][n]), n


ADAPTERS = {**CONFIG, "lora_rank": 4, "lora_alpha": 8.0, "lora_adapters": ["math", "words"],
            "shard_parameters": False}


def _adapter_batches() -> list:
    """Step 1: both adapters' groups, interleaved; step 2: math's alone (words must stay exactly as it was)."""
    return [with_adapters(random_batch(1, 16, vocab=25, completion=(4, 20)), ["math", "words"]),
            with_adapters(random_batch(2, 16, vocab=25, completion=(4, 20)), ["math"])]


def _adapters_rank(rank: int, store: str, model_dir: str, out: str, checkpoint_dir: str) -> None:
    from temper.learner import checkpoint, ranks

    ranks.init(rank, 2, Path(store))
    trainer = Trainer(model_dir, TrainerConfig(**ADAPTERS))
    if rank == 0:
        metrics, after = [], []
        for batch in _adapter_batches():
            metrics.append(trainer.step(batch))
            after.append({n: p.detach().clone() for n, p in trainer.model.named_parameters()})
        checkpoint.save(trainer, checkpoint_dir)
        ranks.tell(("stop",))
        torch.save({"metrics": metrics, "after": after}, out)
    else:
        ranks.follow(trainer)
        torch.save({n: p.detach().clone() for n, p in trainer.model.named_parameters()}, out)


def test_per_domain_group_adapters_over_two_ranks_apply_the_update_of_one(model_dir, tmp_path):
    """Replicated ranks train per-domain-group adapters as one rank does: the same loss, grad norm and weights,
    and an adapter no group of a step names is left bit-identical (no zero gradient reaches AdamW)."""
    one = Trainer(model_dir, TrainerConfig(**ADAPTERS))
    expected, after = [], []
    for batch in _adapter_batches():
        expected.append(one.step(batch))
        after.append({n: p.detach().clone() for n, p in one.model.named_parameters()})
    ctx = multiprocessing.get_context("spawn")
    store, outs = str(tmp_path / "store"), [str(tmp_path / f"r{r}.pt") for r in (0, 1)]
    procs = [ctx.Process(target=_adapters_rank, args=(r, store, str(model_dir), outs[r], str(tmp_path / "ckpt")))
             for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    assert [p.exitcode for p in procs] == [0, 0]
    got, follower = torch.load(outs[0]), torch.load(outs[1])
    assert got["metrics"][0]["micro_batches"] > 2  # both ranks had micro-batches to train
    for e, g in zip(expected, got["metrics"]):
        for key in ("loss", "policy_loss", "grad_norm", "entropy"):
            assert g[key] == pytest.approx(e[key], rel=1e-4, abs=1e-6), key
    for step in (0, 1):
        for n, p in after[step].items():
            assert torch.allclose(got["after"][step][n], p, atol=1e-5), (step, n)
    words = [n for n in after[0] if ".words." in n]
    assert words and all(torch.equal(got["after"][1][n], got["after"][0][n]) for n in words)
    for n, p in got["after"][1].items():
        assert torch.equal(follower[n], p), n  # every rank holds the same adapters
    # the two ranks' checkpoint resumes on one rank: every adapter and its moments (the next step is one rank's)
    from temper.learner import checkpoint

    resumed = Trainer(model_dir, TrainerConfig(**ADAPTERS))
    assert checkpoint.load(resumed, tmp_path / "ckpt")["step"] == 2
    nxt = with_adapters(random_batch(3, 16, vocab=25, completion=(4, 20)), ["words", "math"])
    assert resumed.step(nxt)["grad_norm"] == pytest.approx(one.step(nxt)["grad_norm"], rel=1e-4)
    for n, p in one.model.named_parameters():
        assert torch.allclose(dict(resumed.model.named_parameters())[n], p, atol=1e-5), n


def test_a_critic_or_sharded_lora_over_ranks_is_refused_naming_the_field():
    from temper.learner.config import LearnerConfig

    with pytest.raises(ValidationError, match="ranks"):
        LearnerConfig(ranks=2, advantage="gae")
    assert LearnerConfig(ranks=2, advantage="grpo").ranks == 2
    with pytest.raises(ValidationError, match="shard_parameters"):
        LearnerConfig(ranks=2, lora_rank=4)
    assert not LearnerConfig(ranks=2, lora_rank=4, shard_parameters=False).shard_parameters


SERVICE = """
[job]
prompts_per_step = 4

[model]
preset = "tiny"
dir = "{model_dir}"

[learner]
epochs = 1
ranks = {ranks}
micro_batch_tokens = 64
checkpoint_every = 1

[replay]
[inference]
engine = "hf"
"""


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _followers(learner_pid: int) -> list[int]:
    # the learner's children started by multiprocessing's spawn (not its resource tracker)
    return [c for c in _children(learner_pid) if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def test_the_learner_service_trains_over_two_ranks(tmp_path):
    from temper.client.sdk import InferenceClient, LearnerClient, ReplayClient
    from temper.runtime.launcher import Launcher, pid_alive
    from tests.conftest import wait_until
    from tests.learner.test_service import make_groups

    config = tmp_path / "temper.toml"
    config.write_text(SERVICE.format(model_dir=tmp_path / "model", ranks=2))
    launcher = Launcher(home=tmp_path / "home", config=config)
    state = launcher.up(["inference", "replay", "learner"])
    pids = [p.pid for p in state.services.values()] + [state.broker.pid]
    try:
        addr = {n: p.address for n, p in state.services.items()}
        learner_pid = state.services["learner"].pid
        followers = _followers(learner_pid)
        assert len(followers) == 1, _children(learner_pid)
        pids += followers
        inference, replay, learner = InferenceClient(addr["inference"]), ReplayClient(addr["replay"]), \
            LearnerClient(addr["learner"])
        replay.insert(make_groups(inference, 8, seed=1, job_id="ranks"))  # 2 steps of 4 groups
        wait_until(lambda: learner.status().step >= 2, 120, what="2 learner steps over 2 ranks")
        assert learner.status().policy_version == 2 and inference.policy_version() == 2
        assert all(pid_alive(f) for f in followers)
        # kill -9 of the follower: rank 0's next step finds the group broken and exits (status 5); the
        # supervisor restarts the learner, which starts a new follower and resumes from its checkpoint
        os.kill(followers[0], 9)
        replay.insert(make_groups(inference, 4, seed=2, job_id="ranks"))
        wait_until(lambda: not pid_alive(learner_pid), 60, what="rank 0 to exit on the broken group")
        assert "learner ranks broken" in Path(state.services["learner"].log).read_text()
        restarted = wait_until(lambda: (p := launcher.load().services["learner"]).pid != learner_pid and p, 60,
                               what="the learner restarted")
        pids.append(restarted.pid)
        assert learner.wait_ready(120)
        wait_until(lambda: learner.status().step >= 3, 180, what="step 3 after the restart, over 2 ranks again")
        assert learner.status().policy_version == 3
        followers = _followers(restarted.pid)
        assert len(followers) == 1
        pids += followers
        # kill -9 of rank 0: its follower leaves by itself (it watches its parent), no rank left behind
        os.kill(restarted.pid, 9)
        wait_until(lambda: not any(pid_alive(f) for f in followers), 30, what="the follower to exit")
    finally:
        launcher.down()
    assert not [p for p in pids if pid_alive(p)], "processes left behind"
