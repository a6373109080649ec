"""GPU checks for a CUDA node (not collected by pytest; run as a script):

    PYTHONPATH=services:clients python tests/bench/gpu_check.py OUT.json [MODEL_FILES]

(``--smoke`` instead of OUT.json: the same on the CPU at toy sizes, to check the script itself.
``--sweep`` measures only the GRPO step of 2. at several ``micro_batch_tokens``: 4096 (the default), 16384,
65536 and 0, one micro-batch for the whole batch.)

1. The learner's device tests (``tests/learner/test_memory_and_devices.py``: the CUDA step against the CPU
   step, bf16 autocast where the GPU supports it), which skip on machines without a GPU.
2. The learner on a SmolLM2-135M-shaped model (SmolLM2's config.json and tokenizer, random weights: the
   speed and memory of a step do not depend on the values), one GRPO step of 16 prompts x 8 samples of
   256 + 512 tokens with the defaults (bf16 autocast, fp32 master weights, micro-batches by token
   budget, chunked log-probs): train tokens/s and the allocator's peak, best of 3 after a warm-up; the
   same with autocast off (fp32); and SmolLM2's whole context, 2 x 8192 tokens.
3. The HF inference engine on the GPU (bf16): 32 prompts x n = 8, 256 new tokens each, tokens/s.

Figures go to OUT.json and stdout. MODEL_FILES (default ``.temper/models/smollm2-135m-instruct``) needs only
SmolLM2's config.json and tokenizer files: weights are not read.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from temper.inference.engine import SamplingParams, build_engine
from temper.learner.batching import Batch
from temper.learner.trainer import Trainer, TrainerConfig

REPO = Path(__file__).resolve().parents[2]
SMOLLM2 = REPO / ".temper" / "models" / "smollm2-135m-instruct"
SMOKE = "--smoke" in sys.argv
SWEEP = "--sweep" in sys.argv
DEVICE = "cpu" if SMOKE else "cuda"
FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def random_model(files: Path, folder: Path) -> Path:
    """SmolLM2's architecture and tokenizer with random weights, saved as a model folder."""
    for name in FILES:
        if (files / name).exists():
            shutil.copy(files / name, folder / name)
    config = AutoConfig.from_pretrained(folder)
    if SMOKE:
        config.num_hidden_layers = 2
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    return folder


def batch(prompts: int, samples: int, prompt_tokens: int, completion_tokens: int, vocab: int, seed: int = 0) -> Batch:
    g = random.Random(seed)
    rows_p, rows_c = [], []
    for _ in range(prompts):
        p = [g.randrange(4, vocab) for _ in range(prompt_tokens)]
        for _ in range(samples):
            rows_p.append(p)
            rows_c.append([g.randrange(4, vocab) for _ in range(completion_tokens)])
    n = len(rows_p)
    total = n * completion_tokens
    return Batch(rows_p, rows_c, -torch.rand(total, generator=torch.Generator().manual_seed(seed)) * 3 - 0.01,
                 torch.ones(n), torch.tensor([float(g.random() < 0.5) for _ in range(n)]),
                 torch.arange(n) // samples, torch.zeros(n, dtype=torch.long), ["x"] * n, "gpu-check")


def learner_figures(model_dir: Path, config: TrainerConfig, b: Batch, rounds: int = 3) -> dict:
    trainer = Trainer(model_dir, config)
    trainer.step(b)  # warm-up: kernels, allocator
    best = None
    for _ in range(rounds):
        if DEVICE == "cuda":
            torch.cuda.reset_peak_memory_stats()
        m = trainer.step(b)
        if best is None or m["tokens_per_second"] > best["tokens_per_second"]:
            best = m
    out = {k: best[k] for k in ("tokens_per_second", "train_seconds", "input_tokens", "micro_batches", "loss")}
    out["peak_memory_gib"] = best.get("peak_memory_bytes", best["peak_rss_bytes"]) / 2**30
    out["compute_dtype"] = str(trainer.compute_dtype)
    del trainer
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return out


def main(out_path: str, files: Path) -> int:
    report: dict = {"device": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu", "torch": torch.__version__}
    if not SMOKE and not SWEEP:
        tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "--noconftest", "-p", "no:cacheprovider", "-rs",
                                str(REPO / "tests" / "learner" / "test_memory_and_devices.py")],
                               capture_output=True, text=True, cwd=REPO)
        report["device_tests"] = {"returncode": tests.returncode, "tail": tests.stdout[-1500:] + tests.stderr[-1500:]}
        print(report["device_tests"]["tail"], flush=True)
    scale = 8 if SMOKE else 1

    def sync():
        if DEVICE == "cuda":
            torch.cuda.synchronize()

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = random_model(files, Path(tmp))
        vocab = AutoConfig.from_pretrained(model_dir).vocab_size
        grpo = batch(16 // scale, 8 // scale, 256 // scale, 512 // scale, vocab)
        if SWEEP:
            report["micro_batch_tokens_sweep"] = {
                str(n): learner_figures(model_dir, TrainerConfig(device=DEVICE, micro_batch_tokens=n), grpo)
                for n in (4096, 16384, 65536, 0)}
            print(json.dumps(report["micro_batch_tokens_sweep"], indent=1), flush=True)
            Path(out_path).write_text(json.dumps(report, indent=1))
            return 0
        report["learner_16x8_256+512"] = {
            "defaults": learner_figures(model_dir, TrainerConfig(device=DEVICE), grpo),
            "fp32": learner_figures(model_dir, TrainerConfig(device=DEVICE, autocast="fp32"), grpo),
        }
        report["learner_2x8192"] = learner_figures(model_dir, TrainerConfig(device=DEVICE),
                                                   batch(1, 2, 4096 // scale, 4096 // scale, vocab))
        print(json.dumps({k: v for k, v in report.items() if k.startswith("learner")}, indent=1), flush=True)

        engine = build_engine("hf", model_dir, dtype=torch.bfloat16 if DEVICE == "cuda" else torch.float32,
                              device=DEVICE)
        g = random.Random(1)
        prompts = [[g.randrange(4, vocab) for _ in range(64)] for _ in range(32 // scale)]
        params = SamplingParams(n=8 // scale, temperature=1.0, max_tokens=256 // scale, seed=0)
        engine.generate(prompts[:4], SamplingParams(n=2, max_tokens=8, seed=0))  # warm-up
        sync()
        t0 = time.perf_counter()
        results, _ = engine.generate(prompts, params)
        sync()
        seconds = time.perf_counter() - t0
        tokens = sum(len(c.token_ids) for r in results for c in r.completions)
        report["hf_engine_32x8x256"] = {"tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds}
        engine.close()
        print(json.dumps(report["hf_engine_32x8x256"]), flush=True)
    Path(out_path).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a not in ("--smoke", "--sweep")]
    sys.exit(main(args[0] if args else "gpu_check.json", Path(args[1]) if len(args) > 1 else SMOLLM2))
