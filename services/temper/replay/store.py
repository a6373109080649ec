"""Durable experience tables: an in-memory index per table over a SQLite log. No gRPC, no Kafka.

Durable state: SQLite (WAL, ``synchronous=FULL``) holds one row per group ever inserted (its
dedup key, table, priority, times sampled, why it left, where its bytes are) and the counters;
the groups' bytes live in append-only segment files (``payloads.PayloadLog``), synced before
the transaction that references them commits. Each table's live groups are also held in memory
(``tables.Table``), so sampling never reads disk. Every operation that changes durable state
runs as one SQLite transaction under the store's lock and returns only after ``COMMIT``; if a
transaction fails, the tables are rebuilt from disk.

Invariants:
- a group is stored at most once per table, keyed by ``group_id``; the key outlives the group
  (sampled out, evicted, too stale), so a Kafka redelivery never re-admits a consumed group;
- ``insert`` returns only after its groups are durable: a kill -9 loses no acknowledged group;
- a sample that uses a group up (``max_times_sampled``) or moves a rate limiter with a ratio is
  durable before it returns, so a kill -9 never re-admits a group that was handed out as used
  up. Samples from tables without either (unlimited draws, no ratio) change nothing a restart
  depends on; their times-sampled and sample counters are written with the next transaction,
  a checkpoint, or at close;
- groups are inserted and sampled whole;
- a leased sample (``lease_s`` > 0) changes nothing durable until ``ack`` acknowledges it: its draws are
  held in memory, given back to the table (as if never drawn) when the lease runs out or is requeued, and
  on a restart every outstanding lease is back too (the store reloads what is durable). Delivery is then at
  least once: a caller that dies between the draw and its ack loses nothing, and one that acks after its
  lease ran out learns it (NOT_FOUND) -- its groups may be drawn again. Counters written by other
  transactions meanwhile include the outstanding draws (a restart then counts them as samples: the rate
  limiter errs towards fewer samples, never more).
"""

from __future__ import annotations

import math
import os
import re
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from temper.replay.payloads import PayloadLog
from temper.replay.tables import Draw, Removal, Table, TableConfig, TableStats
from temper.replay.wire import array_lengths, upgrade_token_ids
from temper.runtime.errors import Cancelled, DeadlineExceeded, FailedPrecondition, InvalidArgument, NotFound, require
from temper.runtime.logs import get_logger
from temper.runtime.sqlite import open_sqlite
from temper.runtime.storage import Mirror
from temper.v1 import common_pb2

SCHEMA_VERSION = 2  # 1: token ids stored as varints (int32); 2: sfixed32 (the migration re-encodes)
SCHEMA = """
CREATE TABLE IF NOT EXISTS items (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    tbl TEXT NOT NULL,
    group_id TEXT NOT NULL,
    domain TEXT NOT NULL,
    policy_version INTEGER NOT NULL,
    data BLOB,                           -- schema 0 kept the bytes here (the migration moves them to segments)
    removed INTEGER NOT NULL DEFAULT 0,  -- tables.Removal: 0 live, else why it left (the row stays: dedup key)
    priority REAL NOT NULL DEFAULT 1.0,
    times_sampled INTEGER NOT NULL DEFAULT 0,
    inserted_ms INTEGER NOT NULL DEFAULT 0,
    seg TEXT,                            -- payload segment file, offset and length (live groups)
    off INTEGER,
    len INTEGER,
    UNIQUE (tbl, group_id)
);
CREATE INDEX IF NOT EXISTS items_live ON items (tbl, removed, seq);
CREATE TABLE IF NOT EXISTS counters (tbl TEXT, name TEXT, value INTEGER, PRIMARY KEY (tbl, name));
"""
NEW_COLUMNS = (("priority", "REAL NOT NULL DEFAULT 1.0"), ("times_sampled", "INTEGER NOT NULL DEFAULT 0"),
               ("inserted_ms", "INTEGER NOT NULL DEFAULT 0"), ("seg", "TEXT"), ("off", "INTEGER"), ("len", "INTEGER"))
_log = get_logger(component="replay-store")

MAX_CHUNK = 256  # groups per insert transaction (group commit): bounds how long an insert holds the lock
MAX_LEASE_S = 86_400.0  # longest lease a sample may ask for (a day)
COMPACT_EVERY_S = 5.0  # how often inserts look for sparse payload segments to compact
CHECKPOINT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


# A scored trajectory's reward status. ERROR (a component could not be computed: a PRM's sequence too long, a
# verifier that failed) is stored like OK: the learner drops such a group when it draws it, counted as
# ``reward_error`` (temper.learner.batching), so the step it belongs to still counts it. Refused here it would
# never reach the learner, which would wait for it, and an on-policy job would wait for that step for ever.
SCORED = (common_pb2.REWARD_STATUS_OK, common_pb2.REWARD_STATUS_ERROR)


def validate_group(group: common_pb2.RolloutGroup, field: str = "group") -> None:
    """INVALID_ARGUMENT naming the field unless ``group`` (a RolloutGroup or its wire view) can be stored.

    The checks run on every inserted group, so they are cheap tests first and the messages (field
    names, formatted values) are built only for a group that fails one (``_refuse_group``)."""
    gid = group.group_id
    trajectories = group.trajectories
    if not gid or not trajectories:
        _refuse_group(group, field)
    for t in trajectories:
        tokens, logprobs, malformed = array_lengths(t)  # a wire view (wire.py) is counted, not decoded
        tgid, reward = t.group_id, t.reward
        if (malformed or tokens != logprobs or not tokens or (tgid and tgid != gid) or t.policy_version < 0
                or not t.HasField("reward") or reward.status not in SCORED
                or not math.isfinite(reward.total)):
            _refuse_group(group, field)


def _refuse_group(group, field: str) -> None:
    """Raise INVALID_ARGUMENT naming the first field of ``group`` that is wrong."""
    require(bool(group.group_id), f"{field}.group_id", "required")
    require(len(group.trajectories) > 0, f"{field}.trajectories", "empty group")
    for i, t in enumerate(group.trajectories):
        f = f"{field}.trajectories[{i}]"
        tokens, logprobs, malformed = array_lengths(t)
        require(malformed is None, f"{f}.{malformed}", "malformed packed array")
        require(tokens == logprobs, f"{f}.completion_logprobs", f"{logprobs} logprobs for {tokens} completion tokens")
        require(tokens > 0, f"{f}.completion_token_ids", "empty completion")
        require(not t.group_id or t.group_id == group.group_id, f"{f}.group_id",
                f"{t.group_id!r} in group {group.group_id!r}")
        require(t.policy_version >= 0, f"{f}.policy_version", f"must be >= 0, got {t.policy_version}")
        require(t.HasField("reward"), f"{f}.reward", "unscored trajectory")
        require(t.reward.status in SCORED, f"{f}.reward.status",
                f"unscored (status {common_pb2.RewardStatus.Name(t.reward.status)})")
        require(math.isfinite(t.reward.total), f"{f}.reward.total", "NaN or inf")
    raise AssertionError("unreachable: validate_group found a fault _refuse_group did not")


def validate_priority(priority: float, field: str) -> None:
    require(math.isfinite(priority) and priority >= 0, field, f"must be finite and >= 0, got {priority}")


@dataclass
class InsertResult:
    inserted: int = 0
    duplicates: int = 0
    stale: int = 0
    evicted: int = 0
    limiter: tuple[int, int, int] = (0, 0, 0)  # (inserts, samples, deletes) right after the last chunk


@dataclass
class SampleResult:
    draws: list[Draw]
    policy_version: int
    limiter: tuple[int, int, int]  # (inserts, samples, deletes) right after this sample
    lease_id: str = ""  # a leased sample's: acknowledge it with ``ack``


@dataclass
class Lease:
    """Draws held for a caller until it acknowledges them (``ReplayStore.ack``) or ``deadline`` passes."""

    table: str
    deadline: float  # time.monotonic()
    draws: list[Draw]
    removed: list[tuple[int, Removal]]  # the items these draws used up (gone from memory, not yet from disk)


@dataclass
class Prepared:
    """A validated group ready for ``insert``: its key facts and its serialized bytes."""

    group_id: str
    domain: str
    oldest_version: int
    newest_version: int
    priority: float | None
    payload: bytes | memoryview
    field: str  # how the request names this group, for errors


class ReplayStore:
    def __init__(self, path: str | Path, tables: dict[str, TableConfig] | list[str],
                 checkpoint_dir: str | Path | None = None, fsync: bool = True, mirror: Mirror | None = None):
        """``fsync=False`` keeps every guarantee against a crash of this process (kill -9: what
        was written is in the OS page cache) but not against an OS crash or power loss; it saves
        two fsyncs per write transaction."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not isinstance(tables, dict):
            tables = {name: TableConfig() for name in tables}
        self.configs = dict(tables)
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else self.path.parent / "checkpoints"
        self.mirror = mirror  # object storage every checkpoint is uploaded to (runtime.storage)
        self.log = PayloadLog(self.path.parent / f"{self.path.stem}-payloads", fsync=fsync)
        self._cond = threading.Condition(threading.Lock())
        self._closed = False
        self._where: dict[int, tuple[str, int, int]] = {}  # seq -> (segment, offset, length) of live groups
        self._pinned: set[str] = set()  # segments of tables no longer configured: never collected
        self._garbage = False  # a segment may have lost its last reference
        self._deferred: dict[int, int] = {}  # seq -> times_sampled not yet written
        self._dirty: set[str] = set()  # tables whose counters are not yet written
        self._leases: dict[str, Lease] = {}  # lease id -> draws held (memory only: a restart gives them back)
        self._lease_outcomes: dict[tuple[str, str], int] = {}  # (table, acked | requeued | expired) -> leases settled
        self._last_compaction = time.monotonic()
        self._db = open_sqlite(self.path, durable=fsync)
        self._migrate()
        self.tables: dict[str, Table] = {}
        self._load()

    # -- schema / loading ------------------------------------------------------------------------
    def _migrate(self) -> None:
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version >= SCHEMA_VERSION:
            return
        old = {r[1] for r in self._db.execute("PRAGMA table_info(items)")}
        self._db.execute("BEGIN IMMEDIATE")
        for statement in SCHEMA.split(";"):
            if statement.strip():
                self._db.execute(statement)
        if old:  # schema 0 (the walking skeleton's): bytes inline, none of the newer columns
            for column, decl in NEW_COLUMNS:
                if column not in old:
                    self._db.execute(f"ALTER TABLE items ADD COLUMN {column} {decl}")
            rows = self._db.execute("SELECT seq, data FROM items WHERE removed=0 AND data IS NOT NULL").fetchall()
            for seq, data in rows:
                seg, off = self.log.append(data)
                self._db.execute("UPDATE items SET seg=?, off=?, len=?, data=NULL WHERE seq=?", (seg, off, len(data), seq))
            self._db.execute("UPDATE items SET data=NULL WHERE data IS NOT NULL")
            self.log.sync()
        if version < 2:
            self._upgrade_token_ids()
        self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        self._db.execute("COMMIT")

    def _upgrade_token_ids(self) -> None:
        """Schema 1 -> 2: every live group's bytes re-encoded with fixed-width token ids (written to
        new segment space; the rows point there once committed, the old segments are collected by
        ``_load``). A group that cannot be read stops the store: nothing is dropped."""
        rows = self._db.execute("SELECT seq, seg, off, len FROM items WHERE removed=0 AND seg IS NOT NULL").fetchall()
        readers: dict[str, Callable[[int, int], bytes]] = {}
        for seq, seg, off, length in rows:
            if seg not in readers:
                readers[seg] = self.log.reader(seg)
            data = upgrade_token_ids(readers[seg](off, length))
            new_seg, new_off = self.log.append(data)
            self._db.execute("UPDATE items SET seg=?, off=?, len=? WHERE seq=?", (new_seg, new_off, len(data), seq))
        self.log.sync()
        if rows:
            _log.info("replay store migrated to schema 2 (fixed-width token ids)", groups=len(rows))

    def _load(self) -> None:
        """(Re)build every table's in-memory index from disk, apply each config's limits, and
        delete payload segments nothing references (left by a crash or a restore)."""
        self.log.live.clear()
        self._where.clear()
        # seqs are assigned by inserts (see _insert_chunk), past every seq ever used
        used = [self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM items").fetchone()[0],
                *(r[0] for r in self._db.execute("SELECT seq FROM sqlite_sequence WHERE name='items'"))]
        self._next_seq = 1 + max(used)
        self._leases.clear()  # what they held is live again on disk, so in the tables rebuilt below
        self._deferred.clear()
        self._dirty.clear()
        configured = sorted(self.configs)
        marks = ",".join("?" * len(configured))
        self._pinned = {r[0] for r in self._db.execute(
            f"SELECT DISTINCT seg FROM items WHERE removed=0 AND seg IS NOT NULL AND tbl NOT IN ({marks})", configured)}
        readers: dict[str, Callable[[int, int], bytes]] = {}
        self.tables = {name: self._load_table(name, config, readers) for name, config in self.configs.items()}
        self.log.collect(self._pinned)

    def _load_table(self, name: str, config: TableConfig, readers: dict) -> Table:
        table = Table(name, config)
        counters = dict(self._db.execute("SELECT name, value FROM counters WHERE tbl=?", (name,)).fetchall())
        table.policy_version = counters.get("policy_version", 0)
        table.duplicates = counters.get("duplicates", 0)
        for r in Removal:
            table.removed[r] = counters.get(f"removed_{r.name.lower()}", 0)
        rows = self._db.execute(
            "SELECT seq, group_id, domain, policy_version, priority, times_sampled, inserted_ms, seg, off, len "
            "FROM items WHERE tbl=? AND removed=0 ORDER BY seq", (name,))
        for seq, gid, domain, version, priority, times_sampled, inserted_ms, seg, off, length in rows:
            if seg not in readers:
                readers[seg] = self.log.reader(seg)
            table.load(seq, gid, domain, version, priority, readers[seg](off, length), inserted_ms, times_sampled)
            self._where[seq] = (seg, off, length)
            self.log.reference(seg, length)
        table.limiter.inserts = counters.get("inserts", table.items.n)
        table.limiter.samples = counters.get("samples", 0)
        table.limiter.deletes = table.limiter.inserts - table.items.n  # size = inserts - deletes, by construction
        removed = table.enforce_limits()  # a config may have changed since the items were written
        if removed:
            self._transaction(lambda: self._persist(table, removed), [table], reload=False)
        return table

    # -- plumbing --------------------------------------------------------------------------------
    def _table(self, name: str, field: str = "table") -> Table:
        if self._closed:
            raise FailedPrecondition("the replay store is closed")
        table = self.tables.get(name)
        if table is None:
            raise InvalidArgument(f"unknown table {name!r}; known: {sorted(self.tables)}", field=field)
        return table

    def _transaction(self, body: Callable[[], None], touched: list[Table], reload: bool = True) -> None:
        """Run ``body``, write counters (and deferred sample bookkeeping), sync payloads, commit.

        If anything fails the transaction is rolled back and, since ``body`` may have changed
        the in-memory tables already, they are rebuilt from disk (the truth).
        """
        self._db.execute("BEGIN IMMEDIATE")
        try:
            body()
            if self._deferred:
                self._db.executemany("UPDATE items SET times_sampled=? WHERE seq=?",
                                     [(n, s) for s, n in self._deferred.items()])
            written = {t.name: t for t in touched} | {n: self.tables[n] for n in self._dirty if n in self.tables}
            for table in written.values():
                self._write_counters(table)
            self.log.sync()  # the bytes the new rows point at are on disk before the rows are
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            if reload:
                self._load()
            raise
        self._deferred.clear()
        self._dirty.clear()
        if self._garbage:
            self._garbage = False
            self.log.collect(self._pinned)

    def _write_counters(self, table: Table) -> None:
        values = {"inserts": table.limiter.inserts, "samples": table.limiter.samples,
                  "duplicates": table.duplicates, "policy_version": table.policy_version,
                  **{f"removed_{r.name.lower()}": table.removed[r] for r in Removal if r != Removal.LIVE}}
        self._db.executemany("INSERT OR REPLACE INTO counters (tbl, name, value) VALUES (?,?,?)",
                             [(table.name, k, v) for k, v in values.items()])

    def _persist(self, table: Table, removed: list[tuple[int, Removal]]) -> None:
        """Record removals; their payload bytes are released (segments go once unreferenced)."""
        if not removed:
            return
        self._db.executemany("UPDATE items SET removed=? WHERE seq=?", [(int(r), s) for s, r in removed])
        for seq, _ in removed:
            seg, _, length = self._where.pop(seq)
            self.log.release(seg, length)
            self._garbage |= self.log.live[seg] <= 0

    def _wait(self, table: Table, side: str, deadline: float, not_ready: Callable[[], str | None],
              field: str, alive: Callable[[], bool] | None = None) -> None:
        """Block (releasing the lock) until ``not_ready()`` is None; DEADLINE_EXCEEDED naming why;
        CANCELLED as soon as ``alive()`` is false (checked on every wake-up, at least every second)."""
        why = not_ready()
        if why is None:
            return
        counter = f"waiting_{side}s"
        setattr(table, counter, getattr(table, counter) + 1)
        try:
            while why is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DeadlineExceeded(f"table {table.name!r} not ready for {side}: {why}", field=field)
                # at least every second while a caller may go away or a lease may run out
                self._cond.wait(left if alive is None and not self._leases else min(left, 1.0))
                if alive is not None and not alive():
                    raise Cancelled(f"the caller went away while waiting to {side}", field=field)
                if self._closed:
                    raise FailedPrecondition("the replay store is closing")
                self._expire_leases()
                why = not_ready()
        finally:
            setattr(table, counter, getattr(table, counter) - 1)

    # -- insert ----------------------------------------------------------------------------------
    def prepare(self, groups: list[common_pb2.RolloutGroup], priorities: list[float | None] | None = None,
                fields: list[str] | None = None, payloads: list[bytes | memoryview | None] | None = None) -> list[Prepared]:
        """Validate ``groups`` (INVALID_ARGUMENT naming the field) and take their bytes for ``insert``.

        ``payloads[i]``, when given, must be ``groups[i]`` as received on the wire (it is stored
        as is instead of serializing the parsed message again).
        """
        fields = fields or (["group"] if len(groups) == 1 else [f"groups[{i}]" for i in range(len(groups))])
        priorities = priorities or [None] * len(groups)
        payloads = payloads or [None] * len(groups)
        out = []
        for g, p, f, raw in zip(groups, priorities, fields, payloads):
            validate_group(g, f)
            if p is not None:
                validate_priority(p, _priority_field(f))
            versions = [tr.policy_version for tr in g.trajectories]
            out.append(Prepared(g.group_id, g.task.domain, min(versions), max(versions), p,
                                raw if raw is not None else g.SerializeToString(), f))
        return out

    def insert(self, table: str, groups: list[common_pb2.RolloutGroup] | list[Prepared],
               priorities: list[float | None] | None = None, timeout: float = 60.0,
               fields: list[str] | None = None) -> InsertResult:
        """Store ``groups`` durably, waiting up to ``timeout`` s for the rate limiter to let them in.

        Every group is validated before anything is stored (``groups`` may also be what
        ``prepare`` returned). On DEADLINE_EXCEEDED the groups before the blocked one are
        stored, durably; inserting them again is a no-op (dedup by group_id).
        """
        t = self._table(table)
        pending = groups if groups and isinstance(groups[0], Prepared) else self.prepare(groups, priorities, fields)
        result = InsertResult()
        deadline = time.monotonic() + timeout
        with self._cond:
            self._expire_leases()
            i = 0
            while i < len(pending):
                self._wait(t, "insert", deadline, partial(self._insert_blocked, table), pending[i].field)
                t = self._table(table)  # a Restore may have replaced it while we waited
                chunk = pending[i:i + t.limiter.insertable(min(MAX_CHUNK, len(pending) - i))]
                self._transaction(partial(self._insert_chunk, t, chunk, result), [t])
                i += len(chunk)
                self._cond.notify_all()
            result.limiter = (t.limiter.inserts, t.limiter.samples, t.limiter.deletes)
            if time.monotonic() - self._last_compaction > COMPACT_EVERY_S:
                self._compact()
        return result

    def _insert_blocked(self, table: str) -> str | None:
        """Why an insert into ``table`` must wait now (None: it can go)."""
        lim = self._table(table).limiter
        if lim.can_insert(1):
            return None
        return (f"rate limiter: ({lim.inserts} inserts + 1) * {lim.samples_per_insert} - {lim.samples} samples > "
                f"max_diff {lim.max_diff}")

    def _insert_chunk(self, t: Table, chunk: list[Prepared], result: InsertResult) -> None:
        """One transaction's worth of groups, written in bulk: one dedup query, one ``writev`` of
        the payloads, one ``executemany`` of the rows; seqs are assigned here (not by SQLite) so
        the in-memory adds, evictions and removals can follow the per-group order exactly."""
        now_ms = int(time.time() * 1000)
        ids = [p.group_id for p in chunk]
        known = {r[0] for r in self._db.execute(
            f"SELECT group_id FROM items WHERE tbl=? AND group_id IN ({','.join('?' * len(ids))})", [t.name, *ids])}
        # pass 1: decide each group's fate in order, as if the versions were observed one by one
        lag, version = t.config.max_policy_lag, t.policy_version
        fates: list[tuple[Prepared, str]] = []
        for p in chunk:
            version = max(version, p.newest_version)
            if p.group_id in known:
                fates.append((p, "duplicate"))
                continue
            known.add(p.group_id)
            fates.append((p, "stale" if lag >= 0 and p.oldest_version < version - lag else "live"))
        places = iter(self.log.append_many([p.payload for p, fate in fates if fate == "live"]))
        rows, removed = [], []
        # pass 2: rows, then the in-memory table in the same order
        for p, fate in fates:
            removed += t.observe_version(p.newest_version)
            if fate == "duplicate":
                t.duplicates += 1
                result.duplicates += 1
                continue
            seq = self._next_seq
            self._next_seq += 1
            priority = p.priority if p.priority is not None else t.initial_priority()
            if fate == "stale":  # too stale already: remember the key, store nothing
                rows.append((seq, t.name, p.group_id, p.domain, p.oldest_version, int(Removal.STALE_ON_INSERT),
                             priority, now_ms, None, None, None))
                t.removed[Removal.STALE_ON_INSERT] += 1
                result.stale += 1
                continue
            seg, off = next(places)
            rows.append((seq, t.name, p.group_id, p.domain, p.oldest_version, 0, priority, now_ms, seg, off,
                         len(p.payload)))
            self._where[seq] = (seg, off, len(p.payload))
            evicted = t.add(seq, p.group_id, p.domain, p.oldest_version, priority, p.payload, now_ms)
            removed += evicted
            result.inserted += 1
            result.evicted += len(evicted)
        self._db.executemany("INSERT INTO items (seq, tbl, group_id, domain, policy_version, removed, priority, "
                             "inserted_ms, seg, off, len) VALUES (?,?,?,?,?,?,?,?,?,?,?)", rows)
        self._persist(t, removed)

    # -- sample ----------------------------------------------------------------------------------
    def sample(self, table: str, batch_size: int, timeout: float, max_batch: int,
               current_policy_version: int | None = None,
               importance_sampling_exponent: float | None = None,
               alive: Callable[[], bool] | None = None, lease_s: float = 0.0) -> SampleResult:
        """Draw ``batch_size`` groups, waiting up to ``timeout`` s until the table can give them.
        ``alive``: whether the caller still waits for them (a gRPC call's ``is_active``); checked on
        every wake-up and just before drawing, so a caller that went away (a learner killed while
        its Sample waited) never takes groups -- with ``max_times_sampled`` they would be removed
        and its response never read. ``lease_s`` > 0: the draws are held for the caller (see ``ack``)
        instead of final; the result carries the lease id."""
        t = self._table(table)
        require(1 <= batch_size <= max_batch, "batch_size", f"must be in [1, {max_batch}], got {batch_size}")
        require(timeout >= 0, "timeout_ms", "must be >= 0")
        require(math.isfinite(lease_s) and 0 <= lease_s <= MAX_LEASE_S, "lease_ms",
                f"must be in [0, {MAX_LEASE_S * 1000:.0f}], got {lease_s * 1000:.0f}")
        if current_policy_version is not None:
            require(current_policy_version >= 0, "current_policy_version", f"must be >= 0, got {current_policy_version}")
        beta = t.config.importance_sampling_exponent
        if importance_sampling_exponent is not None:
            require(math.isfinite(importance_sampling_exponent) and importance_sampling_exponent >= 0,
                    "importance_sampling_exponent", f"must be finite and >= 0, got {importance_sampling_exponent}")
            beta = importance_sampling_exponent
        limit = min(t.limiter.max_batch(), t.config.max_size * (t.config.max_times_sampled or math.inf))
        require(batch_size <= limit, "batch_size",
                f"{batch_size} can never be served by table {table!r}: its max_size, max_times_sampled and "
                f"rate limiter band allow at most {limit} per sample")
        deadline = time.monotonic() + timeout
        with self._cond:
            self._expire_leases()
            if current_policy_version is not None and current_policy_version > t.policy_version:
                self._transaction(lambda: self._persist(t, t.observe_version(current_policy_version)), [t])
                self._cond.notify_all()
            self._wait(t, "sample", deadline, lambda: t.not_ready(batch_size), "batch_size", alive)
            if alive is not None and not alive():
                raise Cancelled("the caller went away before the sample was drawn", field="batch_size")
            t = self._table(table)
            draws, removed = t.sample(batch_size, beta)
            if lease_s > 0:  # nothing durable changes until the caller acknowledges
                lease_id = uuid.uuid4().hex
                self._leases[lease_id] = Lease(t.name, time.monotonic() + lease_s, draws, removed)
                self._cond.notify_all()
                return SampleResult(draws, t.policy_version, (t.limiter.inserts, t.limiter.samples,
                                                              t.limiter.deletes), lease_id)
            if removed or t.config.max_times_sampled or math.isfinite(t.limiter.min_diff):
                self._commit_draws(t, draws, removed)  # a failure rolls the draws back (tables reloaded)
            else:  # nothing a restart depends on changed: write it with the next transaction
                self._deferred.update({d.seq: d.times_sampled for d in draws})
                self._dirty.add(t.name)
            self._cond.notify_all()
            return SampleResult(draws, t.policy_version, (t.limiter.inserts, t.limiter.samples, t.limiter.deletes))

    # -- leases ----------------------------------------------------------------------------------
    def ack(self, lease_id: str, action: str = "ack", extend_s: float = 0.0) -> int:
        """Settle a leased sample: "ack" makes its draws final (durable before this returns, as an unleased
        sample's), "requeue" gives its groups back now (as if never drawn), "extend" holds them ``extend_s``
        more from now. Returns how many draws the lease held; NOT_FOUND if it ran out or was never given."""
        require(bool(lease_id), "lease_id", "required")
        require(action in ("ack", "requeue", "extend"), "action", f"unknown action {action!r}")
        if action == "extend":
            require(math.isfinite(extend_s) and 0 < extend_s <= MAX_LEASE_S, "extend_ms",
                    f"must be in (0, {MAX_LEASE_S * 1000:.0f}] to extend, got {extend_s * 1000:.0f}")
        with self._cond:
            self._expire_leases()
            lease = self._leases.get(lease_id)
            if lease is None:
                raise NotFound(f"lease {lease_id!r} is not held: it ran out (its groups went back to the table) "
                               "or was never given", field="lease_id")
            if action == "extend":
                lease.deadline = time.monotonic() + extend_s
                return len(lease.draws)
            del self._leases[lease_id]
            t = self.tables[lease.table]
            if action == "requeue":
                self._give_back(lease)
            else:
                self._commit_draws(t, lease.draws, lease.removed)
            self._count_lease(lease.table, "requeued" if action == "requeue" else "acked")
            self._cond.notify_all()
            return len(lease.draws)

    def _commit_draws(self, t: Table, draws: list[Draw], removed: list[tuple[int, Removal]]) -> None:
        """Make a sample's draws durable: the items' times sampled, the removals they caused, the counters."""
        times = {d.seq: d.times_sampled for d in draws}

        def body():
            self._db.executemany("UPDATE items SET times_sampled=? WHERE seq=?", [(n, s) for s, n in times.items()])
            self._persist(t, removed)

        self._transaction(body, [t])

    def leased(self, table: str) -> int:
        """Draws from ``table`` held by outstanding leases."""
        with self._cond:
            return sum(len(lease.draws) for lease in self._held(table))

    def _held(self, table: str) -> list[Lease]:
        """The outstanding leases of ``table``, after those that ran out gave their draws back."""
        self._expire_leases()
        return [lease for lease in self._leases.values() if lease.table == table]

    def _expire_leases(self) -> None:
        now = time.monotonic()
        for lease_id in [k for k, lease in self._leases.items() if lease.deadline <= now]:
            lease = self._leases.pop(lease_id)
            _log.warning("lease ran out: its groups go back to the table", lease_id=lease_id, table=lease.table,
                         groups=len({d.seq for d in lease.draws}))
            self._give_back(lease)
            self._count_lease(lease.table, "expired")
            self._cond.notify_all()

    def _count_lease(self, table: str, outcome: str) -> None:
        self._lease_outcomes[(table, outcome)] = self._lease_outcomes.get((table, outcome), 0) + 1

    def _give_back(self, lease: Lease) -> None:
        t = self.tables[lease.table]
        removed = t.unsample(lease.draws, lease.removed)
        if removed:  # the table's limits on what came back (e.g. it filled up meanwhile)
            self._transaction(lambda: self._persist(t, removed), [t])
        else:
            self._dirty.add(t.name)

    # -- priorities ------------------------------------------------------------------------------
    def update_priorities(self, table: str, priorities: dict[str, float]) -> tuple[int, list[str]]:
        """Set priorities (all validated first); returns (updated, group ids not stored)."""
        self._table(table)
        for gid, p in priorities.items():
            validate_priority(p, f"priorities[{gid!r}]")
        out: list = []
        with self._cond:
            t = self._table(table)

            def body():
                updated, unknown = t.update_priorities(priorities)
                self._db.executemany("UPDATE items SET priority=? WHERE seq=?", [(p, s) for s, p in updated.items()])
                out.append((len(updated), unknown))

            self._transaction(body, [t])
            self._cond.notify_all()
        return out[0]

    # -- stats -----------------------------------------------------------------------------------
    def stats(self, table: str) -> TableStats:
        with self._cond:
            held = self._held(table)  # leases that ran out give their draws back first
            s = self._table(table).stats(int(time.time() * 1000))
            s.leases, s.leased = len(held), sum(len(lease.draws) for lease in held)
            s.lease_outcomes = {o: n for (t, o), n in sorted(self._lease_outcomes.items()) if t == table}
            return s

    # -- payload segments ------------------------------------------------------------------------
    def compact(self, min_fill: float = 0.25) -> int:
        """Copy the live groups out of payload segments less than ``min_fill`` used, so the
        segments can be deleted; returns how many groups moved. Inserts call it now and then."""
        with self._cond:
            return self._compact(min_fill)

    def _compact(self, min_fill: float = 0.25) -> int:
        self._last_compaction = time.monotonic()
        sparse = set(self.log.sparse(min_fill))
        if not sparse:
            return 0
        payload_of = {}
        for t in self.tables.values():
            for seq, i in t.items.pos.items():
                if self._where[seq][0] in sparse:
                    payload_of[seq] = t.items.payload[i]  # from memory: no disk read
        moved: dict[int, tuple[str, int, int]] = {}

        def body():
            for seq, payload in payload_of.items():
                seg, off = self.log.append(payload)
                moved[seq] = (seg, off, len(payload))
            self._db.executemany("UPDATE items SET seg=?, off=? WHERE seq=?",
                                 [(seg, off, seq) for seq, (seg, off, _) in moved.items()])
            for seq, where in moved.items():
                old_seg, _, length = self._where[seq]
                self.log.release(old_seg, length)
                self._where[seq] = where
            self._garbage = True

        self._transaction(body, [])
        return len(moved)

    # -- checkpoint / restore --------------------------------------------------------------------
    def checkpoint(self) -> tuple[str, int, dict[str, int]]:
        """Write a consistent copy of the whole store; returns (checkpoint id, bytes, table sizes)."""
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        with self._cond:
            if self._closed:
                raise FailedPrecondition("the replay store is closed")
            self._transaction(lambda: None, [])  # write what samples deferred
            ckpt_id = time.strftime("replay-%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{time.time_ns() % 10**9:09d}"
            final = self.checkpoint_dir / ckpt_id
            tmp = self.checkpoint_dir / f".{ckpt_id}.tmp"
            tmp.mkdir()
            dest = sqlite3.connect(str(tmp / "replay.sqlite"))
            try:
                self._db.backup(dest)
                dest.execute("PRAGMA journal_mode=DELETE")
            finally:
                dest.close()
            _fsync(tmp / "replay.sqlite")
            segments = {r[0] for r in self._db.execute("SELECT DISTINCT seg FROM items WHERE removed=0 AND seg IS NOT NULL")}
            self.log.export(segments, tmp / "payloads")
            _fsync(tmp)
            tmp.replace(final)
            _fsync(self.checkpoint_dir)
            sizes = {name: t.items.n for name, t in self.tables.items()}
        if self.mirror is not None:  # outside the lock: inserts and samples go on during the upload
            self.mirror.push(final)
        return ckpt_id, sum(f.stat().st_size for f in final.rglob("*") if f.is_file()), sizes

    def restore(self, checkpoint_id: str) -> dict[str, int]:
        """Replace the whole store (every table, counters, dedup keys) with a checkpoint's contents."""
        require(bool(CHECKPOINT_ID.match(checkpoint_id)), "checkpoint_id", f"malformed id {checkpoint_id!r}")
        source = self.checkpoint_dir / checkpoint_id
        if not (source / "replay.sqlite").is_file() and self.mirror is not None \
                and self.mirror.store.exists(f"{checkpoint_id}/replay.sqlite"):
            self.mirror.pull(checkpoint_id, self.checkpoint_dir)
        if not (source / "replay.sqlite").is_file():
            raise NotFound(f"no checkpoint {checkpoint_id!r} in {self.checkpoint_dir}", field="checkpoint_id")
        with self._cond:
            if self._closed:
                raise FailedPrecondition("the replay store is closed")
            self.log.adopt(source / "payloads")  # first the bytes, then the rows that point at them
            src = sqlite3.connect(f"file:{source / 'replay.sqlite'}?mode=ro", uri=True)
            try:
                src.backup(self._db)
            finally:
                src.close()
            self._db.execute("PRAGMA journal_mode=WAL")
            self._migrate()
            self._load()
            self._cond.notify_all()
            return {name: t.items.n for name, t in self.tables.items()}

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            if self._deferred or self._dirty:
                self._transaction(lambda: None, [], reload=False)
            self._closed = True
            self._cond.notify_all()
            self._db.close()
            self.log.close()


def _priority_field(group_field: str) -> str:
    """Where a group's priority sits in the request: ``x.group`` -> ``x.priority``,
    ``x.groups[j]`` -> ``x.priorities[j]``, ``groups[j]`` -> ``groups[j].priority``."""
    if group_field.endswith(".group"):
        return group_field.removesuffix(".group") + ".priority"
    m = re.fullmatch(r"(.+)\.groups\[(\d+)\]", group_field)
    return f"{m[1]}.priorities[{m[2]}]" if m else f"{group_field}.priority"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = ["ReplayStore", "InsertResult", "SampleResult", "Prepared", "TableConfig", "validate_group",
           "validate_priority", "InvalidArgument"]
