"""Sampling one replay table kept by N replay shards (``[replay] replicas = N``), as if it were one table.

Each shard owns some partitions of ``scored`` and holds its groups in its own copy of the table (same
config). :class:`ShardedReplay` has the reader's side of :class:`~temper.client.sdk.ReplayClient`
(``sample_batch``, ``ack_sample``, ``update_priorities``, ``stats``) over every shard:

- **Split of a batch.** The shards' Stats say how many groups each holds (and, for a prioritized table,
  the sum and the smallest of their sampling weights). ``uniform``: each draw goes to a shard with
  probability size / total size, so every group is equally likely, as in one table; ``prioritized``: with
  probability (the shard's total weight) / (all shards' total), so a group's chance is its weight over the
  weight of every shard's groups, as in one table; ``fifo`` / ``lifo``: in proportion to the sizes (largest
  remainder), each shard giving its oldest / newest -- the order holds within a shard, not across shards.
  A shard gives at most its size when groups are sampled once (``max_times_sampled = 1``). Until the shards
  together hold the batch, the reader waits (Stats polled, up to ``timeout_ms``; then DEADLINE_EXCEEDED,
  as one replay answers).
- **Importance weights** are rescaled to the whole table: a shard normalises by its own smallest weight,
  ``(w_min_shard / w)^β``; the reader multiplies by ``(w_min_all / w_min_shard)^β``, which gives
  ``(w_min_all / w)^β``, one table's weight. Probabilities become the draw's probability within its shard
  times the shard's share.
- **Leases**: one per shard; the batch's lease id joins them (``"0=<id>;1=<id>"``), and ``ack_sample``
  settles each. If a shard fails while a batch is drawn, the shards already drawn from are given their
  groups back (leased) or the groups drawn so far are returned (no lease: those draws are final, so they
  are not lost).
- **Rate limiters** apply per shard: each shard's limiter counts its own inserts and samples.
- **Priorities**: an update goes to every shard; each updates the groups it holds (a group id is in one
  shard only); the answer sums ``updated`` and lists ids no shard knew.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

import grpc

from temper.v1 import replay_pb2


class _Expired(grpc.RpcError):
    """DEADLINE_EXCEEDED raised locally, as a replay's own Sample raises it."""

    def __init__(self, details: str):
        super().__init__(details)
        self._details = details

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return self._details


def shard_addresses(target: str) -> list[str]:
    """The shard addresses of a replay target: ``ipv4:a:p,b:q`` or ``a:p,b:q`` -> each; one address -> [it]."""
    body = target.removeprefix("ipv4:")
    parts = [p.strip() for p in body.split(",") if p.strip()]
    return parts if len(parts) > 1 else [target]


def split_counts(batch: int, weights: Sequence[float], caps: Sequence[float], rng: random.Random | None
                 ) -> list[int] | None:
    """``batch`` draws over shards: ``rng`` None -> in proportion to ``weights`` (largest remainder), else one
    at a time with probability proportional to ``weights``; no shard past its cap; None when the caps hold
    fewer than ``batch``."""
    if sum(min(c, batch) for c in caps) < batch:
        return None
    counts = [0] * len(weights)
    open_ = [i for i, c in enumerate(caps) if c > 0]
    if rng is None:
        left = batch
        while left > 0:
            total = sum(weights[i] for i in open_) or len(open_)
            share = {i: left * ((weights[i] / total) if total else 1 / len(open_)) for i in open_}
            base = {i: min(int(share[i]), int(min(caps[i] - counts[i], batch))) for i in open_}
            for i in open_:
                counts[i] += base[i]
            left -= sum(base.values())
            by_remainder = sorted(open_, key=lambda i: (share[i] - int(share[i])), reverse=True)
            for i in by_remainder:
                if left == 0:
                    break
                if counts[i] < caps[i]:
                    counts[i] += 1
                    left -= 1
            open_ = [i for i in open_ if counts[i] < caps[i]]
        return counts
    for _ in range(batch):
        live = [i for i in open_ if counts[i] < caps[i]]
        w = [weights[i] for i in live]
        i = rng.choices(live, weights=w if sum(w) > 0 else None)[0]
        counts[i] += 1
    return counts


class ShardedReplay:
    """The reader's side of one replay table over ``shards`` (ReplayClients, shard order irrelevant)."""

    def __init__(self, shards: Sequence, seed: int | None = None, poll_seconds: float = 0.1):
        if len(shards) < 2:
            raise ValueError("shards: give two or more replay clients (one replay needs no ShardedReplay)")
        self.shards = list(shards)
        self.rng = random.Random(seed)
        self.poll_seconds = poll_seconds

    def stats(self, table: str = "default") -> list[replay_pb2.StatsResponse]:
        return [s.stats(table) for s in self.shards]

    def _plan(self, batch: int, stats: list[replay_pb2.StatsResponse]) -> tuple[list[int] | None, list[float]]:
        config = stats[0].config
        prioritized = config.sampler == "prioritized"
        sizes = [float(s.size) for s in stats]
        weights = [s.total_weight if prioritized and s.total_weight > 0 else float(s.size) for s in stats]
        if prioritized and not any(s.total_weight > 0 for s in stats):
            weights = sizes  # every priority 0: uniform, as one table draws then
        once = config.max_times_sampled == 1
        caps = [size if once else (float("inf") if size > 0 else 0.0) for size in sizes]
        rng = None if config.sampler in ("fifo", "lifo") else self.rng
        return split_counts(batch, weights, caps, rng), weights

    def sample_batch(self, batch_size: int, table: str = "default", timeout_ms: int = 10_000,
                     current_policy_version: int | None = None, importance_sampling_exponent: float | None = None,
                     lease_ms: int = 0) -> replay_pb2.SampleResponse:
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            stats = self.stats(table)
            counts, weights = self._plan(batch_size, stats)
            if counts is not None:
                break
            if time.monotonic() >= deadline:
                raise _Expired(f"{sum(s.size for s in stats)} groups in {len(stats)} shards of table {table!r}, "
                               f"{batch_size} asked, after {timeout_ms} ms")
            time.sleep(min(self.poll_seconds, max(0.0, deadline - time.monotonic())))
        drawn: list[tuple[int, replay_pb2.SampleResponse]] = []
        for i, n in enumerate(counts):
            if n == 0:
                continue
            left_ms = max(1, int((deadline - time.monotonic()) * 1000))
            try:
                drawn.append((i, self.shards[i].sample_batch(n, table, left_ms, current_policy_version,
                                                             importance_sampling_exponent, lease_ms)))
            except grpc.RpcError:
                if lease_ms > 0 or not drawn:
                    for j, r in drawn:  # leased: back to their shards, nothing held
                        try:
                            self.shards[j].ack_sample(r.lease_id, "requeue")
                        except grpc.RpcError:
                            pass  # the lease runs out and gives them back by itself
                    raise
                break  # draws already final: the reader gets them
        return self._combine(drawn, stats, weights, importance_sampling_exponent)

    @staticmethod
    def _combine(drawn, stats, weights, beta: float | None) -> replay_pb2.SampleResponse:
        config = stats[0].config
        beta = config.importance_sampling_exponent if beta is None else beta
        total = sum(weights) or 1.0
        mins = [s.min_weight for s in stats if s.min_weight > 0]
        global_min = min(mins) if mins else 0.0
        size = sum(s.size for s in stats)
        out = replay_pb2.SampleResponse()
        leases = []
        for i, r in drawn:
            out.groups.extend(r.groups)
            scale = (global_min / stats[i].min_weight) ** beta if global_min > 0 and stats[i].min_weight > 0 else 1.0
            for info in r.info:
                g = out.info.add()
                g.CopyFrom(info)
                g.probability = info.probability * weights[i] / total
                g.importance_weight = info.importance_weight * scale
                g.table_size = size
            out.current_policy_version = max(out.current_policy_version, r.current_policy_version)
            if r.lease_id:
                leases.append(f"{i}={r.lease_id}")
        out.lease_id = ";".join(leases)
        return out

    def ack_sample(self, lease_id: str, action: str = "ack", extend_ms: int = 0) -> replay_pb2.AckSampleResponse:
        """Settle every shard's lease of the batch; the first error is raised after all were tried."""
        groups, error = 0, None
        for part in filter(None, lease_id.split(";")):
            index, _, lease = part.partition("=")
            if not index.isdigit() or int(index) >= len(self.shards) or not lease:
                raise ValueError(f"lease_id: {part!r} is not a lease of these {len(self.shards)} shards")
            try:
                groups += self.shards[int(index)].ack_sample(lease, action, extend_ms).groups
            except grpc.RpcError as e:
                error = error or e
        if error is not None:
            raise error
        return replay_pb2.AckSampleResponse(groups=groups)

    def update_priorities(self, priorities: dict[str, float], table: str = "default"
                          ) -> replay_pb2.UpdatePrioritiesResponse:
        answers = [s.update_priorities(priorities, table) for s in self.shards]
        unknown = set.intersection(*(set(a.unknown_group_ids) for a in answers))
        return replay_pb2.UpdatePrioritiesResponse(updated=sum(a.updated for a in answers),
                                                   unknown_group_ids=sorted(unknown))
