"""Per-domain-group LoRA adapters served by both engines (HF, vLLM) on a real tiny model, no server: a prompt
generates with the adapter it names, with exactly the logprobs the learner computes for that adapter; an
adapter not pushed yet is the base; bad adapters and bad adapter updates are refused naming the field."""

from __future__ import annotations

import pytest
import torch

from temper.inference.engine import SamplingParams
from temper.learner.trainer import Batch, Trainer, TrainerConfig
from temper.models.adapters import PREFIX
from temper.runtime.errors import InvalidArgument
from tests.inference.conftest import ENGINES, make_engine
from tests.inference.teacher import max_logprob_error

PROMPTS = ("copy 1 2 3", "next 4", "7 + 1", "copy 9 9 9 9 9 9")
NAMES = ["math", "words"]
CFG = TrainerConfig(lora_rank=4, lora_alpha=8.0, lr=5e-2, lora_adapters=NAMES)


@pytest.fixture(scope="module", params=ENGINES)
def engine(request, tiny_dir):
    e = make_engine(request.param, tiny_dir, lora_adapters=NAMES, max_lora_rank=8)
    yield e
    e.close()


def _batch(results, temperature: float, adapters: list[str]) -> Batch:
    prompts, completions, old, names = [], [], [], []
    for r, a in zip(results, adapters):
        for c in r.completions:
            prompts.append(r.prompt_token_ids)
            completions.append(c.token_ids)
            old.extend(c.logprobs)
            names.append(a)
    n = len(prompts)
    return Batch(prompts=prompts, completions=completions, old_logprobs=torch.tensor(old),
                 temperatures=torch.full((n,), temperature), rewards=torch.tensor([float(i % 3 == 0) for i in range(n)]),
                 group_index=torch.arange(n) // 4, policy_versions=torch.zeros(n, dtype=torch.long),
                 domains=["toy.copy"] * n, job_id="test", group_ids=[f"g{g}" for g in range((n + 3) // 4)],
                 adapters=names)


def test_each_prompt_generates_with_its_adapter_as_the_learner_computes_it(engine, tiny_dir, teacher):
    prompts = [engine.encode(p) for p in PROMPTS]
    params = SamplingParams(n=1, temperature=0.0, max_tokens=6)
    # not pushed yet: an adapter is the base (B = 0), token for token and logprob for logprob
    base, _ = engine.generate(prompts, params)
    named, _ = engine.generate(prompts, params, adapters=["math", "words", "", "math"])
    assert [[c.token_ids for c in r.completions] for r in named] == [[c.token_ids for c in r.completions] for r in base]
    assert all(torch.allclose(torch.tensor(a.completions[0].logprobs), torch.tensor(b.completions[0].logprobs),
                              atol=1e-5) for a, b in zip(named, base))
    trainer = Trainer(tiny_dir, CFG)
    for step in range(2):
        results, _ = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_tokens=6, seed=step))
        trainer.step(_batch(results, 1.0, ["math", "words", "math", "words"]))
    version = engine.policy_version
    assert engine.apply_weights(trainer.weights(), new_version=version + 1) == version + 1
    for adapters in (["math", "words", "words", "math"], ["words", "math", "math", "words"]):
        results, v = engine.generate(prompts, SamplingParams(n=4, temperature=0.8, max_tokens=6, seed=5),
                                     adapters=adapters)
        assert v == version + 1
        batch = _batch(results, 0.8, adapters)
        with torch.no_grad():
            expected = trainer.token_logprobs(batch)
        assert torch.allclose(expected, batch.old_logprobs, atol=1e-4), (expected - batch.old_logprobs).abs().max()
    # the two adapters really differ, and a prompt naming none is still the base model
    with torch.no_grad():
        as_math = trainer.token_logprobs(_batch(results, 0.8, ["math"] * 4))
        as_words = trainer.token_logprobs(_batch(results, 0.8, ["words"] * 4))
    assert (as_math - as_words).abs().max() > 1e-2
    plain, _ = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=9))
    assert max_logprob_error(teacher, plain, 1.0) < 1e-4


def test_bad_adapters_and_adapter_updates_are_refused_naming_the_field(engine, tiny_dir):
    prompts = [engine.encode(p) for p in PROMPTS[:2]]
    with pytest.raises(InvalidArgument) as e:
        engine.generate(prompts, SamplingParams(max_tokens=2), adapters=["math", "poetry"])
    assert e.value.field == "prompts[1].adapter"
    good = Trainer(tiny_dir, CFG).weights()
    math = {n: t for n, t in good.items() if n.startswith(f"{PREFIX}math/")}
    key = next(n for n in math if ".lora_A." in n)
    version = engine.policy_version
    for bad, field in [
        ({n.replace("/math/", "/poetry/"): t for n, t in math.items()}, f"tensor {PREFIX}poetry"),
        ({**math, key: torch.zeros(4, 7)}, f"tensor {PREFIX}math"),  # does not fit the module
        ({**math, key: torch.full_like(math[key], float("nan"))}, f"tensor {PREFIX}math"),
        ({n: t for n, t in math.items() if n != key}, f"tensor {PREFIX}math"),  # lora_B without its lora_A
        ({**math, f"{PREFIX}math/base_model.model.lm_head.bias": torch.zeros(3)}, f"tensor {PREFIX}math"),
        ({**math, "model.norm.weight": torch.ones(64)}, "tensor model.norm.weight"),  # adapters and base at once
    ]:
        with pytest.raises(InvalidArgument) as e:
            engine.apply_weights(bad)
        assert e.value.field == field, (field, e.value)
    wide = Trainer(tiny_dir, CFG.model_copy(update={"lora_rank": 16})).weights()
    with pytest.raises(InvalidArgument, match="rank 16"):
        engine.apply_weights(wide)
    assert engine.policy_version == version  # nothing installed


def test_a_server_without_adapters_refuses_them(tiny_dir):
    engine = make_engine("hf", tiny_dir)
    try:
        with pytest.raises(InvalidArgument) as e:
            engine.generate([engine.encode("copy 1")], SamplingParams(max_tokens=2), adapters=["math"])
        assert e.value.field == "prompts[0].adapter"
        with pytest.raises(InvalidArgument, match="serves no LoRA adapters"):
            engine.apply_weights(Trainer(tiny_dir, CFG).weights())
    finally:
        engine.close()
