"""Reward curves from scored groups: mean reward per (domain, policy version). No transport.

Groups are counted once by ``group_id`` (a redelivered group does not move the curve).
"""

from __future__ import annotations

import threading
from collections import defaultdict

from temper.v1 import common_pb2


class RewardCurves:
    def __init__(self):
        self._lock = threading.Lock()
        self._seen: set[str] = set()
        self._sums: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0.0, 0])

    def add(self, group: common_pb2.RolloutGroup) -> bool:
        """Count ``group``'s OK rewards; False if it was already counted."""
        with self._lock:
            if group.group_id in self._seen:
                return False
            self._seen.add(group.group_id)
            for t in group.trajectories:
                if t.reward.status == common_pb2.REWARD_STATUS_OK:
                    acc = self._sums[(group.task.domain, t.policy_version)]
                    acc[0] += t.reward.total
                    acc[1] += 1
            return True

    def points(self, domain: str = "") -> list[tuple[str, int, float, int]]:
        """(domain, policy_version, mean_reward, samples), sorted by domain then version."""
        with self._lock:
            return [(d, v, s / n, n) for (d, v), (s, n) in sorted(self._sums.items()) if n and (not domain or d == domain)]
