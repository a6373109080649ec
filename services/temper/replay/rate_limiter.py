"""The rate limiter of a replay table: how far sampling may run ahead of (or behind) inserting.

Counters (all since the table was created, kept durably with the table):
``I`` items inserted, ``S`` items sampled (a batch of ``n`` groups counts ``n``), ``D`` items
deleted (sampled out, evicted, or too stale); the table holds ``size = I - D`` items.
``spi`` is samples-per-insert and ``[min_diff, max_diff]`` the band allowed for the *error*
``diff = I * spi - S``.

Two stages:
- while ``size < min_size_to_sample`` sampling is blocked and inserting is free;
- after that a sample of ``n`` is allowed only if ``I * spi - (S + n) >= min_diff`` and an
  insert of ``k`` only if ``(I + k) * spi - S <= max_diff`` (or if the table would still hold
  at most ``min_size_to_sample`` items afterwards: filling up to the minimum is always free).

The side that would break the band waits (with a deadline, never forever) until the other side
has moved. So after every operation the invariant holds::

    after a sample:   I * spi - S >= min_diff                                  (samples never run ahead)
    after an insert:  I * spi - S <= max_diff   or   I - D <= min_size_to_sample (inserts never run ahead)

With the usual symmetric ``error_buffer = b``, the band is centred on the error the table has
when it first reaches its minimum size: ``[spi * min_size_to_sample - b, spi * min_size_to_sample + b]``.
``samples_per_insert = 0`` in a table's config means "no ratio": only the minimum size applies
(``spi = 1`` with an infinite band).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class RateLimiter:
    samples_per_insert: float
    min_size_to_sample: int
    min_diff: float
    max_diff: float
    inserts: int = 0
    samples: int = 0
    deletes: int = 0

    @classmethod
    def from_config(cls, samples_per_insert: float, min_size_to_sample: int,
                    error_buffer: float | tuple[float, float] | list[float]) -> RateLimiter:
        """``samples_per_insert = 0``: only the minimum size; a number ``b``: the band
        ``spi * min_size_to_sample -/+ b``; a pair: ``(min_diff, max_diff)`` as given."""
        if samples_per_insert == 0:
            return cls(1.0, min_size_to_sample, -math.inf, math.inf)
        if isinstance(error_buffer, int | float):
            offset = samples_per_insert * min_size_to_sample
            min_diff, max_diff = offset - error_buffer, offset + error_buffer
        else:
            min_diff, max_diff = error_buffer
        return cls(samples_per_insert, min_size_to_sample, float(min_diff), float(max_diff))

    def check(self) -> None:
        """ValueError for a band in which inserts or samples could block each other for ever."""
        if self.min_size_to_sample < 1:
            raise ValueError(f"min_size_to_sample must be >= 1, got {self.min_size_to_sample}")
        spi = self.samples_per_insert
        if self.max_diff - self.min_diff < 2 * max(1.0, spi):
            raise ValueError(f"error_buffer band [{self.min_diff}, {self.max_diff}] is narrower than "
                             f"2 * max(1, samples_per_insert) = {2 * max(1.0, spi)}: it would block both sides")
        if self.min_diff > spi * self.min_size_to_sample:
            raise ValueError(f"min_diff {self.min_diff} is above samples_per_insert * min_size_to_sample = "
                             f"{spi * self.min_size_to_sample}: sampling would never start")

    @property
    def size(self) -> int:
        return self.inserts - self.deletes

    @property
    def diff(self) -> float:
        return self.inserts * self.samples_per_insert - self.samples

    def can_sample(self, n: int) -> bool:
        if self.size < self.min_size_to_sample:
            return False
        return self.inserts * self.samples_per_insert - (self.samples + n) >= self.min_diff

    def can_insert(self, k: int = 1) -> bool:
        if self.size + k <= self.min_size_to_sample:
            return True
        return (self.inserts + k) * self.samples_per_insert - self.samples <= self.max_diff

    def insertable(self, wanted: int) -> int:
        """How many of ``wanted`` inserts the band allows right now (0..wanted)."""
        lo, hi = 0, wanted
        while lo < hi:  # can_insert is monotone in k
            mid = (lo + hi + 1) // 2
            if self.can_insert(mid):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def max_batch(self) -> float:
        """The largest sample batch that the band can ever allow (``inf`` without a ratio).

        Inserts stop once the error would pass ``max_diff``, so the error can be counted on to
        reach at least ``max_diff - spi``; a batch of ``n`` needs ``error - n >= min_diff``.
        """
        if math.isinf(self.max_diff) or math.isinf(self.min_diff):
            return math.inf
        return math.floor(self.max_diff - self.samples_per_insert - self.min_diff)
