"""Append-only segment files holding the groups' serialized bytes; SQLite rows point into them.

Why not blobs in SQLite: a 56 KB group written as a blob costs two copies (WAL, then the
database) and freeing it rewrites overflow-page chains; an append plus one ``fdatasync`` per
insert batch is several times cheaper, and removing a group is then a metadata update only.

Rules that make it crash-safe:
- a segment only ever grows by appending; it is deleted whole, never rewritten;
- ``sync()`` (fdatasync) runs before the SQLite transaction that references the new bytes
  commits, so a committed row never points at bytes that are not on disk; a crash in between
  leaves unreferenced bytes, which nothing reads;
- a segment is unlinked only after the commit that removed its last reference; segments left
  behind by a crash are found unreferenced and deleted at start-up (``collect``).
Segment names are unique over time (time + random suffix), so a checkpoint's segments can be
linked back next to newer ones on restore without clashing.
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from pathlib import Path

SEGMENT_BYTES = 64 << 20
IOV_MAX = 1024  # buffers per writev (Linux's limit)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class PayloadLog:
    def __init__(self, directory: str | Path, segment_bytes: int = SEGMENT_BYTES, fsync: bool = True):
        self.dir = Path(directory)
        self.fsync = fsync  # False: durable against a process crash only (the OS page cache keeps the bytes)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.segment_bytes = segment_bytes
        self.live: dict[str, int] = {}  # segment -> bytes referenced by stored groups
        self.active = ""
        self._fd = -1
        self._size = 0
        self._unsynced = False
        self._new_file = False

    # -- writing ---------------------------------------------------------------------------------
    def _roll(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
        self.active = f"seg-{time.time_ns():020d}-{secrets.token_hex(4)}"
        self._fd = os.open(self.dir / self.active, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._size = 0
        self._new_file = True

    def append(self, payload: bytes) -> tuple[str, int]:
        """Write ``payload`` at the end of the active segment; returns (segment, offset). Not yet durable."""
        if self._fd < 0 or (self._size and self._size + len(payload) > self.segment_bytes):
            self._roll()
        offset = self._size
        view = memoryview(payload)
        while view:
            view = view[os.write(self._fd, view):]
        self._size += len(payload)
        self._unsynced = True
        self.live[self.active] = self.live.get(self.active, 0) + len(payload)
        return self.active, offset

    def append_many(self, payloads: list[bytes | memoryview]) -> list[tuple[str, int]]:
        """``append`` for a batch: one ``writev`` per segment instead of a write per payload."""
        out: list[tuple[str, int]] = []
        i = 0
        while i < len(payloads):
            if self._fd < 0 or (self._size and self._size + len(payloads[i]) > self.segment_bytes):
                self._roll()
            j, size = i, self._size
            while j < len(payloads) and (j == i or size + len(payloads[j]) <= self.segment_bytes) and j - i < IOV_MAX:
                out.append((self.active, size))
                size += len(payloads[j])
                j += 1
            self._writev(payloads[i:j], size - self._size)
            self.live[self.active] = self.live.get(self.active, 0) + size - self._size
            self._size = size
            self._unsynced = True
            i = j
        return out

    def _writev(self, buffers: list, total: int) -> None:
        written = os.writev(self._fd, buffers)
        if written == total:
            return
        rest = memoryview(b"".join(buffers))[written:]  # a short write (rare): finish byte by byte
        while rest:
            rest = rest[os.write(self._fd, rest):]

    def sync(self) -> None:
        """Make every appended byte durable (call before committing rows that point at them)."""
        if not self.fsync:
            return
        if self._unsynced:
            os.fdatasync(self._fd)
            self._unsynced = False
        if self._new_file:
            _fsync_dir(self.dir)
            self._new_file = False

    # -- reading ---------------------------------------------------------------------------------
    def reader(self, segment: str):
        """A function (offset, length) -> bytes over one segment (opened once)."""
        path = self.dir / segment
        if not path.is_file():
            raise FileNotFoundError(f"replay payload segment {path} is missing: the store is damaged")
        data = path.read_bytes()

        def read(offset: int, length: int) -> bytes:
            if offset + length > len(data):
                raise ValueError(f"replay payload segment {path} is {len(data)} bytes, a stored group "
                                 f"needs [{offset}, {offset + length}): the store is damaged")
            return data[offset:offset + length]

        return read

    # -- accounting and garbage ------------------------------------------------------------------
    def reference(self, segment: str, length: int) -> None:
        self.live[segment] = self.live.get(segment, 0) + length

    def release(self, segment: str, length: int) -> None:
        self.live[segment] -= length

    def collect(self, pinned: set[str] = frozenset()) -> list[str]:
        """Delete every segment no stored group references (call after the commit); returns them."""
        gone = []
        for path in self.dir.iterdir():
            name = path.name
            if name.startswith("seg-") and name != self.active and name not in pinned and self.live.get(name, 0) <= 0:
                path.unlink(missing_ok=True)
                self.live.pop(name, None)
                gone.append(name)
        return gone

    def sparse(self, min_fill: float = 0.25) -> list[str]:
        """Sealed segments whose referenced bytes are under ``min_fill`` of their size (worth compacting)."""
        out = []
        for name, live in self.live.items():
            if name != self.active and live > 0:
                size = (self.dir / name).stat().st_size
                if live < min_fill * size:
                    out.append(name)
        return out

    # -- checkpoints -----------------------------------------------------------------------------
    def export(self, segments: set[str], dest: Path) -> None:
        """Put ``segments`` in ``dest``: hard links for sealed ones, a copy of the active one."""
        dest.mkdir(parents=True, exist_ok=True)
        for name in segments:
            src = self.dir / name
            if name != self.active:
                try:
                    os.link(src, dest / name)
                    continue
                except OSError:
                    pass
            shutil.copyfile(src, dest / name)
        _fsync_dir(dest)

    def adopt(self, source: Path) -> None:
        """Make every segment of ``source`` (a checkpoint's) available here, keeping any we already
        have (same name: ours is the same bytes, maybe with more appended)."""
        for path in source.iterdir():
            if path.name.startswith("seg-") and not (self.dir / path.name).exists():
                try:
                    os.link(path, self.dir / path.name)
                except OSError:
                    shutil.copyfile(path, self.dir / path.name)
        _fsync_dir(self.dir)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
