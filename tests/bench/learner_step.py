"""One GRPO step of the trainer on a real model, in a process of its own (the learner benchmark).

    python -m tests.bench.learner_step '{"model_dir": ..., "seq_len": 512, "n": 16, "config": {...},
                                         "rss_cap_bytes": ..., "group_size": 8}'

Prints one JSON line: train tokens/s (prompt + completion tokens / step seconds), the process's
peak RSS (getrusage high-water mark: torch allocates outside Python, so tracemalloc would not
see it) and the RSS after loading, before the step. A watchdog thread aborts the process once
its RSS passes ``rss_cap_bytes`` (the machine is shared), printing ``{"aborted_over_bytes": ...}``.
"""

from __future__ import annotations

import json
import os
import random
import resource
import sys
import threading
import time

PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def _watchdog(cap: int) -> None:
    while True:
        rss = _rss()
        if rss > cap:
            print(json.dumps({"aborted_over_bytes": cap, "rss_bytes": rss}), flush=True)
            os._exit(3)
        time.sleep(0.05)


def main(spec: dict) -> dict:
    import torch

    from temper.learner.batching import Batch
    from temper.learner.trainer import Trainer, TrainerConfig

    torch.set_num_threads(int(spec.get("threads", 2)))
    threading.Thread(target=_watchdog, args=(int(spec["rss_cap_bytes"]),), daemon=True).start()
    trainer = Trainer(spec["model_dir"], TrainerConfig(**spec["config"]))
    loaded_rss = _rss()
    rng = random.Random(0)
    n, seq_len, prompt_len = int(spec["n"]), int(spec["seq_len"]), int(spec.get("prompt_len", 64))
    vocab = trainer.vocab_size
    group = int(spec.get("group_size", 1))  # consecutive sequences sharing one prompt (a GRPO group)
    prompts = [[rng.randrange(4, vocab) for _ in range(prompt_len)] for _ in range(-(-n // group))]
    prompts = [list(prompts[i // group]) for i in range(n)]
    completions = [[rng.randrange(4, vocab) for _ in range(seq_len - prompt_len)] for _ in range(n)]
    total = n * (seq_len - prompt_len)
    batch = Batch(prompts, completions, -torch.rand(total, generator=torch.Generator().manual_seed(0)) * 3 - 0.01,
                  torch.ones(n), torch.tensor([float(i % 2) for i in range(n)]), torch.arange(n) // 4,
                  torch.zeros(n, dtype=torch.long), ["bench"] * n, "bench")
    m = trainer.step(batch)
    return {"tokens": m["input_tokens"], "seconds": m["train_seconds"], "tokens_per_second": m["tokens_per_second"],
            "micro_batches": m["micro_batches"], "loaded_rss_bytes": loaded_rss,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "device": str(trainer.device), "autocast": str(trainer.compute_dtype)}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))), flush=True)
