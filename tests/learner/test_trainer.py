"""The trainer's step on a real tiny model: default maths vs a plain reference, micro-batches,
packing, bad batches, staleness and importance weights, KL to the reference, LoRA, config
validation, and bit-identical resume from a checkpoint."""

import copy
import math
import random

import pytest
import torch
from pydantic import ValidationError

from temper.inference.engine import HFEngine, SamplingParams
from temper.learner import checkpoint
from temper.learner.batching import Batch, batch_from_groups
from temper.learner.trainer import Trainer, TrainerConfig
from temper.runtime.errors import InvalidArgument
from temper.v1 import common_pb2
from tests.builders import rollout_group, trajectory
from tests.learner.reference import plain_step

TIMING = {"train_seconds", "tokens_per_second", "peak_rss_bytes", "peak_memory_bytes"}  # measurements, not maths


def synthetic_batch(seed: int, n: int = 12, vocab: int = 25) -> Batch:
    """Variable lengths (prompts 2..20, completions 1..10) with made-up behaviour logprobs."""
    g = random.Random(seed)
    prompts = [[2] + [g.randrange(4, vocab) for _ in range(g.randint(1, 19))] for _ in range(n)]
    completions = [[g.randrange(4, vocab) for _ in range(g.randint(1, 10))] for _ in range(n)]
    total = sum(map(len, completions))
    return Batch(prompts, completions, -torch.rand(total) * 3 - 0.01, torch.full((n,), 0.9),
                 torch.tensor([float(g.random() < 0.5) for _ in range(n)]), torch.arange(n) // 4,
                 torch.zeros(n, dtype=torch.long), ["x"] * n, "j")


def params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_default_step_matches_a_plain_pytorch_update(model_dir, batches):
    trainer = Trainer(model_dir, TrainerConfig())
    plain = copy.deepcopy(trainer.model)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-3, weight_decay=0.0)
    for batch in batches:
        metrics = trainer.step(batch)
        loss = plain_step(plain, optimizer, batch, trainer.pad_id)
        assert math.isclose(metrics["loss"], loss, rel_tol=1e-4, abs_tol=1e-6)
    ours, theirs = params(trainer), dict(plain.named_parameters())
    assert max((ours[n] - theirs[n]).abs().max().item() for n in ours) < 1e-5


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_micro_batches_accumulate_to_the_full_batch_update(model_dir, aggregation):
    batch = synthetic_batch(1, n=16)
    whole = Trainer(model_dir, TrainerConfig(loss_aggregation=aggregation, clip_high=0.28))
    split = Trainer(model_dir, TrainerConfig(loss_aggregation=aggregation, clip_high=0.28, micro_batch_tokens=60))
    m1, m2 = whole.step(batch), split.step(batch)
    assert m1["micro_batches"] == 1 and m2["micro_batches"] >= 4
    assert math.isclose(m1["loss"], m2["loss"], rel_tol=1e-5)
    assert math.isclose(m1["grad_norm"], m2["grad_norm"], rel_tol=1e-4)
    # AdamW's first moment after one step is (1 - beta1) * gradient: the accumulated gradient equals the full one
    sa, sb = whole.optimizer.state, split.optimizer.state
    for p_a, p_b in zip(whole.params, split.params):
        ga, gb = sa[p_a]["exp_avg"], sb[p_b]["exp_avg"]
        assert torch.allclose(ga, gb, rtol=1e-4, atol=1e-6 * ga.abs().max().item())


def test_packing_gives_the_same_logprobs_with_less_padding(model_dir):
    batch = synthetic_batch(2, n=24)
    padded = Trainer(model_dir, TrainerConfig(packing=False))
    packed = Trainer(model_dir, TrainerConfig(packing=True))
    wide = Trainer(model_dir, TrainerConfig(packing=True, pack_length=64))
    with torch.no_grad():
        ref = padded.token_logprobs(batch)
        assert torch.allclose(packed.token_logprobs(batch), ref, atol=1e-5)
        assert torch.allclose(wide.token_logprobs(batch), ref, atol=1e-5)
    waste = {name: t.step(batch)["padding_fraction"] for name, t in
             [("padded", padded), ("packed", packed), ("wide", wide)]}
    assert waste["packed"] < waste["padded"] and waste["wide"] < 0.1 < waste["padded"], waste


def _mutations(batch: Batch):
    def edit(**changes):
        b = copy.copy(batch)
        for k, v in changes.items():
            setattr(b, k, v)
        return b
    nan = float("nan")
    n = len(batch.completions)
    yield edit(old_logprobs=batch.old_logprobs[:-1]), "old_logprobs"
    yield edit(old_logprobs=torch.cat([batch.old_logprobs[:-1], torch.tensor([nan])])), \
        f"old_logprobs[{len(batch.old_logprobs) - 1}]"
    yield edit(old_logprobs=torch.cat([torch.tensor([float("-inf")]), batch.old_logprobs[1:]])), "old_logprobs[0]"
    yield edit(old_logprobs=batch.old_logprobs.abs() + 0.5), "old_logprobs[0]"
    yield edit(rewards=torch.cat([batch.rewards[:2], torch.tensor([float("inf")]), batch.rewards[3:]])), "rewards[2]"
    yield edit(rewards=torch.full((n,), nan)), "rewards[0]"
    yield edit(rewards=batch.rewards[:-1]), "rewards"
    yield edit(temperatures=torch.zeros(n)), "temperatures[0]"
    yield edit(group_index=batch.group_index[:-1]), "group_index"
    yield edit(completions=[[], *batch.completions[1:]]), "completions[0]"
    yield edit(prompts=[[], *batch.prompts[1:]]), "prompts[0]"
    yield edit(completions=[[10_000], *batch.completions[1:]],
               old_logprobs=torch.cat([torch.tensor([-1.0]), batch.old_logprobs[len(batch.completions[0]):]])), \
        "completions[0]"
    yield edit(completions=[], prompts=[], temperatures=torch.zeros(0), rewards=torch.zeros(0),
               group_index=torch.zeros(0, dtype=torch.long), policy_versions=torch.zeros(0, dtype=torch.long),
               domains=[], old_logprobs=torch.zeros(0)), "completions"


def test_bad_batches_are_refused_naming_the_field_and_never_touch_the_weights(model_dir, batches):
    trainer = Trainer(model_dir, TrainerConfig(epochs=2))
    before = params(trainer)
    cases = list(_mutations(batches[0]))
    assert len(cases) == 13
    for bad, field in cases:
        with pytest.raises(InvalidArgument) as e:
            trainer.step(bad)
        assert e.value.field == field, (field, str(e.value))
    assert trainer.step_count == 0 and not trainer.optimizer.state
    assert all(torch.equal(before[n], p) for n, p in params(trainer).items())
    trainer.step(batches[0])  # and a good batch still trains
    assert trainer.step_count == 1


def test_bad_groups_are_refused_naming_the_field():
    def traj(**kw):
        return trajectory(**{"reward": 1.0, "temperature": 1.0, "vocab": 8, **kw})

    def group(*trajectories):
        return rollout_group(trajectories=trajectories)

    assert len(batch_from_groups([group(traj(), traj())]).completions) == 2
    err = common_pb2.Reward(total=1.0, status=common_pb2.REWARD_STATUS_ERROR)
    for groups, field in [
        ([], "groups"),
        ([group(traj()), group()], "groups[1].trajectories"),
        ([group(traj(), traj(completion_logprobs=[-1.0]))], "groups[0].trajectories[1].completion_logprobs"),
        ([group(traj(completion_logprobs=[-1.0, float("nan")]))], "groups[0].trajectories[0].completion_logprobs"),
        ([group(traj(reward=common_pb2.Reward(total=float("inf"), status=common_pb2.REWARD_STATUS_OK)))],
         "groups[0].trajectories[0].reward.total"),
        ([group(traj(reward=err))], "groups[0].trajectories[0].reward.status"),
        ([group(traj(completion_token_ids=[], completion_logprobs=[]))], "groups[0].trajectories[0].completion_token_ids"),
        ([group(traj(policy_version=-1))], "groups[0].trajectories[0].policy_version"),
    ]:
        with pytest.raises(InvalidArgument) as e:
            batch_from_groups(groups)
        assert e.value.field == field


def test_a_non_finite_loss_skips_the_step_and_leaves_the_weights_finite(model_dir):
    trainer = Trainer(model_dir, TrainerConfig(advantage="dr_grpo"))
    batch = synthetic_batch(3, n=4)
    batch.completions = [[5, 6, 7]] * 4
    batch.old_logprobs = torch.full((12,), -1.0)
    batch.group_index = torch.zeros(4, dtype=torch.long)
    batch.rewards = torch.tensor([3e38, -3e38, 3e38, -3e38])  # finite, but the loss sum overflows
    before = params(trainer)
    with pytest.raises(InvalidArgument, match="non-finite") as e:
        trainer.step(batch)
    assert e.value.field == "batch" and trainer.skipped_steps == 1 and trainer.step_count == 0
    assert all(torch.equal(before[n], p) for n, p in params(trainer).items())


@pytest.mark.parametrize("changes, field", [
    ({"advantage": "ppo"}, "advantage"), ({"policy_loss": "clip"}, "policy_loss"),
    ({"kl_estimator": "k4"}, "kl_estimator"), ({"loss_aggregation": "sum"}, "loss_aggregation"),
    ({"kl_in": "both"}, "kl_in"), ({"lr_schedule": "step"}, "lr_schedule"),
    ({"off_policy_correction": "vtrace"}, "off_policy_correction"), ({"dual_clip": 0.5}, "dual_clip"),
    ({"clip_low": 1.5}, "clip_low"), ({"lr": 0.0}, "lr"), ({"epochs": 0}, "epochs"), ({"bogus": 1}, "bogus"),
])
def test_config_validation_names_the_field(changes, field):
    with pytest.raises(ValidationError) as e:
        TrainerConfig(**changes)
    assert e.value.errors()[0]["loc"] == (field,)


@pytest.mark.parametrize("changes, field", [
    ({"lr_schedule": "cosine"}, "total_steps"), ({"kl_target": 0.1}, "kl_coef")])
def test_cross_field_validation_names_the_field(changes, field):
    with pytest.raises(ValidationError, match=f"{field}:"):
        TrainerConfig(**changes)


def test_stale_groups_are_dropped_and_importance_weights_truncated(model_dir, batches):
    cfg = TrainerConfig(max_staleness=2, off_policy_correction="tis", tis_cap=2.0)
    trainer = Trainer(model_dir, cfg)
    trainer.policy_version = 5
    batch = copy.copy(batches[0])
    batch.policy_versions = torch.where(batch.group_index == 0, 2, 5)  # group 0 is 3 versions behind
    batch.old_logprobs = batch.old_logprobs - 1.0  # behaviour far from the current policy: pi / mu ~ e
    m = trainer.step(batch)
    assert m["stale_groups_dropped"] == 1 and m["staleness_max"] == 3
    assert m["tokens"] == sum(len(c) for c, g in zip(batch.completions, batch.group_index) if g != 0)
    assert m["is_weight_truncated"] == 1.0 and math.isclose(m["is_weight_mean"], 2.0)
    batch.policy_versions = torch.zeros_like(batch.policy_versions)
    with pytest.raises(InvalidArgument) as e:
        trainer.step(batch)
    assert e.value.field == "policy_version" and trainer.step_count == 1


def test_kl_to_the_frozen_reference_starts_at_zero_and_grows(model_dir, batches):
    for cfg in (TrainerConfig(kl_coef=0.1, kl_estimator="k3", lr=5e-3, epochs=2),
                TrainerConfig(kl_coef=0.1, kl_in="reward", kl_estimator="k1", lr=5e-3),
                TrainerConfig(kl_coef=0.1, lr=5e-3, lora_rank=4, lora_modules_to_save=["embed_tokens"])):
        trainer = Trainer(model_dir, cfg)
        first = trainer.step(batches[0])
        assert (abs(first["kl_ref"]) < 1e-6) if cfg.epochs == 1 else (first["kl_ref"] > 0), (cfg, first["kl_ref"])
        later = [trainer.step(b)["kl_ref"] for b in batches[1:]]
        assert abs(later[-1]) > 1e-5, (cfg, later)  # k1 may be negative on a sample


def test_entropy_bonus_and_adaptive_kl_move_their_numbers(model_dir, batches):
    trainer = Trainer(model_dir, TrainerConfig(kl_coef=0.1, kl_target=1e-6, kl_horizon=10, entropy_coef=0.01,
                                               lr_schedule="linear", warmup_steps=1, total_steps=3, epochs=2))
    ms = [trainer.step(b) for b in batches]
    assert ms[0]["lr"] == 1e-3 and ms[1]["lr"] == 1e-3 and math.isclose(ms[2]["lr"], 0.5e-3)
    assert ms[0]["entropy"] > 0
    assert ms[2]["kl_coef"] > ms[0]["kl_coef"] > 0.1  # KL above its (tiny) target: beta grows


def test_lora_pushes_merged_weights_under_the_base_names(model_dir, batches):
    trainer = Trainer(model_dir, TrainerConfig(lora_rank=4, lora_modules_to_save=["embed_tokens"], lr=1e-2))
    trainer.step(batches[0])
    merged = trainer.weights()
    engine = HFEngine(model_dir)
    assert set(merged) == set(engine.weight_specs())
    reference = copy.deepcopy(trainer.model).merge_and_unload()  # PEFT's own merge
    for name, p in reference.named_parameters():
        assert torch.allclose(merged[name], p, atol=1e-6), name
    engine.apply_weights(merged, new_version=1)
    results, _ = engine.generate([batches[1].prompts[0]], SamplingParams(n=4, max_tokens=2, seed=0))
    b = Batch([batches[1].prompts[0]] * 4, [c.token_ids for c in results[0].completions],
              torch.tensor([x for c in results[0].completions for x in c.logprobs]), torch.ones(4), torch.zeros(4),
              torch.zeros(4, dtype=torch.long), torch.ones(4, dtype=torch.long), ["x"] * 4, "j")
    with torch.no_grad():  # the engine now serves exactly what the trainer computes
        assert torch.allclose(trainer.token_logprobs(b), b.old_logprobs, atol=1e-4)


RESUME_CONFIGS = {
    "default": TrainerConfig(epochs=2),
    "ppo-gae-everything": TrainerConfig(
        advantage="gae", epochs=2, kl_coef=0.05, kl_target=0.01, kl_in="reward", entropy_coef=0.01, dual_clip=3.0,
        clip_high=0.28, off_policy_correction="tis", max_staleness=4, micro_batch_tokens=80, lr_schedule="cosine",
        warmup_steps=1, total_steps=10, lr_kl_target=1e-4, weight_decay=0.01),
    "gspo-lora": TrainerConfig(policy_loss="gspo", loss_aggregation="seq_mean_token_mean", lora_rank=4,
                               lora_dropout=0.1, lora_modules_to_save=["embed_tokens"], kl_coef=0.02),
}


@pytest.mark.parametrize("name", list(RESUME_CONFIGS))
def test_resume_from_a_checkpoint_gives_a_bit_identical_next_step(model_dir, batches, tmp_path, name):
    cfg = RESUME_CONFIGS[name]
    a = Trainer(model_dir, cfg)
    a.step(batches[0])
    a.step(batches[1])
    path = checkpoint.save(a, tmp_path / "step-2")
    checkpoint.mark_latest(tmp_path, path)
    expected = a.step(batches[2])
    torch.manual_seed(12345)  # the resumed process starts with other RNG state
    b = Trainer(model_dir, cfg.model_copy(update={"seed": 7}))
    checkpoint.load(b, checkpoint.latest(tmp_path))
    assert (b.step_count, b.policy_version, b.data_position["samples"]) == (2, 2, 64)
    got = b.step(batches[2])
    assert {k: v for k, v in got.items() if k not in TIMING} == {k: v for k, v in expected.items() if k not in TIMING}
    pa, pb = params(a), params(b)
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])
    if a.critic is not None:
        assert all(torch.equal(x, y) for x, y in zip(a.critic.parameters(), b.critic.parameters()))
    assert a.lr.scale == b.lr.scale and a.kl.coef == b.kl.coef


def test_checkpoints_refuse_the_wrong_shape_and_are_atomic(model_dir, batches, tmp_path):
    a = Trainer(model_dir, TrainerConfig())
    a.step(batches[0])
    path = checkpoint.save(a, tmp_path / "step-1")
    assert sorted(p.name for p in path.iterdir()) == ["model.safetensors", "optimizer.json", "optimizer.safetensors",
                                                      "rng.safetensors", "trainer.json"]
    assert checkpoint.latest(tmp_path) is None  # not marked yet
    with pytest.raises(InvalidArgument):
        checkpoint.save(a, path)  # never overwritten
    gae = Trainer(model_dir, TrainerConfig(advantage="gae"))
    with pytest.raises(Exception, match="advantage"):
        checkpoint.load(gae, path)
    for step in (2, 3, 4):
        checkpoint.mark_latest(tmp_path, checkpoint.save(a, tmp_path / f"step-{step}"))
    checkpoint.prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-3", "step-4"]
    assert checkpoint.latest(tmp_path).name == "step-4"


def _with_groups(batch: Batch, **changes) -> Batch:
    b = copy.copy(batch)
    b.group_ids = [f"g{i}" for i in range(int(batch.group_index.max()) + 1)]
    for k, v in changes.items():
        setattr(b, k, v)
    return b


def test_sample_weights_scale_each_groups_policy_loss_and_signals_come_back_per_group(model_dir):
    """Replay's importance weights multiply the policy loss of their group's sequences (default
    1); the step reports each group's mean |advantage|, 0 for a group without a learning signal."""
    batch = synthetic_batch(3, n=12)  # 3 groups of 4
    batch.rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0])  # group 0: flat
    groups = int(batch.group_index.max()) + 1
    cfg = TrainerConfig(kl_coef=0.0, entropy_coef=0.0)
    plain = Trainer(model_dir, cfg).step(_with_groups(batch))
    ones = Trainer(model_dir, cfg).step(_with_groups(batch, sample_weights=torch.ones(groups)))
    half = Trainer(model_dir, cfg)
    halved = half.step(_with_groups(batch, sample_weights=torch.full((groups,), 0.5)))
    assert math.isclose(ones["policy_loss"], plain["policy_loss"], rel_tol=1e-6, abs_tol=1e-9)
    assert math.isclose(halved["policy_loss"], 0.5 * plain["policy_loss"], rel_tol=1e-5, abs_tol=1e-9)
    signal = half.group_signals["mean_abs_advantage"]
    assert set(signal) == {"g0", "g1", "g2"} and signal["g0"] == 0.0 and signal["g1"] > 0 and signal["g2"] > 0


@pytest.mark.parametrize("weights, field", [([1.0, 1.0], "sample_weights"), ([1.0, float("nan"), 1.0], "sample_weights[1]"),
                                            ([1.0, 1.0, -0.1], "sample_weights[2]")])
def test_bad_sample_weights_are_refused_naming_the_field(model_dir, weights, field):
    trainer = Trainer(model_dir, TrainerConfig())
    with pytest.raises(InvalidArgument) as e:
        trainer.step(_with_groups(synthetic_batch(3, n=12), sample_weights=torch.tensor(weights)))
    assert e.value.field == field
