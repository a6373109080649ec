"""The capacity model: a job's steady-state step time and bottleneck on a given cluster, and the replica
counts that keep every stage busy.

A step moves through the stages the services run, in this order (``temper.scheduler.core``,
``temper.reward``, ``temper.replay``, ``temper.learner.loop``):

1. **generate**: the scheduler sends the step's prompts to the inference replicas (split in equal chunks, one
   call per replica) and publishes every group to ``rollouts`` once its replica answered. A replica decodes
   its sequences in waves of at most ``max_num_seqs``; a wave costs ``completion_tokens`` decode iterations of
   ``iteration_seconds + seq_seconds x sequences`` (the memory-bound weight read plus each sequence's share),
   the usual decode-time model of a batched engine.
2. **score**: reward replicas consume ``rollouts`` one group at a time each (``reward_group_seconds``); a
   code group's samples run in the sandbox, ``sandbox_seconds`` per execution on one of the sandbox slots
   (cores); scoring and execution stream, so the stage takes as long as the busier of the two.
3. **store**: replay shards ingest the scored groups (``replay_group_seconds`` each, per shard).
4. **train**: the learner samples the batch, trains it (``train_step_seconds + tokens / learner tokens/s``
   over its GPUs, ``dp_efficiency`` per doubling of ranks) and pushes the weights (``push_seconds`` per
   replica one after another, or once for a broadcast).

Generation of step k waits for policy version ``k - 1 - max_policy_lag`` (the scheduler's lag bound), so a
lag of 0 runs the stages one after another and a lag >= 1 overlaps generation with training. The model
runs that recurrence for ``steps`` steps (a deterministic event simulation: each stage is one resource that
takes a step's work when both the work and the resource are free) and reports the steady-state step time
(mean over the second half), each stage's busy fraction and the bottleneck (the busiest stage).
``step_overhead_seconds`` is the fixed latency of a step that none of the stages account for (polls, broker
hops, the learner's sample long-poll), calibrated from measured runs.

:func:`plan` searches the split of a cluster's GPUs between inference replicas and learner ranks, and of its
CPU cores between sandbox slots and reward replicas, for the shortest step time.

Costs are inputs: measured on the hardware and model in question (``temper capacity calibrate`` fits them
from runs of this machine, ``tests/bench/gpu_check.py`` measures a GPU's), never guessed by this module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Costs(_Strict):
    """Per-replica costs of one model on one kind of hardware."""
    source: str = Field("", description="where and how these were measured")
    iteration_seconds: float = Field(ge=0, description="inference: seconds of one decode iteration, fixed part")
    seq_seconds: float = Field(ge=0, description="inference: seconds per sequence per decode iteration")
    prefill_tokens_per_second: float = Field(0.0, ge=0, description="inference: prompt tokens/s (0: prefill "
                                             "folded into seq_seconds)")
    max_num_seqs: int = Field(256, ge=1, description="inference: sequences decoded at once per replica")
    gpus_per_inference_replica: int = Field(1, ge=0, description="0: a CPU replica")
    learner_tokens_per_second: float = Field(gt=0, description="learner: train tokens/s (prompt + completion, "
                                             "every epoch) of one rank")
    train_step_seconds: float = Field(0.0, ge=0, description="learner: fixed seconds per step")
    dp_efficiency: float = Field(0.9, gt=0, le=1, description="learner: throughput kept per doubling of ranks")
    push_seconds: float = Field(ge=0, description="seconds of one weight push to one replica")
    push_mode: Literal["sequential", "broadcast"] = "sequential"
    reward_group_seconds: float = Field(ge=0, description="reward: seconds to score one group, sandbox excluded")
    sandbox_seconds: float = Field(0.0, ge=0, description="sandbox: seconds of one execution on one slot")
    replay_group_seconds: float = Field(0.0, ge=0, description="replay: seconds to ingest one group, one shard")
    step_overhead_seconds: float = Field(0.0, ge=0, description="fixed latency per step outside the stages")


class Workload(_Strict):
    prompts_per_step: int = Field(ge=1)
    group_size: int = Field(ge=1)
    prompt_tokens: int = Field(ge=0, description="mean prompt length")
    completion_tokens: int = Field(ge=1, description="decode iterations per wave (the longest completion)")
    mean_completion_tokens: float = Field(0.0, ge=0, description="mean completion length (0: completion_tokens)")
    epochs: int = Field(1, ge=1)
    max_policy_lag: int = Field(0, ge=0)
    code_fraction: float = Field(0.0, ge=0, le=1, description="share of groups whose samples run in the sandbox")
    executions_per_sample: float = Field(1.0, ge=0, description="sandbox executions per code sample")

    @property
    def samples(self) -> int:
        return self.prompts_per_step * self.group_size

    @property
    def train_tokens(self) -> float:
        completion = self.mean_completion_tokens or self.completion_tokens
        return self.samples * (self.prompt_tokens + completion) * self.epochs


class Allocation(_Strict):
    inference_replicas: int = Field(1, ge=1)
    learner_ranks: int = Field(1, ge=1)
    reward_replicas: int = Field(1, ge=1)
    sandbox_slots: int = Field(1, ge=0)
    replay_shards: int = Field(1, ge=1)

    def gpus(self, costs: Costs) -> int:
        return self.inference_replicas * costs.gpus_per_inference_replica + self.learner_ranks

    def cores(self) -> int:
        return self.reward_replicas + self.sandbox_slots


class Cluster(_Strict):
    gpus: int = Field(ge=0, description="GPUs for inference replicas and learner ranks")
    cpu_cores: int = Field(ge=2, description="cores for reward replicas and sandbox slots")
    replay_shards: int = Field(1, ge=1)


@dataclass
class StageTimes:
    """One step's work per stage, in seconds of that stage's resource."""
    generate: float
    score: float
    store: float
    train: float
    push: float
    overhead: float
    detail: dict[str, float] = field(default_factory=dict)


@dataclass
class Prediction:
    step_seconds: float
    bottleneck: str
    busy: dict[str, float]          # stage -> busy fraction of the step time
    stages: StageTimes
    allocation: Allocation
    samples_per_second: float
    train_tokens_per_second: float
    enough: dict[str, int] = field(default_factory=dict)  # CPU-side replicas that keep up with this step time

    def as_dict(self) -> dict:
        return {"step_seconds": self.step_seconds, "bottleneck": self.bottleneck, "busy": self.busy,
                "samples_per_second": self.samples_per_second,
                "train_tokens_per_second": self.train_tokens_per_second, "enough": self.enough,
                "allocation": self.allocation.model_dump(),
                "stage_seconds": {"generate": self.stages.generate, "score": self.stages.score,
                                  "store": self.stages.store, "train": self.stages.train, "push": self.stages.push,
                                  "overhead": self.stages.overhead, **self.stages.detail}}


def generate_seconds(costs: Costs, w: Workload, replicas: int) -> float:
    """The slowest replica's time for its chunk of the step's sequences (chunks by prompt, as the scheduler
    splits them)."""
    prompts = math.ceil(w.prompts_per_step / replicas)
    seqs = prompts * w.group_size
    waves, left, total = math.ceil(seqs / costs.max_num_seqs), seqs, 0.0
    for _ in range(waves):
        batch = min(left, costs.max_num_seqs)
        left -= batch
        total += w.completion_tokens * (costs.iteration_seconds + costs.seq_seconds * batch)
    if costs.prefill_tokens_per_second > 0:
        total += seqs * w.prompt_tokens / costs.prefill_tokens_per_second
    return total


def stage_times(costs: Costs, w: Workload, a: Allocation) -> StageTimes:
    groups = w.prompts_per_step
    reward = groups * costs.reward_group_seconds / a.reward_replicas
    executions = groups * w.code_fraction * w.group_size * w.executions_per_sample
    if executions > 0 and a.sandbox_slots == 0:
        raise ValueError("sandbox_slots: 0 slots for a workload with code_fraction > 0")
    sandbox = executions * costs.sandbox_seconds / a.sandbox_slots if executions else 0.0
    efficiency = costs.dp_efficiency ** math.log2(a.learner_ranks)
    train = costs.train_step_seconds + w.train_tokens / (costs.learner_tokens_per_second * a.learner_ranks
                                                         * efficiency)
    pushes = a.inference_replicas if costs.push_mode == "sequential" else 1
    return StageTimes(generate=generate_seconds(costs, w, a.inference_replicas), score=max(reward, sandbox),
                      store=groups * costs.replay_group_seconds / a.replay_shards, train=train,
                      push=pushes * costs.push_seconds, overhead=costs.step_overhead_seconds,
                      detail={"reward": reward, "sandbox": sandbox})


def predict(costs: Costs, w: Workload, a: Allocation, steps: int = 200) -> Prediction:
    """Run the step recurrence for ``steps`` steps; the steady state is the mean over the second half."""
    t = stage_times(costs, w, a)
    # one group's scoring and storing latency: the stream's tail once the last group is published
    groups = w.prompts_per_step
    tail = (t.score + t.store) / groups
    gen_free = score_free = store_free = 0.0
    trained: list[float] = []   # trained[k-1]: when policy version k exists (after its push)
    for k in range(1, steps + 1):
        need = k - 1 - w.max_policy_lag          # the policy version generation of step k waits for
        ready = trained[need - 1] if need >= 1 else 0.0
        gen_end = max(gen_free, ready) + t.generate
        gen_free = gen_end
        # scoring and storing stream the step's groups as they come; they end one group after the later of
        # the generation's end and their own work
        score_end = max(gen_end + tail, max(score_free, gen_end) + t.score)
        score_free = score_end
        store_end = max(score_end + t.store / groups, store_free + t.store)
        store_free = store_end
        previous = trained[-1] if trained else 0.0
        trained.append(max(previous, store_end) + t.train + t.push + t.overhead)
    half = steps // 2
    step = (trained[-1] - trained[half - 1]) / (steps - half)
    busy = {"generate": t.generate / step, "score": t.score / step, "store": t.store / step,
            "train": (t.train + t.push) / step}
    bottleneck = max(busy, key=busy.get)
    # the fewest CPU-side replicas whose stage still takes no longer than the step: more only sit idle
    enough = {"reward_replicas": max(1, math.ceil(t.detail["reward"] * a.reward_replicas / step - 1e-9)),
              "sandbox_slots": math.ceil(t.detail["sandbox"] * a.sandbox_slots / step - 1e-9),
              "replay_shards": max(1, math.ceil(t.store * a.replay_shards / step - 1e-9))}
    return Prediction(step_seconds=step, bottleneck=bottleneck, busy=busy, stages=t, allocation=a,
                      samples_per_second=w.samples / step, train_tokens_per_second=w.train_tokens / step,
                      enough=enough)


def plan(costs: Costs, w: Workload, cluster: Cluster, steps: int = 60) -> Prediction:
    """The allocation of ``cluster`` with the shortest predicted step time: every split of the GPUs between
    inference replicas (``gpus_per_inference_replica`` each) and learner ranks, and for each the split of
    the cores between sandbox slots and reward replicas that balances those two stages (and its
    neighbours)."""
    per = costs.gpus_per_inference_replica
    if per == 0:
        splits = [(1, max(1, cluster.gpus))]
    else:
        if cluster.gpus < per + 1:
            raise ValueError(f"gpus: {cluster.gpus} cannot hold one inference replica ({per} GPUs) and a learner rank")
        splits = [(r, cluster.gpus - r * per) for r in range(1, (cluster.gpus - 1) // per + 1)]
    one = stage_times(costs, w, Allocation()).detail  # a step's reward and sandbox work on one replica / slot
    reward_work, sandbox_work = one["reward"], one["sandbox"]
    cores = cluster.cpu_cores
    if sandbox_work > 0:
        ideal = round(cores * sandbox_work / (sandbox_work + reward_work))
        candidates = sorted({min(cores - 1, max(1, s)) for s in (ideal - 2, ideal - 1, ideal, ideal + 1, ideal + 2)})
    else:
        candidates = [0]
    best: Prediction | None = None
    for replicas, ranks in splits:
        for slots in candidates:
            a = Allocation(inference_replicas=replicas, learner_ranks=ranks, reward_replicas=max(1, cores - slots),
                           sandbox_slots=slots, replay_shards=cluster.replay_shards)
            p = predict(costs, w, a, steps)
            if best is None or p.step_seconds < best.step_seconds - 1e-12:
                best = p
    assert best is not None
    return best


class CapacitySpec(_Strict):
    """A ``temper capacity plan`` file: costs, workload, and a cluster to plan or an allocation to predict."""
    costs: Costs
    workload: Workload
    cluster: Cluster | None = None
    allocation: Allocation | None = None

    @model_validator(mode="after")
    def _one(self):
        if (self.cluster is None) == (self.allocation is None):
            raise ValueError("give [cluster] (plan the best split) or [allocation] (predict that one), not both "
                             "or neither")
        return self
