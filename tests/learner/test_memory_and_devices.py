"""Memory-bounded training: chunked LM-head log-probs are the straightforward ones (values and
gradients), gradient checkpointing and micro-batch defaults change no numbers, bf16 autocast on
CPU stays close to fp32, device / dtype settings are validated, pushed weights are in the
engine's dtype. CUDA paths: tests skip with the reason where no GPU is present."""

import copy
import math
import os
import random
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from temper.learner.batching import Batch, layout
from temper.learner.trainer import Trainer, TrainerConfig, autocast_dtype, resolve_device, stored_dtype
from temper.models.dtypes import cpu_has_native_bf16
from temper.models.tiny import build_tiny_model
from temper.runtime.errors import InvalidArgument

SMOLLM2 = Path(__file__).resolve().parents[2] / ".temper" / "models" / "smollm2-135m-instruct"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


def random_batch(seed: int, n: int, vocab: int, prompt: tuple[int, int] = (2, 20), completion: tuple[int, int] = (1, 12),
                 temperature: float = 0.8) -> Batch:
    g = random.Random(seed)
    prompts = [[g.randrange(4, vocab) for _ in range(g.randint(*prompt))] for _ in range(n)]
    completions = [[g.randrange(4, vocab) for _ in range(g.randint(*completion))] for _ in range(n)]
    total = sum(map(len, completions))
    return Batch(prompts, completions, -torch.rand(total, generator=torch.Generator().manual_seed(seed)) * 3 - 0.01,
                 torch.tensor([temperature if i % 2 else 1.0 for i in range(n)]),
                 torch.tensor([float(g.random() < 0.5) for _ in range(n)]), torch.arange(n) // 4,
                 torch.zeros(n, dtype=torch.long), ["x"] * n, "j")


def straightforward(model, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Full logits of every position, log_softmax, gather: the computation chunking must reproduce."""
    x = layout(batch.prompts, batch.completions, batch.temperatures, 0, packing=False)
    logits = model(input_ids=x.input_ids, attention_mask=x.attention_mask, use_cache=False).logits.float()
    logp = (logits[x.rows, x.cols] / x.temperatures.unsqueeze(-1)).log_softmax(-1)
    return logp.gather(-1, x.targets.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def chunked(trainer: Trainer, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    out = [trainer._logprobs(trainer.model, mb, entropy_grad=True) for mb in trainer._micro_batches(batch)]
    return torch.cat([o[0] for o in out]), torch.cat([o[1] for o in out])


def _compare(model_dir: Path, batch: Batch, chunk_tokens: int, check_grads: bool = True) -> None:
    trainer = Trainer(model_dir, TrainerConfig(autocast="fp32", logprob_chunk_tokens=chunk_tokens,
                                               micro_batch_tokens=0, device="cpu"))
    plain = copy.deepcopy(trainer.model)
    plain.gradient_checkpointing_disable()
    lp, ent = chunked(trainer, batch)
    ref_lp, ref_ent = straightforward(plain, batch)
    assert lp.dtype == torch.float32 and lp.shape == ref_lp.shape
    # relative bounds: fp32 round-off of different matmul shapes (a chunk of rows vs the whole batch; the
    # BLAS kernel picked differs by CPU) is a few ulps of the value. A random SmolLM2 token's log-prob is
    # -10..-22, where one ulp is 1-2e-6: one AMD EPYC measured 1.9e-5 absolute there (1.0e-6 relative).
    # The entropy sums ~V terms (49,152 for SmolLM2), whose fp32 round-off grows like sqrt(V) * eps = 2.6e-5
    # relative: measured 3e-6 on one machine, 1.35e-5 on another, so 1e-4 (a wrong position or temperature
    # is off by > 1e-2)
    assert ((lp - ref_lp).abs() / ref_lp.abs().clamp(min=1.0)).max().item() < 1e-5
    assert ((ent - ref_ent).abs() / ref_ent.abs().clamp(min=1.0)).max().item() < 1e-4
    if not check_grads:
        return
    weights = torch.randn(lp.shape, generator=torch.Generator().manual_seed(1))
    (lp * weights).sum().add((ent * weights).sum()).backward()
    (ref_lp * weights).sum().add((ref_ent * weights).sum()).backward()
    theirs = dict(plain.named_parameters())
    # a gradient element is a sum over every position: where terms cancel, its round-off is relative to the
    # tensor's largest values, not its own (a many-threaded BLAS sums in another order: a 16-core Xeon was
    # off by more than 1e-6 of the largest once in two runs), hence atol 1e-5 of the largest
    for name, p in trainer.model.named_parameters():
        q = theirs[name]
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-5 * max(1.0, q.grad.abs().max().item())), name


@pytest.mark.parametrize("chunk_tokens", [1, 7, 1024])
def test_chunked_logprobs_and_gradients_equal_the_full_logits_computation(model_dir, chunk_tokens):
    _compare(model_dir, random_batch(0, 10, vocab=25), chunk_tokens)


def test_chunked_logprobs_equal_the_full_logits_computation_on_smollm2():
    if not (SMOLLM2 / "config.json").exists():
        pytest.skip(f"SmolLM2 is not at {SMOLLM2}")
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    _compare(SMOLLM2, random_batch(0, 3, vocab=49_152, prompt=(8, 16), completion=(8, 24)), chunk_tokens=16,
             check_grads=False)


def test_the_lm_head_never_sees_more_than_a_chunk(model_dir):
    """The head's largest input during forward and backward is one chunk of rows."""
    trainer = Trainer(model_dir, TrainerConfig(logprob_chunk_tokens=5, micro_batch_tokens=0, autocast="fp32"))
    head = trainer.model.get_output_embeddings()
    rows: list[int] = []
    handle = head.register_forward_hook(lambda mod, args, out: rows.append(args[0].shape[0]))
    batch = random_batch(3, 8, vocab=25)
    lp, _ = chunked(trainer, batch)
    lp.sum().backward()  # recomputation in backward runs the head again, chunk by chunk
    handle.remove()
    n = len(lp)
    assert max(rows) == 5 and len(rows) == 2 * math.ceil(n / 5), (rows, n)


def test_gradient_checkpointing_and_the_default_micro_batches_change_no_numbers(model_dir):
    batch = random_batch(4, 24, vocab=25, completion=(4, 30))
    # on the CPU, where sums over micro-batches are exact to float rounding (on a GPU, kernels pick their own
    # reduction order per shape: the CUDA test compares against the CPU step with a tolerance instead)
    plain = Trainer(model_dir, TrainerConfig(gradient_checkpointing=False, micro_batch_tokens=0,
                                             logprob_chunk_tokens=0, autocast="fp32", device="cpu"))
    bounded = Trainer(model_dir, TrainerConfig(micro_batch_tokens=200, logprob_chunk_tokens=16, autocast="fp32",
                                               device="cpu"))
    assert bounded.config.gradient_checkpointing and TrainerConfig().micro_batch_tokens > 0
    m1, m2 = plain.step(batch), bounded.step(batch)
    assert m1["micro_batches"] == 1 and m2["micro_batches"] > 1
    assert math.isclose(m1["loss"], m2["loss"], rel_tol=1e-5) and math.isclose(m1["grad_norm"], m2["grad_norm"],
                                                                                 rel_tol=1e-4)
    b = dict(bounded.model.named_parameters())
    assert max((p - b[n]).abs().max().item() for n, p in plain.model.named_parameters()) < 1e-6


def test_bf16_autocast_on_cpu_trains_with_fp32_master_weights(model_dir):
    batch = random_batch(5, 12, vocab=25)
    fp32 = Trainer(model_dir, TrainerConfig(autocast="fp32"))
    bf16 = Trainer(model_dir, TrainerConfig(autocast="bf16"))
    assert bf16.compute_dtype == torch.bfloat16 and fp32.compute_dtype is None
    with torch.no_grad():
        a, b = fp32.token_logprobs(batch), bf16.token_logprobs(batch)
    assert b.dtype == torch.float32 and 0 < (a - b).abs().max().item() < 0.05  # bf16 matmuls: close, not equal
    m = bf16.step(batch)
    assert math.isfinite(m["loss"]) and m["grad_norm"] > 0
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())
    assert all(s["exp_avg"].dtype == torch.float32 for s in bf16.optimizer.state.values())


def test_pushed_weights_are_in_the_engines_dtype(model_dir):
    assert stored_dtype(model_dir) == torch.float32
    if (SMOLLM2 / "config.json").exists():
        assert stored_dtype(SMOLLM2) == torch.bfloat16  # so a SmolLM2 learner pushes half the bytes
    auto = Trainer(model_dir, TrainerConfig())
    assert {t.dtype for t in auto.push_weights().values()} == {torch.float32}
    bf16 = Trainer(model_dir, TrainerConfig(push_dtype="bf16"))
    pushed, master = bf16.push_weights(), bf16.weights()
    assert set(pushed) == set(master) and {t.dtype for t in pushed.values()} == {torch.bfloat16}
    assert all(torch.equal(pushed[n], master[n].to(torch.bfloat16)) for n in master)
    assert sum(t.numel() * t.element_size() for t in pushed.values()) * 2 == \
        sum(t.numel() * t.element_size() for t in master.values())


def test_device_and_dtype_settings_are_validated_naming_the_field(model_dir):
    for bad in ("gpu", "cuda:x", "tpu", ""):
        with pytest.raises(ValidationError) as e:
            TrainerConfig(device=bad)
        assert e.value.errors()[0]["loc"] == ("device",)
    for field, bad in (("autocast", "fp8"), ("push_dtype", "int8")):
        with pytest.raises(ValidationError) as e:
            TrainerConfig(**{field: bad})
        assert e.value.errors()[0]["loc"] == (field,)
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    cpu = torch.device("cpu")  # auto on CPU: exact fp32 for fp32-stored models, bf16 for bf16 ones where it pays
    assert autocast_dtype("auto", cpu, torch.float32) is None
    assert Trainer(model_dir, TrainerConfig(device="cpu")).compute_dtype is None
    assert autocast_dtype("auto", cpu, torch.bfloat16) == (torch.bfloat16 if cpu_has_native_bf16() else None)
    assert autocast_dtype("fp32", cpu, torch.bfloat16) is None and autocast_dtype("bf16", cpu) == torch.bfloat16
    if not torch.cuda.is_available():
        with pytest.raises(InvalidArgument) as e:
            Trainer(model_dir, TrainerConfig(device="cuda"))
        assert e.value.field == "device"
    assert Trainer(model_dir, TrainerConfig(device="cpu")).step(random_batch(6, 8, vocab=25))["peak_rss_bytes"] > 0


@needs_cuda
def test_a_cuda_step_matches_the_cpu_step_and_reports_device_memory(model_dir):
    batch = random_batch(7, 16, vocab=25)
    cpu = Trainer(model_dir, TrainerConfig(device="cpu", autocast="fp32"))
    gpu = Trainer(model_dir, TrainerConfig(device="cuda", autocast="fp32", advantage="gae", kl_coef=0.05,
                                           off_policy_correction="tis", policy_loss="gspo"))
    assert next(gpu.model.parameters()).device.type == "cuda"
    m_gpu = gpu.step(batch)
    assert m_gpu["peak_memory_bytes"] > 0 and math.isfinite(m_gpu["loss"])
    gpu_plain = Trainer(model_dir, TrainerConfig(device="cuda", autocast="fp32"))
    m_cpu, m_plain = cpu.step(batch), gpu_plain.step(batch)
    assert math.isclose(m_cpu["loss"], m_plain["loss"], rel_tol=1e-4, abs_tol=1e-6)
    bf16 = Trainer(model_dir, TrainerConfig(device="cuda"))  # auto: bf16 autocast where the GPU supports it
    assert bf16.compute_dtype == (torch.bfloat16 if torch.cuda.is_bf16_supported() else None)
    assert math.isfinite(bf16.step(batch)["loss"])


def test_cpu_threads_sets_the_trainers_torch_threads(model_dir):
    # the launcher starts services with OMP_NUM_THREADS=1; a real model's learner asks for more
    before = torch.get_num_threads()
    try:
        Trainer(model_dir, TrainerConfig(cpu_threads=2, autocast="fp32"))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValidationError):
        TrainerConfig(cpu_threads=-1)


@pytest.mark.parametrize("native", [True, False])
def test_dtype_auto_is_fp32_on_a_cpu_without_native_bf16_on_both_sides(monkeypatch, native):
    """Inference's dtype "auto" and the learner's push_dtype "auto" resolve by one rule, so the pushed policy is
    the engine's dtype: as stored where the CPU multiplies bf16 natively, fp32 where bf16 is emulated."""
    import temper.learner.trainer as trainer
    import temper.models.dtypes as dtypes

    monkeypatch.setattr(dtypes, "cpu_has_native_bf16", lambda: native)
    monkeypatch.setattr(trainer, "cpu_has_native_bf16", lambda: native)
    cpu = torch.device("cpu")
    assert dtypes.resolve_cpu_dtype("auto") == ("auto" if native else "float32")
    assert dtypes.resolve_cpu_dtype("bfloat16") == "bfloat16"  # an explicit setting is kept
    assert trainer.push_dtype("auto", cpu, torch.bfloat16) == (torch.bfloat16 if native else torch.float32)
    assert trainer.push_dtype("auto", cpu, torch.float32) == torch.float32
    assert trainer.push_dtype("bf16", cpu, torch.float32) == torch.bfloat16
    assert trainer.push_dtype("auto", torch.device("meta"), torch.bfloat16) == torch.bfloat16  # not a CPU: as stored
