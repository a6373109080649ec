"""The in-sandbox agent: init process (pid 1, root) of one gVisor sandbox.

Standard library only: it runs under the sandbox's Python (the host's ``/usr`` bound read-only),
copied to ``/grader`` by the host. The host imports this module too, for the frame
format (``read_frame`` / ``write_frame``), so both ends share one definition.

Protocol on the agent's stdin/stdout (the ``runsc run`` pipes; nothing else in the sandbox holds
them): frames of ``!I`` header length, a JSON header, then the blobs whose sizes the header lists
in ``blob_sizes``. The agent first says ``{"op": "ready"}``, then answers each request:

- ``prepare`` (blobs: file contents): replace ``/stash`` (root-only) with these files.
- ``warm`` (no blobs): start ``command`` now as ``uid`` with fds 3/4 (a harness, which blocks
  reading its control pipe) and keep it for the next run with the same command; again after a
  run whose header says ``more_runs``. It holds nothing of any request until a run hands it one.
- ``run`` (blobs: stdin, control): reset ``/work`` and ``/tmp`` from ``/stash``, run ``command``
  as the unprivileged ``uid`` under ``limits``, answer with the facts (exit status, signal, times,
  peak RSS, why it was killed) and blobs stdout, stderr, report. ``stash_after`` copies ``/work``
  back to ``/stash`` when the command exits 0 (compile once, run many).

The agent never judges: verdicts are the host's. Before answering it kills every process of the
run (``kill(-1)`` from pid 1 reaches all of them) and reaps them, so nothing outlives a run.
EOF on stdin ends the agent, and with it the sandbox.

The program sees fd 0/1/2 only, plus — when the request carries a ``control`` blob (a harness) —
fd 3 (the control bytes, then EOF) and fd 4 (the report pipe, read by the agent).
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import resource
import selectors
import shutil
import signal
import struct
import sys
import time

_LEN = struct.Struct("!I")
MAX_HEADER_BYTES = 1 << 20
WORK = "/work"
TMP = "/tmp"
STASH = "/stash"
CHUNK = 1 << 16
REPORT_LIMIT = 4096


# -- framing (shared with the host) ---------------------------------------------------------------
def _read_exact(read, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        chunk = read(n - got)
        if not chunk:
            raise EOFError(f"stream ended after {got} of {n} bytes")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def read_frame(read) -> tuple[dict, list[bytes]]:
    """One frame from ``read(n)`` (a function returning up to n bytes, b"" at EOF)."""
    (size,) = _LEN.unpack(_read_exact(read, _LEN.size))
    if size > MAX_HEADER_BYTES:
        raise ValueError(f"frame header of {size} bytes")
    header = json.loads(_read_exact(read, size))
    blobs = [_read_exact(read, n) for n in header.get("blob_sizes", [])]
    return header, blobs


def encode_frame(header: dict, blobs: list[bytes] = ()) -> bytes:
    body = json.dumps({**header, "blob_sizes": [len(b) for b in blobs]}).encode()
    return b"".join([_LEN.pack(len(body)), body, *blobs])


def write_frame(write, header: dict, blobs: list[bytes] = ()) -> None:
    data = memoryview(encode_frame(header, blobs))
    while data:
        n = write(data)
        data = data[n if n is not None else len(data):]


# -- workdir ----------------------------------------------------------------------------------------
def _clear(directory: str) -> None:
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def _chown_tree(root: str, uid: int) -> None:
    os.chown(root, uid, uid)
    for base, dirs, files in os.walk(root):
        for name in dirs + files:
            os.chown(os.path.join(base, name), uid, uid, follow_symlinks=False)


def prepare(files: list[dict], blobs: list[bytes]) -> None:
    _clear(STASH)
    for spec, content in zip(files, blobs):
        path = os.path.join(STASH, spec["path"])
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(content)
        os.chmod(path, 0o755 if spec.get("executable") else 0o644)


def reset_workdir(uid: int) -> None:
    _clear(WORK)
    _clear(TMP)
    shutil.copytree(STASH, WORK, symlinks=True, dirs_exist_ok=True)
    _chown_tree(WORK, uid)
    os.chmod(WORK, 0o755)


def stash_workdir() -> None:
    _clear(STASH)
    shutil.copytree(WORK, STASH, symlinks=True, dirs_exist_ok=True)


# -- one run ----------------------------------------------------------------------------------------
def _kill_all(timeout: float = 10.0) -> None:
    """SIGKILL every process but ourselves (pid 1 is exempt from kill(-1)) and reap them all.

    kill(-1) is repeated until no child is left: a fork in flight can outlive one round.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            return  # no child left: nothing of the run survives
        if time.monotonic() > deadline:
            raise RuntimeError("processes of the run survive kill(-1)")
        time.sleep(0.002)


def _set_limits(limits: dict, pid: int = 0) -> None:
    """The run's rlimits, on ourselves (a child about to exec) or on a pre-started child."""
    cpu = max(1, math.ceil(limits["cpu_seconds"]))
    nproc = limits["max_processes"]
    for which, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_NPROC, (nproc, nproc)),
                         (resource.RLIMIT_CORE, (0, 0))):
        resource.prlimit(pid, which, value)


def _child(command: list[str], env: dict, limits: dict | None, uid: int, fds: dict[int, int]) -> None:
    """In the forked child: wire fds, drop privileges, set limits, exec. Never returns."""
    try:
        os.setsid()
        high = {target: fcntl.fcntl(source, fcntl.F_DUPFD, 64) for target, source in fds.items()}
        for target, source in high.items():
            os.dup2(source, target)  # inheritable; every other fd of ours is close-on-exec (PEP 446)
        for name in os.listdir("/proc/self/fd"):
            if int(name) >= len(fds):
                try:
                    os.close(int(name))
                except OSError:
                    pass
        os.chdir(WORK)
        if limits is not None:
            _set_limits(limits)
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        os.umask(0o022)
        os.execvpe(command[0], command, env)
    except BaseException as e:  # noqa: BLE001 - report and leave the child with 127, like a shell
        try:
            os.write(2, f"sandbox: cannot run {command[0]!r}: {e}\n".encode())
        finally:
            os._exit(127)


class _Child:
    """A started program: its pid and our ends of its pipes (control/report only with a harness)."""

    def __init__(self, command: list[str], env: dict, uid: int, limits: dict | None, harness: bool):
        self.key = (command, env, uid)
        ends = {name: os.pipe() for name in ("stdin", "stdout", "stderr", *(("control", "report") if harness else ()))}
        fds = {0: ends["stdin"][0], 1: ends["stdout"][1], 2: ends["stderr"][1]}
        if harness:
            fds.update({3: ends["control"][0], 4: ends["report"][1]})
        self.pid = os.fork()
        if self.pid == 0:
            _child(command, env, limits, uid, fds)
        for fd in fds.values():
            os.close(fd)
        self.stdin, self.stdout, self.stderr = ends["stdin"][1], ends["stdout"][0], ends["stderr"][0]
        self.control = ends["control"][1] if harness else None
        self.report = ends["report"][0] if harness else None

    def discard(self) -> None:
        for fd in (self.stdin, self.stdout, self.stderr, self.control, self.report):
            if fd is not None:
                os.close(fd)
        _kill_all()


class _Pipes:
    """The run's pipes on the agent's side: feeds stdin/control, collects capped outputs."""

    def __init__(self, sel: selectors.BaseSelector, caps: dict[str, int]):
        self.sel = sel
        self.caps = caps
        self.out = {name: bytearray() for name in caps}
        self.total = {name: 0 for name in caps}
        self.readers: dict[int, str] = {}
        self.writers: dict[int, memoryview] = {}

    def add_reader(self, fd: int, name: str) -> None:
        self.readers[fd] = name
        self.sel.register(fd, selectors.EVENT_READ)

    def add_writer(self, fd: int, data: bytes) -> None:
        if not data:
            os.close(fd)
            return
        os.set_blocking(fd, False)
        self.writers[fd] = memoryview(data)
        self.sel.register(fd, selectors.EVENT_WRITE)

    def _drop(self, fd: int, table: dict) -> None:
        self.sel.unregister(fd)
        os.close(fd)
        del table[fd]

    def write_some(self, fd: int) -> None:
        try:
            n = os.write(fd, self.writers[fd][:CHUNK])
        except BlockingIOError:
            return
        except (BrokenPipeError, ConnectionResetError):  # the program closed its end: fine
            self._drop(fd, self.writers)
            return
        self.writers[fd] = self.writers[fd][n:]
        if not self.writers[fd]:
            self._drop(fd, self.writers)

    def read_some(self, fd: int) -> None:
        try:
            data = os.read(fd, CHUNK)
        except BlockingIOError:
            return
        if not data:
            self._drop(fd, self.readers)
            return
        name = self.readers[fd]
        self.total[name] += len(data)
        room = self.caps[name] - len(self.out[name])
        if room > 0:
            self.out[name] += data[:room]

    def finish(self) -> None:
        """Once every writer process is dead: take what is left in the pipes, close everything."""
        for fd in list(self.writers):
            self._drop(fd, self.writers)
        for fd in list(self.readers):
            os.set_blocking(fd, True)
            while fd in self.readers:
                self.read_some(fd)


class Agent:
    """Runs the host's requests; keeps one pre-started child (``warm``) when asked to.

    A pre-started child is the warm command already exec'ed as the unprivileged uid and blocked
    reading its control pipe (an interpreter past its start-up): a run with that command takes
    it, gets its rlimits applied from outside (prlimit) before the control bytes go in, and so
    skips the start-up. It holds nothing of any request until then.
    """

    def __init__(self, wakeup_r: int):
        self.wakeup_r = wakeup_r
        self.warm_spec: tuple[list[str], dict, int] | None = None
        self.warm: _Child | None = None

    def set_warm(self, header: dict) -> None:
        self.warm_spec = (header["command"], header["env"], header["uid"])
        self.start_warm()

    def start_warm(self) -> None:
        if self.warm_spec is not None and self.warm is None:
            self.warm = _Child(*self.warm_spec, limits=None, harness=True)

    def run(self, header: dict, stdin: bytes, control: bytes) -> tuple[dict, list[bytes]]:
        limits, uid = header["limits"], header["uid"]
        reset_workdir(uid)
        warm, self.warm = self.warm, None
        if warm is not None and control and warm.key == (header["command"], header["env"], uid):
            child = warm
            _set_limits(limits, child.pid)
        else:
            if warm is not None:
                warm.discard()
            child = _Child(header["command"], header["env"], uid, limits, harness=bool(control))
        result, out = self._collect(child, stdin, control, limits)
        if header.get("stash_after") and result["killed"] is None and result["exit_code"] == 0:
            stash_workdir()
        return result, out

    def _collect(self, child: _Child, stdin: bytes, control: bytes, limits: dict) -> tuple[dict, list[bytes]]:
        sel = selectors.DefaultSelector()
        sel.register(self.wakeup_r, selectors.EVENT_READ)
        pipes = _Pipes(sel, {"stdout": limits["max_output_bytes"], "stderr": limits["max_output_bytes"],
                             "report": REPORT_LIMIT})
        pipes.add_reader(child.stdout, "stdout")
        pipes.add_reader(child.stderr, "stderr")
        if child.report is not None:
            pipes.add_reader(child.report, "report")
        start = time.monotonic()  # a pre-started child starts now, when its input arrives
        pipes.add_writer(child.stdin, stdin)
        if child.control is not None:
            pipes.add_writer(child.control, control)
        killed = None
        status = rusage = None
        deadline = start + limits["wall_seconds"]
        while True:
            done, status, rusage = os.wait4(child.pid, os.WNOHANG)
            if done:
                break
            if pipes.total["stdout"] > limits["max_output_bytes"]:
                killed = "output"
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                killed = "wall"
                break
            for key, _ in sel.select(min(remaining, 1.0)):
                if key.fd == self.wakeup_r:
                    os.read(self.wakeup_r, 4096)  # SIGCHLD: loop round to wait4
                elif key.fd in pipes.writers:
                    pipes.write_some(key.fd)
                elif key.fd in pipes.readers:
                    pipes.read_some(key.fd)
        wall = time.monotonic() - start
        if killed:
            try:
                os.kill(-1, signal.SIGKILL)  # the program and all it started; its zombie waits for wait4
            except ProcessLookupError:
                pass
            _, status, rusage = os.wait4(child.pid, 0)
        _kill_all()
        pipes.finish()
        sel.close()
        result = {
            "op": "result",
            "exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else -1,
            "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0,
            "wall_seconds": wall,
            "cpu_seconds": rusage.ru_utime + rusage.ru_stime,
            "max_rss_kb": rusage.ru_maxrss,
            "killed": killed,
            "stdout_bytes": pipes.total["stdout"],
            "stderr_bytes": pipes.total["stderr"],
        }
        return result, [bytes(pipes.out["stdout"]), bytes(pipes.out["stderr"]), bytes(pipes.out["report"])]


def main() -> int:
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    wakeup_r, wakeup_w = os.pipe()
    os.set_blocking(wakeup_r, False)
    os.set_blocking(wakeup_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wakeup_w)
    for d in (STASH, WORK, TMP):
        os.makedirs(d, exist_ok=True)
    os.chmod(STASH, 0o700)
    os.chmod(TMP, 0o1777)

    def read(n):
        return os.read(0, n)

    def write(b):
        return os.write(1, b)

    agent = Agent(wakeup_r)
    write_frame(write, {"op": "ready", "pid": os.getpid()})
    while True:
        try:
            header, blobs = read_frame(read)
        except EOFError:
            return 0
        try:
            if header["op"] == "prepare":
                prepare(header["files"], blobs)
                write_frame(write, {"op": "prepared"})
            elif header["op"] == "warm":
                agent.set_warm(header)
                write_frame(write, {"op": "warmed"})
            elif header["op"] == "run":
                result, out = agent.run(header, blobs[0], blobs[1])
                write_frame(write, result, out)
                if header.get("more_runs"):
                    agent.start_warm()  # for the next run in this sandbox; after the answer, off its path
            else:
                write_frame(write, {"op": "error", "message": f"unknown op {header['op']!r}"})
        except Exception as e:  # noqa: BLE001 - the host turns this into SANDBOX_ERROR
            _kill_all()
            agent.warm = None
            write_frame(write, {"op": "error", "message": f"{type(e).__name__}: {e}"})


if __name__ == "__main__":
    sys.exit(main())
