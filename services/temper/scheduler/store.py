"""The scheduler's durable job state: one sqlite file in its data dir (``jobs.sqlite``). No gRPC.

Two tables, written as the monitor and replay write theirs (WAL, ``synchronous=FULL``: a write is
durable when the call returns):

- ``jobs``: per job its accepted JobSpec (protobuf bytes), its state and its latest checkpoint
  (``temper.scheduler.core.Job.checkpoint``, JSON). Each save replaces the row in one transaction,
  so a kill -9 leaves the previous checkpoint or the new one, never half of one.
- ``outcomes``: each scored group a job's sampling policy learned from the `scored` stream, keyed by
  (job, group id), so a redelivery is recognised and learned once. Recorded before the consumer
  commits the message's offset. An outcome a later checkpoint already holds keeps only its key (the
  body is dropped with that checkpoint's save): the key still refuses a redelivery.

The domain logic (what a checkpoint holds, how a job resumes) is in ``temper.scheduler.core``.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from temper.runtime.sqlite import open_sqlite
from temper.scheduler.core import JobSpec
from temper.v1 import scheduler_pb2

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (job_id TEXT PRIMARY KEY, accepted INTEGER NOT NULL, spec BLOB NOT NULL,
                                 state INTEGER NOT NULL, checkpoint TEXT NOT NULL, updated_ms INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS outcomes (seq INTEGER PRIMARY KEY AUTOINCREMENT, job_id TEXT NOT NULL,
                                     group_id TEXT NOT NULL, body TEXT, UNIQUE (job_id, group_id));
"""


@dataclass
class SavedJob:
    spec: JobSpec
    checkpoint: dict
    outcomes: list[tuple[int, dict]] = field(default_factory=list)  # (seq, outcome) after the checkpoint's

    @property
    def state(self) -> int:
        return int(self.checkpoint["state"])


class JobStore:
    """Thread-safe: the job's thread, gRPC handlers and the `scored` consumer write through one connection."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = open_sqlite(self.path)  # durable: an offset is committed (a step counted) after a commit returns
        self._db.executescript(SCHEMA)

    def save(self, spec: JobSpec, checkpoint: dict) -> None:
        """Replace the job's checkpoint (the spec row is written with the first save)."""
        body = json.dumps(checkpoint, separators=(",", ":"))
        now = int(time.time() * 1000)
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute(
                    "INSERT INTO jobs VALUES (?, (SELECT COALESCE(MAX(accepted), 0) + 1 FROM jobs), ?, ?, ?, ?) "
                    "ON CONFLICT (job_id) DO UPDATE SET state = excluded.state, checkpoint = excluded.checkpoint, "
                    "updated_ms = excluded.updated_ms",
                    (spec.job_id, spec.to_proto().SerializeToString(deterministic=True), int(checkpoint["state"]),
                     body, now))
                self._db.execute("UPDATE outcomes SET body = NULL WHERE job_id = ? AND seq <= ? AND body IS NOT NULL",
                                 (spec.job_id, int(checkpoint.get("outcomes_seq", 0))))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def record_outcome(self, job_id: str, group_id: str, outcome: dict) -> int | None:
        with self._lock:
            cur = self._db.execute("INSERT OR IGNORE INTO outcomes (job_id, group_id, body) VALUES (?, ?, ?)",
                                   (job_id, group_id, json.dumps(outcome, separators=(",", ":"))))
            return cur.lastrowid if cur.rowcount == 1 else None

    def jobs(self) -> list[SavedJob]:
        """Every saved job in the order they were accepted, each with the outcomes its checkpoint lacks."""
        with self._lock:
            rows = self._db.execute("SELECT job_id, spec, checkpoint FROM jobs ORDER BY accepted").fetchall()
            out = []
            for job_id, spec, checkpoint in rows:
                cp = json.loads(checkpoint)
                outcomes = [(seq, json.loads(body)) for seq, body in self._db.execute(
                    "SELECT seq, body FROM outcomes WHERE job_id = ? AND seq > ? AND body IS NOT NULL ORDER BY seq",
                    (job_id, int(cp.get("outcomes_seq", 0))))]
                out.append(SavedJob(JobSpec.from_proto(scheduler_pb2.JobSpec.FromString(spec)), cp, outcomes))
        return out

    def close(self) -> None:
        with self._lock:
            self._db.close()
