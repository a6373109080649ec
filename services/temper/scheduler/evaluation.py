"""Held-out evaluation: fixed problem sets per domain, answered greedily, scored by the reward service.

An eval set is drawn from its own seed (``EvalConfig.seed`` mixed with the domain name), so it is
the same in every run of a job and in ``temper eval``; a dataset domain's (``data.<name>``) only from
its held-out rows (``tasks.make_eval_task``). It is kept disjoint from training by prompt:
``EvalSets.holds(prompt)`` is what the job's training draws check (a held-out prompt is redrawn).
No gRPC here: ``evaluate`` takes a generate and a score callable.
"""

from __future__ import annotations

import collections
import hashlib
import math
import random
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from temper import tasks
from temper.reward.verifiers import passes
from temper.runtime.errors import InvalidArgument, require
from temper.v1 import common_pb2, inference_pb2, scheduler_pb2

MAX_EVAL_SIZE = 10_000
MAX_EVAL_SAMPLES = 64  # answers per held-out problem
# A domain whose training draws land in the held-out set this often has too few distinct prompts
# for both: the job is refused rather than left redrawing.
MAX_OVERLAP = 0.5
# Training draws simulated per domain for that check, seeded by the held-out sets' own seed, not the training seed:
# a job is refused or accepted whatever its --seed (seeded by the training seed, one-digit products -- 100 problems,
# 50 held out -- passed on seeds 0 and 3 and was refused on 1, 2 and 4 with 200 draws). The probe stops as soon as
# the share is clearly below the limit (Hoeffding, 1 in 1,000 wrong): a family that costs 0.1-0.3 s a problem
# (sudoku, arc_agi) has so many problems that ~30 draws settle it, and only a domain near the limit takes them all.
OVERLAP_PROBE = 1000
OVERLAP_CONFIDENCE = 1e-3
MAX_REDRAWS = 1000


@dataclass
class EvalConfig:
    size: int = 0  # problems per domain; 0: no evaluation
    every: int = 0  # policy versions between evaluations; 0: before and at the end only
    seed: int = 1_000_003
    extra_domains: list[str] = field(default_factory=list)  # eval-only (out-of-distribution watch)
    max_tokens: int = 0  # 0: the job's
    samples: int = 1  # answers per problem (accuracy = pass@1 averaged over them)
    temperature: float = 0.0  # 0: greedy

    @property
    def answers(self) -> int:
        return max(1, self.samples)

    @classmethod
    def from_proto(cls, p: scheduler_pb2.EvalSpec) -> EvalConfig:
        return cls(size=p.size, every=p.every, seed=p.seed, extra_domains=list(p.extra_domains),
                   max_tokens=p.max_tokens, samples=p.samples, temperature=p.temperature)

    def to_proto(self) -> scheduler_pb2.EvalSpec:
        return scheduler_pb2.EvalSpec(size=self.size, every=self.every, seed=self.seed,
                                      extra_domains=self.extra_domains, max_tokens=self.max_tokens,
                                      samples=self.samples, temperature=self.temperature)


def prompt_key(prompt: str) -> bytes:
    return hashlib.blake2b(prompt.encode(), digest_size=16).digest()


class EvalSets:
    """The held-out problems of a job: domain -> tasks, and the set of their prompts."""

    def __init__(self, domains: list[str], size: int, seed: int, domain_config: dict[str, dict]):
        self.seed = seed
        self.sets: dict[str, list[common_pb2.Task]] = {}
        self._keys: set[bytes] = set()
        for domain in domains:
            rng = random.Random(f"temper-eval/{seed}/{domain}")  # str seeds are stable across runs
            chosen: list[common_pb2.Task] = []
            seen: set[bytes] = set()
            for _ in range(20 * size + 100):
                if len(chosen) == size:
                    break
                task = tasks.make_eval_task(domain, rng, f"eval/{domain}/{len(chosen)}", domain_config.get(domain))
                key = prompt_key(task.prompt)
                if key not in seen:
                    seen.add(key)
                    chosen.append(task)
            require(len(chosen) == size, "eval.size",
                    f"{domain} yields only {len(chosen)} distinct problems here, fewer than {size}")
            self.sets[domain] = chosen
            self._keys |= seen

    def holds(self, prompt: str) -> bool:
        return prompt_key(prompt) in self._keys

    @property
    def domains(self) -> list[str]:
        return list(self.sets)


def check_disjoint(eval_sets: EvalSets, training_domains: list[str], domain_config: dict[str, dict]) -> None:
    """Refuse (field ``eval.size``) a held-out set that takes most of a training domain's prompts; the verdict depends
    on the domain, its config and the held-out sets, never on the job's training seed."""
    for domain in training_domains:
        hits, draws = overlap_probe(eval_sets, domain, domain_config.get(domain))
        if hits > MAX_OVERLAP * OVERLAP_PROBE:
            raise InvalidArgument(f"the held-out set of {domain} overlaps {hits} of {draws} training draws: the "
                                  f"domain has too few distinct problems for both (lower eval.size, or make the "
                                  f"domain harder in domain_config)", field="eval.size")


def overlap_probe(eval_sets: EvalSets, domain: str, config: dict | None) -> tuple[int, int]:
    """(held-out hits, draws) of up to OVERLAP_PROBE simulated training draws of ``domain``, stopped once the hit share
    is below MAX_OVERLAP with confidence 1 - OVERLAP_CONFIDENCE or once the hits alone exceed the limit."""
    rng = random.Random(f"temper-overlap-probe/{eval_sets.seed}/{domain}")
    margin = math.log(1 / OVERLAP_CONFIDENCE) / 2
    hits = 0
    for draws in range(1, OVERLAP_PROBE + 1):
        hits += eval_sets.holds(tasks.make_task(domain, rng, "probe", config).prompt)
        if hits > MAX_OVERLAP * OVERLAP_PROBE or hits / draws + math.sqrt(margin / draws) < MAX_OVERLAP:
            break
    return hits, draws


def draw_training_task(domain: str, rng: random.Random, task_id: str, config: dict | None,
                       eval_sets: EvalSets | None) -> tuple[common_pb2.Task, int]:
    """A training task whose prompt is not held out, and how many draws were skipped for it."""
    for skipped in range(MAX_REDRAWS):
        task = tasks.make_task(domain, rng, task_id, config)
        if eval_sets is None or not eval_sets.holds(task.prompt):
            return task, skipped
    raise InvalidArgument(f"{MAX_REDRAWS} draws of {domain} in a row were held-out prompts", field="eval.size")


# (prompts, max_tokens, n, temperature, seed) -> n answers per prompt (temperature 0: greedy, n = 1)
Generate = Callable[[list[str], int, int, float, int], inference_pb2.GenerateResponse]
Score = Callable[[common_pb2.RolloutGroup], common_pb2.RolloutGroup]


def evaluate(eval_sets: EvalSets, generate: Generate, score: Score, max_tokens: int, phase: str,
             job_id: str = "eval", workers: int = 8, response_prefix: str = "", samples: int = 1,
             temperature: float = 0.0, seed: int = 0, adapters: dict[str, str] | None = None
             ) -> scheduler_pb2.EvalResult:
    """``samples`` answers (greedy at temperature 0) to every held-out problem in one generate call (so one
    policy version answers all of them), each scored by ``score``. Per domain: accuracy = the fraction of
    answers with reward >= 1 (pass@1, averaged over a problem's samples, then over problems), its standard
    error over the problems, pass@k = the fraction of problems with at least one right answer. ``seed``
    makes sampled answers reproducible (the same seed before and after training: paired samples). ``adapters``:
    domain -> the LoRA adapter its problems are answered with (passed to ``generate`` as ``adapters=``, one name per
    prompt); None: one policy."""
    t0 = time.perf_counter()
    samples = max(1, samples)
    items = [(d, t) for d, ts in eval_sets.sets.items() for t in ts]
    names = {"adapters": [adapters.get(d, "") for d, _ in items]} if adapters else {}
    response = generate([t.prompt for _, t in items], max_tokens, samples, temperature, seed, **names)
    groups = []
    for i, ((_, task), result) in enumerate(zip(items, response.results)):
        if response_prefix:
            task = common_pb2.Task()
            task.CopyFrom(items[i][1])
            task.metadata["response_prefix"] = response_prefix
        gid = f"{job_id}/eval-v{response.policy_version}/{phase}/{i}"
        groups.append(common_pb2.RolloutGroup(
            group_id=gid, job_id=job_id, task=task, trajectories=[common_pb2.Trajectory(
                trajectory_id=f"{gid}/{j}", group_id=gid, prompt_token_ids=result.prompt_token_ids,
                completion_token_ids=c.token_ids, completion_logprobs=c.logprobs,
                policy_version=response.policy_version, completion_text=c.text, finish_reason=c.finish_reason)
                for j, c in enumerate(result.completions)]))
    with ThreadPoolExecutor(workers) as pool:
        scored = list(pool.map(score, groups))
    right: dict[str, list[float]] = {}  # per problem: the fraction of its answers right
    rewards: dict[str, list[float]] = {}
    majority = majority_answers(eval_sets)
    beyond: dict[str, list[float]] = {d: [] for d in majority}  # right, on problems whose answer is not the majority's
    for (domain, task), g in zip(items, scored):
        oks = [r.status == common_pb2.REWARD_STATUS_OK for r in (t.reward for t in g.trajectories)]
        right.setdefault(domain, []).append(
            sum(1.0 for ok, t in zip(oks, g.trajectories) if ok and passes(t.reward.total)) / max(1, len(oks)))
        rewards.setdefault(domain, []).append(
            sum(t.reward.total for ok, t in zip(oks, g.trajectories) if ok) / max(1, len(oks)))
        if domain in majority and task.reference_answer.strip() != majority[domain][0]:
            beyond[domain].append(right[domain][-1])
    return scheduler_pb2.EvalResult(
        policy_version=response.policy_version, phase=phase,
        accuracy={d: statistics.fmean(v) for d, v in right.items()},
        accuracy_stderr={d: statistics.stdev(v) / math.sqrt(len(v)) if len(v) > 1 else 0.0 for d, v in right.items()},
        pass_at_k={d: sum(1.0 for x in v if x > 0) / len(v) for d, v in right.items()},
        mean_reward={d: statistics.fmean(v) for d, v in rewards.items()},
        problems=max((len(v) for v in eval_sets.sets.values()), default=0), seconds=time.perf_counter() - t0,
        generated_tokens=sum(len(c.token_ids) for r in response.results for c in r.completions),
        samples=samples, temperature=temperature,
        majority_share={d: share for d, (_, share) in majority.items()},
        accuracy_beyond_majority={d: statistics.fmean(v) for d, v in beyond.items() if v})


def majority_answers(eval_sets: EvalSets) -> dict[str, tuple[str, float]]:
    """Per domain whose problems all carry a reference answer: its most common answer and the share of the problems
    it answers. A policy that learns to give that answer everywhere gains that much held-out accuracy without the
    skill (60 % of the smollm2 job's letter counts are "1")."""
    out = {}
    for domain, ts in eval_sets.sets.items():
        answers = [t.reference_answer.strip() for t in ts]
        if answers and all(answers):
            answer, count = collections.Counter(answers).most_common(1)[0]
            out[domain] = (answer, count / len(answers))
    return out


def check_scorable(spec_domains: list[str], eval_only: list[str], listing) -> None:
    """Refuse a domain the reward service cannot score (``listing``: its ListDomainsResponse), naming
    the job field it came from: no domain spec covers it, or it needs a reward model not loaded."""
    specs = {d.domain: dict(d.weights) for d in listing.domains}
    loaded = {"rm": listing.reward_model_loaded, "prm": listing.process_reward_model_loaded}
    for field_name, domains in (("domains", spec_domains), ("eval.extra_domains", eval_only)):
        for domain in domains:
            parts = domain.split(".")
            key = next((".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in specs), None)
            require(key is not None, field_name, f"the reward service scores no domain {domain!r} "
                                                 f"(it scores: {sorted(specs)})")
            missing = [c for c, w in specs[key].items() if w and c in loaded and not loaded[c]]
            if missing:
                raise InvalidArgument(f"{domain!r} needs the {missing[0]} model, which the reward service has not "
                                      f"loaded", field=field_name)
