"""FIFO-once vs prioritized reuse: held-out gain per generated token on the tiny model.

In-process but real parts: the HF engine generates toy groups (the toy job's settings: 2
tokens, groups of 8, temperature 1), scored by the exact toy verifier; they go through a real
``ReplayStore`` table; the real ``Trainer`` steps on what the table hands out, with the draws'
importance weights, and (prioritized arm) sends each group's mean |advantage| back as its
priority, as the learner loop does with ``priority_signal = "mean_abs_advantage"``.

- ``fifo-once``: the default table (FIFO, each group sampled once): one step per generated batch;
- ``prioritized-reuse``: a prioritized table (alpha 0.6, beta 0.4) with samples_per_insert = 2
  under the rate limiter and max_policy_lag = 4: two steps per generated batch;
- ``prioritized-reuse-e1``: the same with 1 epoch per step instead of 2, so it makes as many
  gradient passes per generated batch as fifo-once (the shipped toy-reuse job's learner);
- ``prioritized-reuse-e1-loss``: that, with ``priority_signal = "loss"`` (mean |per-token policy loss|).

Both arms generate the same number of batches (so about the same tokens); held-out reward is
greedy exact-answer accuracy on 96 toy tasks no arm trains on. Run: ``make bench``.
"""

from __future__ import annotations

import random
import time

import pytest

from temper.inference.engine import HFEngine, SamplingParams
from temper.learner.batching import batch_from_groups
from temper.learner.trainer import Trainer, TrainerConfig
from temper.models.tiny import build_tiny_model
from temper.replay.store import ReplayStore
from temper.replay.tables import TableConfig
from temper.tasks import toy
from temper.v1 import common_pb2

DOMAINS = ("toy.copy", "toy.next")
GROUPS, GROUP_SIZE, ROUNDS, HELD_OUT = 8, 8, 40, 96
PRIORITIZED = TableConfig(sampler="prioritized", max_times_sampled=0, priority_exponent=0.6,
                          importance_sampling_exponent=0.4, samples_per_insert=2.0, min_size_to_sample=GROUPS,
                          error_buffer=2.0 * GROUPS, max_policy_lag=4, max_size=32 * GROUPS, seed=0)
ARMS = {  # name: (table, steps per generated batch, trainer epochs per step, priority signal)
    "fifo-once": (TableConfig(), 1, 2, "none"),  # the toy job's learner (epochs = 2)
    "prioritized-reuse": (PRIORITIZED, 2, 2, "mean_abs_advantage"),
    "prioritized-reuse-e1": (PRIORITIZED, 2, 1, "mean_abs_advantage"),  # as many gradient passes as fifo-once
    "prioritized-reuse-e1-loss": (PRIORITIZED, 2, 1, "loss"),  # the toy-reuse job with priority_signal = "loss"
}
SEEDS = (0, 1, 2)


def generate(engine: HFEngine, rng: random.Random, round_: int, seed: int) -> tuple[list, int]:
    tasks = [toy.make_task(rng.choice(DOMAINS), rng, f"r{round_}-{i}") for i in range(GROUPS)]
    results, version = engine.generate([engine.encode(t.prompt) for t in tasks],
                                       SamplingParams(n=GROUP_SIZE, temperature=1.0, max_tokens=2,
                                                      seed=seed * 100_003 + round_))
    groups, tokens = [], 0
    for i, (task, result) in enumerate(zip(tasks, results)):
        gid = f"{seed}/{round_}/{i}"
        g = common_pb2.RolloutGroup(group_id=gid, job_id="reuse", task=task)
        for k, c in enumerate(result.completions):
            t = g.trajectories.add(trajectory_id=f"{gid}/{k}", group_id=gid, prompt_token_ids=result.prompt_token_ids,
                                   completion_token_ids=c.token_ids, completion_logprobs=c.logprobs,
                                   policy_version=version, sampling_temperature=1.0)
            t.reward.total = toy.exact_answer_reward(c.text, task.reference_answer)
            t.reward.status = common_pb2.REWARD_STATUS_OK
            tokens += len(c.token_ids)
        groups.append(g)
    return groups, tokens


def held_out(engine: HFEngine, tasks: list) -> float:
    results, _ = engine.generate([engine.encode(t.prompt) for t in tasks], SamplingParams(temperature=0.0, max_tokens=2))
    return sum(toy.exact_answer_reward(r.completions[0].text, t.reference_answer)
               for t, r in zip(tasks, results)) / len(tasks)


def run_arm(model_dir, tmp, name: str, seed: int, eval_tasks: list) -> dict:
    table, steps_per_round, epochs, signal = ARMS[name]
    engine = HFEngine(model_dir)
    trainer = Trainer(model_dir, TrainerConfig(lr=1e-3, epochs=epochs))
    store = ReplayStore(tmp / f"{name}-{seed}" / "replay.sqlite", {"t": table}, fsync=False)
    rng = random.Random(seed)
    before, tokens, steps, t0 = held_out(engine, eval_tasks), 0, 0, time.perf_counter()
    try:
        for r in range(ROUNDS):
            groups, n = generate(engine, rng, r, seed)
            tokens += n
            store.insert("t", groups, timeout=10)
            for _ in range(steps_per_round):
                result = store.sample("t", GROUPS, timeout=10, max_batch=GROUPS,
                                      current_policy_version=trainer.policy_version)
                batch = batch_from_groups([common_pb2.RolloutGroup.FromString(d.payload) for d in result.draws],
                                          [d.importance_weight for d in result.draws])
                trainer.step(batch)
                steps += 1
                if signal != "none":
                    store.update_priorities("t", trainer.group_signals[signal])
            engine.apply_weights(trainer.weights(), new_version=trainer.policy_version)
        after = held_out(engine, eval_tasks)
        stats = store.stats("t")
    finally:
        store.close()
    return {"arm": name, "seed": seed, "before": before, "after": after, "tokens": tokens, "steps": steps,
            "gain_per_1k_tokens": (after - before) / tokens * 1000, "seconds": time.perf_counter() - t0,
            "removed": dict(stats.removed)}


@pytest.mark.bench
def test_fifo_once_vs_prioritized_reuse(tmp_path):
    model_dir = build_tiny_model(tmp_path / "tiny", seed=0)
    eval_rng = random.Random(10_000)
    eval_tasks = [toy.make_task(eval_rng.choice(DOMAINS), eval_rng, f"eval-{i}") for i in range(HELD_OUT)]
    rows = [run_arm(model_dir, tmp_path, name, seed, eval_tasks) for seed in SEEDS for name in ARMS]
    print(f"\nFIFO-once vs prioritized reuse, tiny model, toy.copy + toy.next, {ROUNDS} batches of {GROUPS} x "
          f"{GROUP_SIZE}, held-out greedy accuracy on {HELD_OUT} tasks")
    for row in rows:
        print(f"  {row['arm']:<21} seed {row['seed']}: held-out {row['before']:.3f} -> {row['after']:.3f} "
              f"over {row['tokens']} generated tokens, {row['steps']} steps: {row['gain_per_1k_tokens']:+.4f} "
              f"per 1k tokens ({row['seconds']:.0f}s; removed {row['removed']})")
    for name in ARMS:
        mine = [r["gain_per_1k_tokens"] for r in rows if r["arm"] == name]
        print(f"  {name:<21} mean gain per 1k generated tokens: {sum(mine) / len(mine):+.4f}")
    assert all(r["steps"] == ROUNDS * ARMS[r["arm"]][1] for r in rows)
