"""Both engines (HF, vLLM) behind the one interface, on a real tiny model, no server.

Every test runs once per engine kind (the ``engine`` fixture is parametrized).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from temper.inference.engine import SamplingParams
from temper.learner.trainer import Batch, Trainer, TrainerConfig
from temper.runtime.errors import FailedPrecondition, InvalidArgument
from tests.conftest import wait_until
from tests.inference.teacher import max_logprob_error, perturbed, set_weights, teacher_logits

PROMPTS = ("copy 1 2 3", "next 4", "7 + 1", "copy 9 9 9 9 9 9")  # different lengths: padding must not shift


def _prompts(engine):
    return [engine.encode(p) for p in PROMPTS]


def _batch(results, temperature: float) -> Batch:
    prompts, completions, old = [], [], []
    for r in results:
        for c in r.completions:
            prompts.append(r.prompt_token_ids)
            completions.append(c.token_ids)
            old.extend(c.logprobs)
    n = len(prompts)
    return Batch(prompts=prompts, completions=completions, old_logprobs=torch.tensor(old),
                 temperatures=torch.full((n,), temperature or 1.0), rewards=torch.rand(n),
                 group_index=torch.arange(n) // 4, policy_versions=torch.zeros(n, dtype=torch.long),
                 domains=["toy.copy"] * n, job_id="test", group_ids=[f"g{g}" for g in range((n + 3) // 4)])


def test_logprobs_match_the_learners_teacher_forcing_before_and_after_an_update(engine, tiny_dir, teacher):
    trainer = Trainer(tiny_dir, TrainerConfig(lr=5e-3, kl_coef=0.0))
    version = engine.policy_version
    for temperature in (1.0, 0.7, 0.0):
        results, v = engine.generate(_prompts(engine), SamplingParams(n=4, temperature=temperature, max_tokens=6,
                                                                      seed=1))
        assert v == version
        batch = _batch(results, temperature)
        with torch.no_grad():
            expected = trainer.token_logprobs(batch)
        assert torch.allclose(expected, batch.old_logprobs, atol=1e-4), (expected - batch.old_logprobs).abs().max()
    trainer.step(batch)
    assert engine.apply_weights(trainer.weights(), new_version=version + 1) == version + 1
    for temperature in (1.0, 0.7):  # right after the update: no stale KV / prefix cache, no stale lm_head
        results, v = engine.generate(_prompts(engine), SamplingParams(n=4, temperature=temperature, max_tokens=6,
                                                                      seed=2))
        assert v == version + 1
        batch = _batch(results, temperature)
        with torch.no_grad():
            expected = trainer.token_logprobs(batch)
        assert torch.allclose(expected, batch.old_logprobs, atol=1e-4), (expected - batch.old_logprobs).abs().max()
    engine.apply_weights({n: p.detach() for n, p in teacher.named_parameters()})  # back to the checkpoint


@pytest.mark.parametrize("top_k,top_p", [(3, 1.0), (0, 0.6), (5, 0.8)])
def test_logprobs_with_top_k_top_p_are_those_of_the_filtered_distribution(engine, teacher, top_k, top_p):
    temperature = 0.8
    results, _ = engine.generate(_prompts(engine), SamplingParams(n=4, temperature=temperature, top_k=top_k,
                                                                  top_p=top_p, max_tokens=5, seed=3))
    for r in results:
        for c in r.completions:
            scores = teacher_logits(teacher, r.prompt_token_ids, c.token_ids) / temperature
            ids = torch.tensor(c.token_ids)
            if top_k:
                scores = TopKLogitsWarper(top_k)(None, scores)
            if top_p < 1:
                scores = TopPLogitsWarper(top_p)(None, scores)
            expected = scores.log_softmax(-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
            assert torch.isfinite(expected).all(), "a sampled token lies outside the top-k / top-p set"
            assert torch.allclose(expected, torch.tensor(c.logprobs), atol=1e-4)


def test_sampling_controls(engine):
    prompts = _prompts(engine)
    a, _ = engine.generate(prompts, SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=7))
    b, _ = engine.generate(prompts, SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=7))
    c, _ = engine.generate(prompts, SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=8))
    ids = lambda rs: [comp.token_ids for r in rs for comp in r.completions]  # noqa: E731
    assert ids(a) == ids(b), "same seed, same samples"
    assert ids(a) != ids(c), "another seed, other samples"
    assert [r.prompt_token_ids for r in a] == prompts
    eos = engine.tokenizer.eos_token_id
    for r in a:
        assert len(r.completions) == 3
        for comp in r.completions:
            assert len(comp.token_ids) == len(comp.logprobs) <= 8
            assert all(x <= 0 for x in comp.logprobs)
            assert comp.text.strip() == engine.tokenizer.decode(comp.token_ids, skip_special_tokens=True).strip()
            if comp.finish_reason == "length":
                assert len(comp.token_ids) == 8 and eos not in comp.token_ids
            else:
                assert comp.finish_reason == "stop" and comp.token_ids[-1] == eos and eos not in comp.token_ids[:-1]
    greedy, _ = engine.generate(prompts[:1], SamplingParams(n=2, temperature=0.0, max_tokens=8))
    first, second = greedy[0].completions
    assert first.token_ids == second.token_ids
    # stop strings: generation ends at the token that completes one; it is kept in the text
    stops, _ = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_tokens=12, stop=["+", "9"],
                                                       seed=11))
    decode = lambda ids: engine.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    stopped = 0
    for r in stops:
        for comp in r.completions:
            before = decode(comp.token_ids[:-1])
            assert "+" not in before and "9" not in before, "generation ran past a stop string"
            if comp.finish_reason == "stop" and comp.token_ids[-1] != eos:
                assert "+" in comp.text or "9" in comp.text
                stopped += 1
    assert stopped > 0


def test_bad_input_names_the_field(engine):
    ids = engine.encode("copy 1 2 3")
    too_long = ids * (engine.context_length // len(ids) + 1)
    for prompts, params, field in [
        ([], SamplingParams(), "prompts"),
        ([ids], SamplingParams(n=0), "sampling.n"),
        ([ids], SamplingParams(max_tokens=0), "sampling.max_tokens"),
        ([ids], SamplingParams(max_tokens=engine.context_length), "sampling.max_tokens"),
        ([ids], SamplingParams(temperature=-0.5), "sampling.temperature"),
        ([ids], SamplingParams(top_p=0.0), "sampling.top_p"),
        ([ids], SamplingParams(top_k=-1), "sampling.top_k"),
        ([ids], SamplingParams(stop=[""]), "sampling.stop[0]"),
        ([ids, too_long], SamplingParams(max_tokens=8), "prompts[1]"),
        ([ids, []], SamplingParams(), "prompts[1]"),
        ([[engine.vocab_size]], SamplingParams(), "prompts[0].token_ids"),
    ]:
        with pytest.raises(InvalidArgument) as e:
            engine.generate(prompts, params)
        assert e.value.field == field
    with pytest.raises(InvalidArgument) as e:  # the tiny tokenizer has no chat template
        engine.encode("copy 1", apply_chat_template=True, field_name="prompts[0]")
    assert e.value.field == "prompts[0].apply_chat_template"


def _greedy(engine):
    results, version = engine.generate(_prompts(engine), SamplingParams(temperature=0.0, max_tokens=6))
    return [(c.token_ids, c.logprobs) for r in results for c in r.completions], version


def test_bad_updates_leave_the_old_version_serving(engine, teacher):
    before, version = _greedy(engine)
    good = perturbed(teacher)
    name = next(iter(good))
    cases = {
        "missing": {k: v for k, v in good.items() if k != name},
        "extra": {**good, "bogus.weight": torch.zeros(2)},
        "misshapen": {**good, name: torch.zeros(3, 3)},
        "nan": {**good, name: torch.full_like(good[name], float("nan"))},
        "integer": {**good, name: good[name].long()},
    }
    for label, tensors in cases.items():
        with pytest.raises(InvalidArgument) as e:
            engine.apply_weights(tensors)
        assert e.value.field in (f"tensor {name}", "tensor bogus.weight"), label
    with pytest.raises(InvalidArgument) as e:
        engine.apply_weights(good, new_version=version)  # not newer than what serves
    assert e.value.field == "new_version"
    after, version_after = _greedy(engine)
    assert version_after == version
    assert after == before


def test_a_failed_installation_rolls_back(engine, teacher):
    before, version = _greedy(engine)
    install = engine._load_weights
    calls = []

    def half_then_fail(tensors):  # installs part of the update for real, then fails
        calls.append(tensors)
        if len(calls) == 1:
            install(dict(list(tensors.items())[: len(tensors) // 2]))
            raise RuntimeError("injected failure half-way")
        install(tensors)

    engine._load_weights = half_then_fail
    try:
        with pytest.raises(FailedPrecondition, match="rolled back"):
            engine.apply_weights(perturbed(teacher, seed=5))
    finally:
        del engine._load_weights
    assert len(calls) == 2  # the update, then the rollback
    after, version_after = _greedy(engine)
    assert version_after == version
    for (ids_a, lp_a), (ids_b, lp_b) in zip(before, after):
        assert ids_a == ids_b and torch.allclose(torch.tensor(lp_a), torch.tensor(lp_b), atol=1e-5)


def test_concurrent_callers_are_batched(engine):
    prompts = _prompts(engine)
    results, errors = {}, []
    engine.max_jobs_in_flight = 0

    def call(k):
        try:
            results[k] = engine.generate(prompts[k % 4:k % 4 + 1], SamplingParams(n=2, temperature=1.0,
                                                                                  max_tokens=16))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=call, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(results) == 8
    for k, (res, _) in results.items():
        assert res[0].prompt_token_ids == prompts[k % 4] and len(res[0].completions) == 2
    assert engine.max_jobs_in_flight > 1, "concurrent calls were served one by one"


def test_an_update_never_splits_a_generation(engine, teacher):
    """A generation in flight when an update arrives finishes on the old weights, reported as such;
    one submitted after it runs on the new weights."""
    checkpoint = {n: p.detach().clone() for n, p in teacher.named_parameters()}
    other = perturbed(teacher, scale=0.2, seed=9)
    prompts = _prompts(engine)
    serving, overlapped = checkpoint, False
    try:
        for _ in range(5):  # until the update really arrives mid-generation
            target = other if serving is checkpoint else checkpoint
            start_version = engine.policy_version
            out = {}

            def long_generation(out=out):
                out["results"] = engine.generate(prompts, SamplingParams(n=8, temperature=1.0, max_tokens=100))
                out["finished"] = time.monotonic()

            thread = threading.Thread(target=long_generation)
            thread.start()
            wait_until(lambda: engine._running or not thread.is_alive(), 60, interval=0.0005,  # noqa: B023
                       what="the generation to start")
            submitted = time.monotonic()
            assert engine.apply_weights(target) == start_version + 1
            thread.join(60)
            in_flight, in_flight_version = out["results"]
            assert in_flight_version == start_version
            set_weights(teacher, serving)
            assert max_logprob_error(teacher, in_flight, 1.0) < 1e-4
            after, after_version = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=8))
            assert after_version == start_version + 1
            set_weights(teacher, target)
            assert max_logprob_error(teacher, after, 1.0) < 1e-4
            serving = target
            if out["finished"] > submitted:
                overlapped = True
                break
    finally:
        set_weights(teacher, checkpoint)
        if serving is not checkpoint:
            engine.apply_weights(checkpoint)
    assert overlapped, "the update never arrived while a generation was in flight"


def test_seeded_batch_larger_than_one_prefill_step(engine):
    # 60 prompts x 100 tokens: more prompt tokens than vLLM schedules in one step (4096). A seeded
    # request whose prompt vLLM prefilled in chunks failed the whole batch on CPU ("CPU Generator
    # does not use offset") -- every training step of a real job with a seed.
    vocab = engine.tokenizer.vocab_size
    prompts = [[3 + (7 * i + j) % (vocab - 3) for j in range(100)] for i in range(60)]
    results, _ = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_tokens=4, seed=5))
    assert [r.prompt_token_ids for r in results] == prompts
    assert all(len(r.completions) == 4 and all(c.token_ids for c in r.completions) for r in results)
