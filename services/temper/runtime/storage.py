"""Object storage by URL: where checkpoints, replay snapshots, run reports and the final policy live
outside a pod.

A URL names a folder of a store:

  ``s3://bucket/prefix``   any S3-compatible server (AWS S3, SeaweedFS, MinIO, Ceph RGW), through s3fs.
                           Endpoint and credentials come from the standard AWS variables
                           (``AWS_ENDPOINT_URL`` or ``AWS_ENDPOINT_URL_S3``, ``AWS_ACCESS_KEY_ID``,
                           ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``), as every AWS SDK reads them.
  ``/path`` or ``file://`` the local filesystem: the embedded default, nothing to install.

``ObjectStore(url)`` checks the store before it returns: it writes, reads back and deletes a probe
object, so an unreachable server, a missing bucket or wrong credentials stop a service at start with
the URL and the reason (``StorageError``), never a silent fall back to local disk.

``Mirror`` keeps finished folders (a learner checkpoint, a replay snapshot, a run report) in a store.
Invariant: a folder's files are all uploaded before the ``latest`` pointer object names it, so a
reader that follows the pointer never sees a half-written folder (one object PUT is atomic in S3).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import fsspec
import grpc

from temper.runtime.errors import TemperError

LATEST = "latest"
PROBE = ".temper-probe"
# fail fast on an unreachable endpoint instead of botocore's long default retries
S3_CLIENT_CONFIG = {"connect_timeout": 5, "read_timeout": 60, "retries": {"max_attempts": 3, "mode": "standard"}}


class StorageError(TemperError):
    """The object store at ``url`` cannot be used; the message names the URL and the reason. A call that
    needed it (a Checkpoint RPC) answers UNAVAILABLE."""

    code = grpc.StatusCode.UNAVAILABLE

    def __init__(self, url: str, reason: str):
        super().__init__(f"object store {url}: {reason}")
        self.url = url


def _reason(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


class ObjectStore:
    """A folder of an object store (or of the local filesystem), named by ``url``."""

    def __init__(self, url: str, check: bool = True):
        if not url:
            raise StorageError(url, "empty URL (use s3://bucket/prefix or a local path)")
        protocol = fsspec.core.split_protocol(url)[0] or "file"
        self.url = url.rstrip("/")
        if protocol not in ("file", "s3"):
            raise StorageError(url, f"unsupported scheme {protocol!r} (use s3:// or a local path)")
        options = {"auto_mkdir": True} if protocol == "file" else {}
        if protocol == "s3":
            # no listing cache: another process (a restarted pod) may have written since the last look
            options = {"config_kwargs": S3_CLIENT_CONFIG, "skip_instance_cache": True, "use_listings_cache": False}
            if not fsspec.core.split_protocol(url)[1].strip("/"):
                raise StorageError(url, "no bucket named (use s3://bucket/prefix)")
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.url, **options)
        except ImportError as e:  # s3fs missing
            raise StorageError(url, f"{e}; install with: pip install 'temper[storage]'") from None
        self.local = protocol == "file"
        if check:
            self.check()

    def __repr__(self) -> str:
        return f"ObjectStore({self.url!r})"

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}" if name else self.root

    def check(self) -> None:
        """Write, read back and delete a probe object; raises StorageError naming what failed."""
        probe = self._path(PROBE)
        try:
            if self.local:
                self.fs.makedirs(self.root, exist_ok=True)
            self.fs.pipe_file(probe, b"ok")
            if self.fs.cat_file(probe) != b"ok":
                raise StorageError(self.url, "a probe object read back different bytes")
            self.fs.rm_file(probe)
        except StorageError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure here means the store is unusable
            raise StorageError(self.url, f"not writable ({_reason(e)})") from e

    # -- objects -------------------------------------------------------------------------------
    def write_bytes(self, name: str, data: bytes) -> None:
        self._call("write", name, lambda: self.fs.pipe_file(self._path(name), data))

    def read_bytes(self, name: str) -> bytes | None:
        """The object's bytes, or None if there is none."""
        try:
            return self.fs.cat_file(self._path(name))
        except FileNotFoundError:
            return None
        except Exception as e:  # noqa: BLE001
            raise StorageError(self.url, f"cannot read {name} ({_reason(e)})") from e

    def exists(self, name: str) -> bool:
        return self._call("stat", name, lambda: self.fs.exists(self._path(name)))

    def names(self) -> list[str]:
        """The names directly under this folder that hold objects (objects and sub-folders), sorted. Derived
        from the object keys: some servers (SeaweedFS) list a folder whose objects were all deleted."""
        try:
            keys = self.fs.find(self.root)
        except FileNotFoundError:
            return []
        except Exception as e:  # noqa: BLE001
            raise StorageError(self.url, f"cannot list ({_reason(e)})") from e
        prefix = self.root.rstrip("/") + "/"
        return sorted({k[len(prefix):].split("/", 1)[0] for k in keys if k.startswith(prefix)})

    def delete(self, name: str) -> None:
        self._call("delete", name, lambda: self.fs.rm(self._path(name), recursive=True))

    # -- folders -------------------------------------------------------------------------------
    def put_dir(self, local: str | Path, name: str) -> int:
        """Upload every file under ``local`` to ``name/``; returns the bytes sent."""
        local = Path(local)
        files = sorted(p for p in local.rglob("*") if p.is_file())
        for f in files:
            rel = f.relative_to(local).as_posix()
            self._call("upload", f"{name}/{rel}", lambda f=f, rel=rel: self.fs.put_file(str(f), self._path(f"{name}/{rel}")))
        return sum(f.stat().st_size for f in files)

    def get_dir(self, name: str, local: str | Path) -> Path:
        """Download ``name/`` into the folder ``local`` (created; must not exist yet). Written under a
        temporary name and renamed into place, so a crash mid-download leaves no half folder."""
        local = Path(local)
        prefix = self._path(name).rstrip("/")
        remote = [p for p in self._call("list", name, lambda: self.fs.find(prefix)) if p.startswith(prefix + "/")]
        if not remote:
            raise StorageError(self.url, f"no folder {name!r}")
        tmp = local.parent / f".{local.name}.download-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        for path in remote:
            dest = tmp / path[len(prefix) + 1:]
            dest.parent.mkdir(parents=True, exist_ok=True)
            self._call("download", path, lambda path=path, dest=dest: self.fs.get_file(path, str(dest)))
        os.replace(tmp, local)
        return local

    def _call(self, what: str, name: str, fn):
        try:
            return fn()
        except StorageError:
            raise
        except Exception as e:  # noqa: BLE001
            raise StorageError(self.url, f"{what} {name} failed ({_reason(e)})") from e


class Mirror:
    """Finished folders of a local root kept in an object store, with a ``latest`` pointer."""

    def __init__(self, store: ObjectStore):
        self.store = store

    def push(self, directory: str | Path, latest: bool = True) -> str:
        """Upload ``directory`` as ``<url>/<its name>/``, then (``latest``) point ``latest`` at it."""
        directory = Path(directory)
        self.store.put_dir(directory, directory.name)
        if latest:
            self.store.write_bytes(LATEST, directory.name.encode())
        return f"{self.store.url}/{directory.name}"

    def latest(self) -> str | None:
        """The name the ``latest`` pointer holds, or None."""
        raw = self.store.read_bytes(LATEST)
        if raw is None:
            return None
        return raw.decode().strip() or None

    def pull(self, name: str, local_root: str | Path) -> Path:
        """``<url>/<name>/`` as ``local_root/name`` (downloaded unless it is there already)."""
        target = Path(local_root) / name
        if target.is_dir() and any(target.iterdir()):
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_dir():
            target.rmdir()
        return self.store.get_dir(name, target)

    def prune(self, keep: int, prefix: str) -> list[str]:
        """Delete all but the ``keep`` newest ``prefix*`` folders (by name; never the latest)."""
        if keep <= 0:
            return []
        current = self.latest()
        names = [n for n in self.store.names() if n.startswith(prefix)]
        doomed = [n for n in names[:-keep] if n != current]
        for n in doomed:
            self.store.delete(n)
        return doomed


def mirror_from_url(url: str) -> Mirror | None:
    """A checked Mirror of ``url``, or None for "" (no object storage configured)."""
    return Mirror(ObjectStore(url)) if url else None


def main(argv: list[str] | None = None) -> int:
    """``python -m temper.runtime.storage fetch URL DIR``: download a folder (e.g. the model, by an init
    container); ``check URL``: exit 0 if the store is usable, else 1 with the reason."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m temper.runtime.storage", description=main.__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    fetch = sub.add_parser("fetch", help="download the folder URL into DIR (kept if DIR already has files)")
    fetch.add_argument("url")
    fetch.add_argument("dir")
    check = sub.add_parser("check", help="write, read and delete a probe object at URL")
    check.add_argument("url")
    args = parser.parse_args(argv)
    try:
        if args.command == "check":
            ObjectStore(args.url)
            print(f"ok: {args.url}")
            return 0
        parent, _, name = args.url.rstrip("/").rpartition("/")
        target = Path(args.dir)
        if target.is_dir() and any(target.iterdir()):
            print(f"kept: {target} already holds files")
            return 0
        store = ObjectStore(parent, check=False)
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_dir():
            target.rmdir()
        store.get_dir(name, target)
        print(f"fetched {args.url} -> {target}")
        return 0
    except StorageError as e:
        print(f"temper-storage: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
