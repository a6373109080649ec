"""Durable experience tables (SQLite, WAL, synchronous=FULL): no gRPC, no Kafka.

Invariants:
- a group is stored at most once per table, keyed by ``group_id`` (redelivery never
  double-counts), and the key is remembered after the group was sampled and removed;
- ``insert`` returns only after the group is durable (committed to disk);
- groups are inserted and sampled whole.
The skeleton's only sampler is FIFO with max-times-sampled = 1: a sample takes the oldest
``batch_size`` groups and removes them, in one transaction.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from temper.runtime.errors import DeadlineExceeded, InvalidArgument, require
from temper.v1 import common_pb2

SCHEMA = """
CREATE TABLE IF NOT EXISTS items (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    tbl TEXT NOT NULL,
    group_id TEXT NOT NULL,
    domain TEXT NOT NULL,
    policy_version INTEGER NOT NULL,
    data BLOB,                       -- NULL once removed; the row stays as a dedup key
    removed INTEGER NOT NULL DEFAULT 0,
    UNIQUE (tbl, group_id)
);
CREATE INDEX IF NOT EXISTS items_live ON items (tbl, removed, seq);
CREATE TABLE IF NOT EXISTS counters (tbl TEXT, name TEXT, value INTEGER, PRIMARY KEY (tbl, name));
"""


@dataclass
class TableStats:
    table: str
    size: int
    inserts: int
    samples: int
    duplicates: int
    domain_counts: dict[str, int]


def validate_group(group: common_pb2.RolloutGroup, field: str = "group") -> None:
    require(bool(group.group_id), f"{field}.group_id", "required")
    require(len(group.trajectories) > 0, f"{field}.trajectories", "empty group")
    for i, t in enumerate(group.trajectories):
        f = f"{field}.trajectories[{i}]"
        require(len(t.completion_token_ids) == len(t.completion_logprobs), f"{f}.completion_logprobs",
                f"{len(t.completion_logprobs)} logprobs for {len(t.completion_token_ids)} completion tokens")
        require(len(t.completion_token_ids) > 0, f"{f}.completion_token_ids", "empty completion")
        require(t.HasField("reward"), f"{f}.reward", "unscored trajectory")
        require(t.reward.status == common_pb2.REWARD_STATUS_OK, f"{f}.reward.status",
                f"reward not OK: {[c.error for c in t.reward.components if c.error]}")
        require(t.reward.total == t.reward.total and abs(t.reward.total) != float("inf"), f"{f}.reward.total",
                "NaN or inf")


class ReplayStore:
    def __init__(self, path: str | Path, tables: list[str]):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.tables = set(tables)
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(SCHEMA)
        self._cond = threading.Condition()

    def _check_table(self, table: str) -> None:
        require(table in self.tables, "table", f"unknown table {table!r}; known: {sorted(self.tables)}")

    def insert(self, table: str, groups: list[common_pb2.RolloutGroup]) -> tuple[int, int]:
        """Store ``groups`` durably; returns (inserted, duplicates). All validated first."""
        self._check_table(table)
        for i, g in enumerate(groups):
            validate_group(g, f"groups[{i}]" if len(groups) > 1 else "group")
        inserted = 0
        with self._cond:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for g in groups:
                    version = min(t.policy_version for t in g.trajectories)
                    cur = self._db.execute(
                        "INSERT OR IGNORE INTO items (tbl, group_id, domain, policy_version, data) VALUES (?,?,?,?,?)",
                        (table, g.group_id, g.task.domain, version, g.SerializeToString()))
                    inserted += cur.rowcount
                duplicates = len(groups) - inserted
                self._bump(table, inserts=inserted, duplicates=duplicates)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._cond.notify_all()
        return inserted, duplicates

    def sample(self, table: str, batch_size: int, timeout: float, max_batch: int) -> list[common_pb2.RolloutGroup]:
        """Take the oldest ``batch_size`` groups, waiting up to ``timeout`` seconds for them."""
        self._check_table(table)
        require(1 <= batch_size <= max_batch, "batch_size", f"must be in [1, {max_batch}], got {batch_size}")
        require(timeout >= 0, "timeout_ms", "must be >= 0")
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._size(table) < batch_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DeadlineExceeded(f"{self._size(table)} of {batch_size} groups available "
                                           f"after {timeout:.1f}s", field="batch_size")
                self._cond.wait(left)
            self._db.execute("BEGIN IMMEDIATE")
            try:
                rows = self._db.execute("SELECT seq, data FROM items WHERE tbl=? AND removed=0 ORDER BY seq LIMIT ?",
                                        (table, batch_size)).fetchall()
                self._db.executemany("UPDATE items SET removed=1, data=NULL WHERE seq=?", [(r[0],) for r in rows])
                self._bump(table, samples=len(rows))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return [common_pb2.RolloutGroup.FromString(r[1]) for r in rows]

    def stats(self, table: str) -> TableStats:
        self._check_table(table)
        with self._cond:
            counters = dict(self._db.execute("SELECT name, value FROM counters WHERE tbl=?", (table,)).fetchall())
            domains = Counter(dict(self._db.execute(
                "SELECT domain, COUNT(*) FROM items WHERE tbl=? AND removed=0 GROUP BY domain", (table,)).fetchall()))
            return TableStats(table=table, size=self._size(table), inserts=counters.get("inserts", 0),
                              samples=counters.get("samples", 0), duplicates=counters.get("duplicates", 0),
                              domain_counts=dict(domains))

    def _size(self, table: str) -> int:
        return self._db.execute("SELECT COUNT(*) FROM items WHERE tbl=? AND removed=0", (table,)).fetchone()[0]

    def _bump(self, table: str, **deltas: int) -> None:
        for name, delta in deltas.items():
            self._db.execute("INSERT INTO counters (tbl, name, value) VALUES (?,?,?) "
                             "ON CONFLICT (tbl, name) DO UPDATE SET value = value + excluded.value",
                             (table, name, delta))

    def close(self) -> None:
        self._db.close()


__all__ = ["ReplayStore", "TableStats", "validate_group", "InvalidArgument"]
