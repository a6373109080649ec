"""One experience table in memory: config, live items, sampler, remover, rate limiter, policy lag.

Pure logic (no I/O, no locks): the store calls these methods under its lock, persists the
``Removal``s and counters they report in the same transaction, and answers only after commit.

Semantics (DeepMind Reverb's, plus what LLM RL needs):
- an item is one GRPO group, inserted and sampled whole; its ``policy_version`` is the oldest
  version among its trajectories;
- inserting into a full table first evicts one item chosen by the remover; a domain that holds
  its quota (``domain_quotas``) evicts one of its own items instead, so no domain crowds out the rest;
- a sample of ``n`` is ``n`` draws, each from the distribution at the time of the draw; an item
  drawn ``max_times_sampled`` times is removed (0: never), so a batch may repeat an item only
  while it still has draws left;
- the table's current policy version is the newest it has heard of: the highest trajectory
  version inserted, or a sampler's ``current_policy_version``. With ``max_policy_lag = L >= 0``
  an item of version ``v < current - L`` is evicted as soon as that holds and is never returned;
  one that arrives that stale is acknowledged (and remembered, so never re-admitted) but not stored.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from dataclasses import dataclass, field, replace
from enum import IntEnum
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from temper.replay.rate_limiter import RateLimiter
from temper.replay.samplers import REMOVERS, SAMPLERS, Items

AGE_BUCKETS_S = (1.0, 10.0, 60.0, 600.0, 3600.0, math.inf)  # upper bounds of the age histogram


class TableConfig(BaseModel):
    """A table as configured in TOML (``[replay.tables.NAME]``); validated at start-up."""

    model_config = ConfigDict(extra="forbid")

    sampler: Literal["fifo", "lifo", "uniform", "prioritized"] = "fifo"
    remover: Literal["fifo", "lifo", "lowest_priority"] = "fifo"
    max_size: int = Field(100_000, ge=1)  # groups
    max_times_sampled: int = Field(1, ge=0)  # 0: unlimited
    priority_exponent: float = Field(1.0, ge=0, allow_inf_nan=False)  # α of prioritized sampling
    # β of the returned importance weights (a Sample request may override it)
    importance_sampling_exponent: float = Field(1.0, ge=0, allow_inf_nan=False)
    initial_priority: float | Literal["max"] = "max"  # for inserts without one: "max" = highest stored so far (1 if none)
    min_size_to_sample: int = Field(1, ge=1)
    samples_per_insert: float = Field(0.0, ge=0, allow_inf_nan=False)  # 0: no ratio limit, only min_size_to_sample
    error_buffer: float | tuple[float, float] = 0.0  # half-width of the band, or (min_diff, max_diff)
    max_policy_lag: int = Field(-1, ge=-1)  # -1: no bound
    domain_quotas: dict[str, int] = Field(default_factory=dict)  # domain -> max groups; "*" = every other domain
    seed: int | None = None  # of the sampler's random generator (None: from the OS)

    @model_validator(mode="after")
    def _consistent(self) -> TableConfig:
        if isinstance(self.initial_priority, float) and not (0 <= self.initial_priority < math.inf):
            raise ValueError(f"initial_priority must be finite and >= 0, got {self.initial_priority}")
        if self.min_size_to_sample > self.max_size:
            raise ValueError(f"min_size_to_sample {self.min_size_to_sample} > max_size {self.max_size}: "
                             "sampling would never start")
        for domain, quota in self.domain_quotas.items():
            if quota < 1:
                raise ValueError(f"domain_quotas[{domain!r}] must be >= 1, got {quota}")
        if self.samples_per_insert > 0:
            self.rate_limiter().check()
            if 0 < self.max_times_sampled < self.samples_per_insert:
                raise ValueError(f"samples_per_insert {self.samples_per_insert} > max_times_sampled "
                                 f"{self.max_times_sampled}: samplers would run out of items while inserts wait")
        return self

    def rate_limiter(self) -> RateLimiter:
        return RateLimiter.from_config(self.samples_per_insert, self.min_size_to_sample, self.error_buffer)


class Removal(IntEnum):
    """Why an item left the table (stored with its dedup key)."""

    LIVE = 0
    SAMPLED_OUT = 1  # drawn max_times_sampled times
    EVICTED = 2  # the table was full: chosen by the remover
    QUOTA = 3  # its domain was at quota: chosen by the remover among that domain's items
    STALE = 4  # its policy version fell more than max_policy_lag behind
    STALE_ON_INSERT = 5  # already too stale when it arrived: never live


@dataclass
class Draw:
    seq: int
    group_id: str
    payload: bytes
    probability: float
    importance_weight: float
    priority: float
    times_sampled: int  # including this draw
    table_size: int  # items in the table when drawn
    policy_version: int
    inserted_ms: int
    domain: str = ""


@dataclass
class TableStats:
    table: str
    size: int
    inserts: int
    samples: int
    deletes: int
    duplicates: int
    domain_counts: dict[str, int]
    removed: dict[str, int]  # Removal name (lower case) -> count
    policy_version: int
    bytes: int
    age_histogram: list[tuple[float, int]]  # (upper bound in seconds, count)
    policy_version_counts: dict[int, int]
    limiter: RateLimiter
    can_insert: bool
    can_sample: bool
    waiting_inserts: int
    waiting_samples: int
    config: TableConfig
    # acknowledged draws (ReplayStore, Sample with a lease): held now, and leases settled since the process started
    leases: int = 0                      # outstanding leases
    leased: int = 0                      # draws they hold (given out, neither final nor given back)
    lease_outcomes: dict[str, int] = field(default_factory=dict)  # acked | requeued | expired -> leases
    total_weight: float = 0.0            # prioritized: sum of the live sampling weights (priority^α)
    min_weight: float = 0.0              # prioritized: the smallest positive one


@dataclass
class Table:
    name: str
    config: TableConfig
    items: Items = field(init=False)
    limiter: RateLimiter = field(init=False)
    policy_version: int = 0
    duplicates: int = 0
    removed: Counter = field(default_factory=Counter)  # Removal -> count
    waiting_inserts: int = 0
    waiting_samples: int = 0
    max_priority: float = 0.0  # highest priority stored since start-up (or among the groups loaded)

    def __post_init__(self):
        self.items = Items(self.config.priority_exponent)
        self.limiter = self.config.rate_limiter()
        self.rng = np.random.default_rng(self.config.seed)
        self._sampler = SAMPLERS[self.config.sampler]
        self._remover = REMOVERS[self.config.remover]
        quotas = dict(self.config.domain_quotas)
        self._default_quota = quotas.pop("*", None)
        self._quotas = quotas

    # -- versions ------------------------------------------------------------------------------
    def min_version(self) -> float:
        lag = self.config.max_policy_lag
        return -math.inf if lag < 0 else self.policy_version - lag

    def observe_version(self, version: int) -> list[tuple[int, Removal]]:
        """Learn that policy ``version`` exists; evict what is now too stale."""
        if version <= self.policy_version:
            return []
        self.policy_version = version
        if self.config.max_policy_lag < 0 or not self.items.n:
            return []
        stale = np.flatnonzero(self.items.version[:self.items.n] < self.min_version())
        return self._remove(stale, Removal.STALE)

    # -- insert --------------------------------------------------------------------------------
    def initial_priority(self) -> float:
        """For a group inserted without a priority: the configured one, or (PER's rule) the
        highest priority stored so far, so that new groups are drawn soon."""
        if self.config.initial_priority != "max":
            return float(self.config.initial_priority)
        return self.max_priority or 1.0

    def quota(self, domain: str) -> int | None:
        return self._quotas.get(domain, self._default_quota)

    def add(self, seq: int, group_id: str, domain: str, version: int, priority: float, payload: bytes,
            inserted_ms: int) -> list[tuple[int, Removal]]:
        """Insert a (non-stale, new) item, evicting first if its domain or the table is full."""
        removed: list[tuple[int, Removal]] = []
        quota = self.quota(domain)
        if quota is not None:
            d = self.items.domain_id(domain)
            if self.items.domain_counts.get(d, 0) >= quota:
                removed += self._remove([self._remover(self.items, d)], Removal.QUOTA)
        if self.items.n >= self.config.max_size:
            removed += self._remove([self._remover(self.items)], Removal.EVICTED)
        self.items.add(seq, group_id, domain, version, priority, payload, inserted_ms)
        self.max_priority = max(self.max_priority, priority)
        self.limiter.inserts += 1
        return removed

    def load(self, seq: int, group_id: str, domain: str, version: int, priority: float, payload: bytes,
             inserted_ms: int, times_sampled: int) -> None:
        """Put back an item read from the durable log (no counters move)."""
        self.items.add(seq, group_id, domain, version, priority, payload, inserted_ms, times_sampled)
        self.max_priority = max(self.max_priority, priority)

    def enforce_limits(self) -> list[tuple[int, Removal]]:
        """After loading under a (possibly changed) config: apply lag, quotas and max size."""
        removed = []
        if self.config.max_policy_lag >= 0 and self.items.n:
            removed += self._remove(np.flatnonzero(self.items.version[:self.items.n] < self.min_version()),
                                    Removal.STALE)
        for d, name in enumerate(self.items.domain_names):
            quota = self.quota(name)
            while quota is not None and self.items.domain_counts.get(d, 0) > quota:
                removed += self._remove([self._remover(self.items, d)], Removal.QUOTA)
        while self.items.n > self.config.max_size:
            removed += self._remove([self._remover(self.items)], Removal.EVICTED)
        if self.config.max_times_sampled:
            used_up = np.flatnonzero(self.items.times_sampled[:self.items.n] >= self.config.max_times_sampled)
            removed += self._remove(used_up, Removal.SAMPLED_OUT)
        return removed

    def _remove(self, positions, reason: Removal) -> list[tuple[int, Removal]]:
        seqs = self.items.remove_positions(positions)
        self.limiter.deletes += len(seqs)
        self.removed[reason] += len(seqs)
        return [(s, reason) for s in seqs]

    # -- sample --------------------------------------------------------------------------------
    def sample_capacity(self) -> float:
        """How many draws the live items allow before all are used up."""
        n = self.items.n
        if self.config.max_times_sampled == 0:
            return math.inf if n else 0
        return self.config.max_times_sampled * n - int(self.items.times_sampled[:n].sum())

    def not_ready(self, n: int) -> str | None:
        """Why a sample of ``n`` must wait now (None: it can go)."""
        if self.items.n < self.config.min_size_to_sample:
            return f"{self.items.n} groups stored, min_size_to_sample is {self.config.min_size_to_sample}"
        if self.sample_capacity() < n:
            return f"{self.items.n} groups stored allow {self.sample_capacity()} more draws, {n} asked"
        if not self.limiter.can_sample(n):
            lim = self.limiter
            return (f"rate limiter: {lim.inserts} inserts * {lim.samples_per_insert} - ({lim.samples} samples + {n}) "
                    f"< min_diff {lim.min_diff}")
        return None

    def sample(self, n: int, beta: float) -> tuple[list[Draw], list[tuple[int, Removal]]]:
        """Draw ``n`` items (caller checked ``not_ready(n) is None``); returns draws and removals.

        Each draw reports ``P(i)``, its probability given the draws before it (items used up by
        earlier draws excluded), and the importance weight ``(N·P(i))^-β / max_j (N·P(j))^-β``
        ``= (p_min / p_i)^(αβ)`` over the items live at that moment: in (0, 1], exactly 1 for
        the least likely item, 1 for every draw of the non-prioritized samplers.
        """
        items, max_ts = self.items, self.config.max_times_sampled
        draws: list[Draw] = []
        removed: list[tuple[int, Removal]] = []

        def remaining(i: int) -> int:
            return items.remaining(i, max_ts)

        while len(draws) < n:
            positions, w = self._sampler(items, n - len(draws), self.rng, remaining)
            if w is not None:
                total, gone_weight = float(w.sum()), 0.0
                w_min = float(w[w > 0].min())
            gone: list[int] = []
            left: dict[int, int] = {}
            for i in positions.tolist():
                if i not in left:
                    left[i] = remaining(i)
                if left[i] == 0:  # used up earlier in this round: draw again from the new state
                    break
                left[i] -= 1
                items.times_sampled[i] += 1
                if w is None:
                    probability = weight = 1.0
                else:
                    probability = float(w[i]) / (total - gone_weight)
                    weight = (w_min / float(w[i])) ** beta
                draws.append(Draw(int(items.seq[i]), items.group_id[i], items.payload[i], probability, weight,
                                  float(items.priority[i]), int(items.times_sampled[i]), items.n - len(gone),
                                  int(items.version[i]), int(items.inserted_ms[i]),
                                  items.domain_names[int(items.domain[i])]))
                if left[i] == 0:
                    gone.append(i)
                    if w is not None:
                        gone_weight += float(w[i])
                        if w[i] == w_min and len(gone) < items.n:
                            live = np.ones(items.n, bool)
                            live[gone] = False
                            positive = w[live & (w > 0)]
                            w_min = float(positive.min()) if positive.size else w_min
            removed += self._remove(gone, Removal.SAMPLED_OUT)
        self.limiter.samples += n
        return draws, removed

    def unsample(self, draws: list[Draw], removed: list[tuple[int, Removal]]) -> list[tuple[int, Removal]]:
        """Undo a ``sample`` (a lease given back): its items as if never drawn -- those it used up live again,
        the others' times sampled back, counters back. Items that left meanwhile for another reason stay
        gone; the table's limits then apply (returns what they removed)."""
        count = Counter(d.seq for d in draws)
        last = {d.seq: d for d in draws}  # an item's last draw carries its times sampled after the sample
        gone = {seq for seq, _ in removed}
        for seq, n in count.items():
            d = last[seq]
            if seq in gone:
                self.load(seq, d.group_id, d.domain, d.policy_version, d.priority, d.payload, d.inserted_ms,
                          d.times_sampled - n)
            elif seq in self.items.pos:
                self.items.times_sampled[self.items.pos[seq]] -= n
        if gone:  # back in insertion order (fifo / lifo read it), not at the end
            self.items.order = OrderedDict((seq, None) for seq in sorted(self.items.order))
        self.limiter.deletes -= len(removed)
        self.removed[Removal.SAMPLED_OUT] -= len(removed)
        self.limiter.samples -= len(draws)
        return self.enforce_limits()

    # -- priorities ----------------------------------------------------------------------------
    def update_priorities(self, priorities: dict[str, float]) -> tuple[dict[int, float], list[str]]:
        """Set priorities of live groups; returns (seq -> priority updated, unknown group ids)."""
        updated, unknown = {}, []
        for group_id, priority in priorities.items():
            seq = self.items.by_group.get(group_id)
            if seq is None:
                unknown.append(group_id)
                continue
            self.items.set_priority(self.items.pos[seq], priority)
            self.max_priority = max(self.max_priority, priority)
            updated[seq] = priority
        return updated, unknown

    # -- stats ---------------------------------------------------------------------------------
    def stats(self, now_ms: int) -> TableStats:
        items, n = self.items, self.items.n
        ages = (now_ms - items.inserted_ms[:n]) / 1000.0
        counts = np.histogram(ages, bins=[-math.inf, *AGE_BUCKETS_S])[0] if n else [0] * len(AGE_BUCKETS_S)
        versions, vcounts = np.unique(items.version[:n], return_counts=True)
        return TableStats(
            table=self.name, size=n, inserts=self.limiter.inserts, samples=self.limiter.samples,
            deletes=self.limiter.deletes, duplicates=self.duplicates,
            domain_counts={items.domain_names[d]: c for d, c in items.domain_counts.items() if c},
            removed={r.name.lower(): self.removed[r] for r in Removal if r != Removal.LIVE},
            policy_version=self.policy_version, bytes=items.total_bytes,
            age_histogram=list(zip(AGE_BUCKETS_S, [int(c) for c in counts])),
            policy_version_counts=dict(zip(versions.tolist(), vcounts.tolist())),
            limiter=replace(self.limiter), can_insert=self.limiter.can_insert(1), can_sample=self.not_ready(1) is None,
            waiting_inserts=self.waiting_inserts, waiting_samples=self.waiting_samples, config=self.config,
            **self._weights())

    def _weights(self) -> dict[str, float]:
        if self.config.sampler != "prioritized" or self.items.n == 0:
            return {}
        w = self.items.weight[:self.items.n]
        positive = w[w > 0]
        return {"total_weight": float(w.sum()), "min_weight": float(positive.min()) if positive.size else 0.0}
