"""One way to open a service's local SQLite state."""

from __future__ import annotations

import sqlite3
from pathlib import Path


def open_sqlite(path: str | Path, durable: bool = True) -> sqlite3.Connection:
    """A service's local SQLite state (replay, scheduler, monitor): autocommit (callers open their own
    transactions), shared across threads (callers hold their own lock), WAL; ``durable``: synchronous=FULL, so a
    commit is on disk when it returns (a Kafka offset may be committed after it), else NORMAL."""
    db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
    return db
