"""The learner's importance ratios depend on inference logprobs matching a teacher-forced pass."""

import pytest
import torch

from temper.inference.engine import HFEngine, SamplingParams
from temper.learner.trainer import Batch, Trainer, TrainerConfig
from temper.models.tiny import build_tiny_model
from temper.runtime.errors import InvalidArgument


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=3)


def _batch(engine, results, temperature):
    prompts, comps, old = [], [], []
    for r in results:
        for c in r.completions:
            prompts.append(r.prompt_token_ids)
            comps.append(c.token_ids)
            old.extend(c.logprobs)
    n = len(prompts)
    return Batch(prompts, comps, torch.tensor(old), torch.full((n,), temperature), torch.rand(n),
                 torch.arange(n) // 4, torch.zeros(n, dtype=torch.long), ["toy.copy"] * n, "j")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_generate_logprobs_match_teacher_forcing_before_and_after_update(model_dir, temperature):
    engine = HFEngine(model_dir)
    trainer = Trainer(model_dir, TrainerConfig(lr=5e-3))
    # prompts of different lengths: left padding must not shift positions
    prompts = [engine.encode(p) for p in ("copy 1 2 3", "next 4", "7 + 1", "copy 9 9 9 9 9 9")]
    params = SamplingParams(n=4, temperature=temperature, max_tokens=4, seed=1)
    results, version = engine.generate(prompts, params)
    assert version == 0
    batch = _batch(engine, results, temperature)
    with torch.no_grad():
        teacher = trainer.token_logprobs(batch)
    assert torch.allclose(teacher, batch.old_logprobs, atol=1e-4), (teacher - batch.old_logprobs).abs().max()
    trainer.step(batch)
    assert engine.apply_weights(trainer.weights(), new_version=1) == 1
    results, version = engine.generate(prompts, params)
    assert version == 1
    batch = _batch(engine, results, temperature)
    with torch.no_grad():
        teacher = trainer.token_logprobs(batch)
    assert torch.allclose(teacher, batch.old_logprobs, atol=1e-4), (teacher - batch.old_logprobs).abs().max()


def test_bad_weight_updates_leave_the_old_version_serving(model_dir):
    engine = HFEngine(model_dir)
    good = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    before = {n: t.clone() for n, t in good.items()}
    name = next(iter(good))
    cases = {
        "missing": {k: v for k, v in good.items() if k != name},
        "extra": {**good, "bogus.weight": torch.zeros(2)},
        "misshapen": {**good, name: torch.zeros(3, 3)},
        "nan": {**good, name: torch.full_like(good[name], float("nan"))},
    }
    for label, tensors in cases.items():
        with pytest.raises(InvalidArgument) as e:
            engine.apply_weights(tensors)
        assert e.value.field.startswith("tensor "), label
    assert engine.policy_version == 0
    for n, p in engine.model.named_parameters():
        assert torch.equal(p, before[n])


def test_generate_validation_names_fields(model_dir):
    engine = HFEngine(model_dir)
    ids = engine.encode("copy 1 2 3")
    for prompts, params, field in [
        ([], SamplingParams(), "prompts"),
        ([ids], SamplingParams(n=0), "sampling.n"),
        ([ids], SamplingParams(max_tokens=0), "sampling.max_tokens"),
        ([ids], SamplingParams(max_tokens=10_000), "sampling.max_tokens"),
        ([ids * 100], SamplingParams(max_tokens=8), "prompts[0]"),
        ([[10_000]], SamplingParams(), "prompts[0].token_ids"),
    ]:
        with pytest.raises(InvalidArgument) as e:
            engine.generate(prompts, params)
        assert e.value.field == field
