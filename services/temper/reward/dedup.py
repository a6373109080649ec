"""What the stream path published, by rollout: redelivery is answered, not scored again.

Kafka delivers a rollout at least once. When a rollout comes again (a crash or restart between
publishing its scored group and committing its offset), the service publishes the very scored
group it published the first time, from this table: the same group_id with the same rewards, and
no second sandbox run or model forward. Downstream consumers then recognise the group_id.

Key: (group_id, sha256 of the rollout's deterministic serialization), so a different rollout
under a reused id is scored afresh. Entries are written before the scored group is published.
Bounded: beyond ``max_entries`` the oldest go (a redelivery reaches back only to the last
committed offset, far fewer messages than that).
"""

from __future__ import annotations

import hashlib
import sqlite3
import threading
from pathlib import Path

from temper.v1 import common_pb2


def digest(group: common_pb2.RolloutGroup) -> str:
    return hashlib.sha256(group.SerializeToString(deterministic=True)).hexdigest()


class ScoredCache:
    def __init__(self, path: str | Path, max_entries: int = 10_000):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.max_entries = max_entries
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS scored (seq INTEGER PRIMARY KEY AUTOINCREMENT, group_id TEXT, "
                         "input_sha TEXT, scored BLOB, UNIQUE (group_id, input_sha))")
        self._lock = threading.Lock()
        self.hits = 0

    def get(self, group: common_pb2.RolloutGroup) -> common_pb2.RolloutGroup | None:
        with self._lock:
            row = self._db.execute("SELECT scored FROM scored WHERE group_id = ? AND input_sha = ?",
                                   (group.group_id, digest(group))).fetchone()
        if row is None:
            return None
        self.hits += 1
        return common_pb2.RolloutGroup.FromString(row[0])

    def put(self, group: common_pb2.RolloutGroup, scored: common_pb2.RolloutGroup) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO scored (group_id, input_sha, scored) VALUES (?, ?, ?)",
                             (group.group_id, digest(group), scored.SerializeToString()))
            self._db.execute("DELETE FROM scored WHERE seq <= (SELECT MAX(seq) FROM scored) - ?", (self.max_entries,))

    def close(self) -> None:
        with self._lock:
            self._db.close()
