"""Reward benchmark (`make bench`): scored samples/s for a math batch and a code batch, and reward-model
batch scoring through the service's dynamic batching against a direct forward of the same batch.

Baselines, measured in the same run:
- math: math-verify called directly (parse + verify, one process, no workers) on the same answers;
- code: the same programs sent one RunTests call at a time through the SDK's SandboxClient;
- reward model: one ``RewardModelEngine.forward`` of the already-encoded batch (the model alone).
Goal (issue 7): reward-model throughput through the batching path >= 0.9 of the direct forward.
"""

from __future__ import annotations

import json
import random
import statistics
import threading
import time

import pytest

from temper.reward.core import Scorer
from temper.reward.models import RewardModelEngine, build_tiny_reward_model
from temper.reward.settings import CodeOptions, MathOptions, RewardSettings
from temper.reward.verifiers.code import sandbox_runner
from temper.tasks import code_problems, math_problems
from tests.builders import rollout_group
from tests.reward.conftest import start_sandbox

pytestmark = pytest.mark.bench


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def math_groups(n_groups: int = 8, size: int = 8):
    rng = random.Random(0)
    groups = []
    for i in range(n_groups):
        domain = sorted(math_problems.GENERATORS)[i % len(math_problems.GENERATORS)]
        task = math_problems.make_task(domain, rng, f"t{i}")
        texts = [f"Step 1 ... step 2 ...\n\\boxed{{{task.reference_answer if k % 2 == 0 else str(k) + '/7'}}}"
                 for k in range(size)]
        groups.append(rollout_group(domain, task.reference_answer, texts, group_id=f"m{i}"))
    return groups


def test_math_batch():
    from math_verify import parse, verify

    groups = math_groups()
    n = sum(len(g.trajectories) for g in groups)
    scorer = Scorer(RewardSettings(math=MathOptions(workers=2)))
    try:
        scorer.score_group(groups[0])  # start the workers
        service = best_of(lambda: [scorer.score_group(g) for g in groups], 3)
    finally:
        scorer.close()

    def direct():
        for g in groups:
            gold = parse(f"${g.task.reference_answer}$", parsing_timeout=None)
            for t in g.trajectories:
                answer = t.completion_text.rsplit("\\boxed{", 1)[1][:-1]
                verify(gold, parse(f"${answer}$", parsing_timeout=None), timeout_seconds=None)

    baseline = best_of(direct, 3)
    print(f"\nmath batch ({n} samples): service path {n / service:.0f} samples/s; math-verify direct, one thread, "
          f"no timeouts {n / baseline:.0f} samples/s; ratio {baseline / service:.2f}")


def test_code_batch(tmp_path):
    rng = random.Random(1)
    solutions = {"code.sum_numbers": "print(sum(map(int, input().split())))",
                 "code.reverse_words": "print(' '.join(reversed(input().split())))",
                 "code.fibonacci": "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
                                   "    return a"}
    groups = []
    for i in range(4):
        domain = sorted(code_problems.GENERATORS)[i % 3]
        task = code_problems.make_task(domain, rng, f"c{i}")
        # distinct programs (a comment differs), half of them wrong
        texts = [f"```python\n# attempt {k}\n{solutions[domain] if k % 2 == 0 else 'print(0)'}\n```" for k in range(8)]
        groups.append(rollout_group(domain, task.reference_answer, texts, group_id=f"c{i}"))
    n = sum(len(g.trajectories) for g in groups)
    sandbox = start_sandbox(tmp_path)
    try:
        runner = sandbox_runner(sandbox.address)
        scorer = Scorer(RewardSettings(code=CodeOptions(concurrency=4)), sandbox=runner)
        try:
            scorer.score_group(groups[0])  # warm the pool
            t0 = time.perf_counter()
            scored = [scorer.score_group(g) for g in groups]
            service = time.perf_counter() - t0
        finally:
            scorer.close()
        assert sum(t.reward.total for g in scored for t in g.trajectories) == n / 2
        from temper.client.sdk import SandboxClient

        with SandboxClient(sandbox.address) as client:
            t0 = time.perf_counter()
            for g in groups:
                suite = json.loads(g.task.reference_answer)
                tests = [t.get("assertion") or {"stdin": t["stdin"], "expected_stdout": t["expected_stdout"]}
                         for t in suite["tests"]]
                for t in g.trajectories:
                    client.run_tests(t.completion_text.split("\n", 1)[1].rsplit("```", 1)[0], tests)
            baseline = time.perf_counter() - t0
    finally:
        sandbox.stop()
    print(f"\ncode batch ({n} samples, 4 tests each): service path {n / service:.1f} samples/s; one RunTests at a "
          f"time through the SDK {n / baseline:.1f} samples/s; ratio {baseline / service:.2f}")


def test_reward_model_batching_vs_direct_forward(tmp_path):
    from temper.models.tiny import WORDS

    model_dir = build_tiny_reward_model(tmp_path / "rm", hidden_size=256, layers=4, heads=4, seed=0)
    batch = 64
    rng = random.Random(0)
    prompts = [" ".join(rng.choices(WORDS, k=64)) for _ in range(batch)]
    completions = [" ".join(rng.choices(WORDS, k=rng.randint(96, 160))) for _ in range(batch)]
    engine = RewardModelEngine(model_dir, max_batch_size=batch, max_wait_ms=5)
    try:
        encoded = [engine.encode(p, [c]) for p, c in zip(prompts, completions)]
        engine.forward(encoded)  # warm-up

        def served():
            # 8 concurrent callers of 8 requests each (as 8 groups scored at once), encoding included
            out = {}

            def caller(k):
                sl = slice(8 * k, 8 * k + 8)
                futures = engine.submit([engine.encode(p, [c]) for p, c in zip(prompts[sl], completions[sl])])
                out[k] = [f.result() for f in futures]

            threads = [threading.Thread(target=caller, args=(k,)) for k in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return out

        ratios = []
        for _ in range(5):  # interleaved, so machine load hits both alike
            direct_s = best_of(lambda: engine.forward(encoded), 1)
            served_s = best_of(served, 1)
            ratios.append(direct_s / served_s)
        batches_before = engine.batcher.batches
        served()
        forwards = engine.batcher.batches - batches_before
    finally:
        engine.close()
    tokens = sum(len(e.ids) for e in encoded)
    ratio = statistics.median(ratios)
    print(f"\nreward model ({batch} sequences, {tokens} tokens, hidden 256 x 4 layers): batching path / direct forward "
          f"throughput = {ratio:.2f} (median of 5; all {', '.join(f'{r:.2f}' for r in ratios)}); "
          f"{forwards} forward(s) per 64 requests from 8 callers")
    assert ratio >= 0.8, "well below the 0.9 goal"
