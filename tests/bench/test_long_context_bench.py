"""Generation at SmolLM2's whole context (8,192 tokens) through the vLLM engine on this machine's CPU
(`make bench`): a prompt that fills the context but for the answer's room, answered greedily; the paged KV
cache sized for it (46 KB a token in fp32 here: 30 layers x K and V x 3 heads x 64). Reports prefill + decode
seconds, tokens/s and the process's peak RSS; and that a prompt with no room left is refused naming the
field, before anything runs. (Training at 8k: tests/bench/test_learner_bench.py, TEMPER_BENCH_SHAPES.)"""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path

import pytest

from temper.inference.engine import SamplingParams, build_engine
from temper.models.smollm2 import DEFAULT_DIR, ensure_smollm2
from temper.runtime.errors import InvalidArgument

pytestmark = [pytest.mark.bench, pytest.mark.timeout(1800)]

MODEL_DIR = Path(__file__).resolve().parents[2] / DEFAULT_DIR
CONTEXT, NEW_TOKENS = 8192, 256
TEXT = ("The river rose through the night and by morning the lower fields were under water. The farmers moved "
        "their animals to the ridge, counted them twice, and waited for the rain to stop. ")


@pytest.fixture(autouse=True)
def vllm_env(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")


def test_generation_at_the_whole_context():
    model_dir = ensure_smollm2(MODEL_DIR)
    engine = build_engine("vllm", model_dir, dtype="auto", max_model_len=CONTEXT,
                          kv_cache_memory_bytes=512 << 20)
    try:
        question = "\n\nIn one sentence: what did the farmers do?"
        def prompt_of(repeats: int) -> list[int]:
            return engine.encode(TEXT * repeats + question, apply_chat_template=True)

        repeats = 1  # as many as fit with room for the answer
        while len(prompt_of(repeats * 2)) <= CONTEXT - NEW_TOKENS:
            repeats *= 2
        step = repeats // 2
        while step:
            if len(prompt_of(repeats + step)) <= CONTEXT - NEW_TOKENS:
                repeats += step
            step //= 2
        prompt = prompt_of(repeats)
        assert CONTEXT - NEW_TOKENS - 128 < len(prompt) <= CONTEXT - NEW_TOKENS, len(prompt)
        t0 = time.perf_counter()
        results, _ = engine.generate([prompt], SamplingParams(n=1, temperature=0.0, max_tokens=NEW_TOKENS))
        seconds = time.perf_counter() - t0
        completion = results[0].completions[0]
        assert 0 < len(completion.token_ids) <= NEW_TOKENS
        total = len(prompt) + len(completion.token_ids)
        too_long = prompt + prompt[:NEW_TOKENS]
        with pytest.raises(InvalidArgument) as e:
            engine.generate([too_long], SamplingParams(n=1, max_tokens=NEW_TOKENS))
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        print(f"\n-- long context: SmolLM2 vLLM on {os.cpu_count()} cores, prompt {len(prompt)} tokens + "
              f"{len(completion.token_ids)} generated = {total} of {CONTEXT}: {seconds:.1f} s "
              f"({total / seconds:.0f} tokens/s prefill + decode), peak RSS {peak:.2f} GiB; a {len(too_long)}-token "
              f"prompt refused: {e.value.field}: {e.value.message[:120]}")
    finally:
        engine.close()
