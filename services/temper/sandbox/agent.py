"""The in-sandbox agent: init process (pid 1, root) of one gVisor sandbox.

Standard library only: it runs under the sandbox's Python (the host's ``/usr`` bound read-only),
copied to ``/grader`` by the host. The host imports this module too, for the frame
format (``read_frame`` / ``write_frame``), so both ends share one definition.

Protocol on the agent's stdin/stdout (the ``runsc run`` pipes; nothing else in the sandbox holds
them): frames of ``!I`` header length, a JSON header, then the blobs whose sizes the header lists
in ``blob_sizes``. The agent first says ``{"op": "ready"}``, then answers each request:

- ``prepare`` (blobs: file contents): replace ``/stash`` (root-only) with these files.
- ``warm`` (no blobs): start ``command`` now as ``uid`` with fds 3/4 (a harness, which blocks
  reading its control pipe; with a fork server, forked from it) and keep it for the next run
  with the same command and uid; again after a run whose header says ``more_runs`` (or, batch
  mode, ``warm_uid``: then as that uid, the next run's). It holds nothing of any request until
  a run hands it one.
- ``fork_server`` (no blobs; batch mode): start ``command`` (the harness in ``--fork-server``
  mode) as root before any request exists and wait until it says it is ready: a clean
  interpreter past its start-up that forks one process per run (see harness.py). Runs of
  ``serves`` (the harness's normal command) with a control blob are then forked from it
  instead of exec'ing a new interpreter.
- ``run`` (blobs: stdin, control): reset ``/work``, ``/tmp`` and ``/dev/shm`` from ``/stash``, run
  ``command`` as the unprivileged ``uid`` under ``limits``, answer with the facts (exit status,
  signal, times, peak RSS, why it was killed) and blobs stdout, stderr, report. ``stash_after``
  copies ``/work`` back to ``/stash`` when the command exits 0 (compile once, run many).
  ``private`` (batch mode, where programs of a group follow each other in one sandbox): the
  workdir is the uid's alone (mode 0700) and the run gets its own System V IPC namespace, so no
  IPC object of one program is visible to the next.

The agent never judges: verdicts are the host's. Before answering it kills every process of the
run (every process but itself and the fork server, which run no program code) and reaps them, so
nothing outlives a run. EOF on stdin ends the agent, and with it the sandbox.

The program sees fd 0/1/2 only, plus — when the request carries a ``control`` blob (a harness) —
fd 3 (the control bytes, then EOF) and fd 4 (the report pipe, read by the agent).
"""

from __future__ import annotations

import ctypes
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
SHM = "/dev/shm"
STASH = "/stash"
CLONE_NEWIPC = 0x08000000
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


def reset_workdir(uid: int, private: bool = False) -> None:
    for d in (WORK, TMP, SHM):
        if os.path.isdir(d):
            _clear(d)
    shutil.copytree(STASH, WORK, symlinks=True, dirs_exist_ok=True)
    _chown_tree(WORK, uid)
    os.chmod(WORK, 0o700 if private else 0o755)


def stash_workdir() -> None:
    _clear(STASH)
    shutil.copytree(WORK, STASH, symlinks=True, dirs_exist_ok=True)


# -- one run ----------------------------------------------------------------------------------------
def _kill_all(keep: int = 0, timeout: float = 10.0) -> None:
    """SIGKILL every process but ourselves (pid 1) and ``keep`` (the fork server), and reap them all.

    Without a fork server kill(-1) reaches all of them; with one, every other pid in /proc is
    killed by pid. Either is repeated until no other process is left: a fork in flight can
    outlive one round. Orphans of a run are re-parented to us (pid 1), so we reap them.
    """
    deadline = time.monotonic() + timeout
    while True:
        if keep:
            others = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, keep)]
            for pid in others:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        else:
            try:
                os.kill(-1, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            while (pid := os.waitpid(-1, os.WNOHANG)[0]):
                if pid == keep:
                    raise RuntimeError("the fork server died")
        except ChildProcessError:
            return  # no child left: nothing of the run survives
        if keep and not others:
            return  # only the fork server is left
        if time.monotonic() > deadline:
            raise RuntimeError("processes of the run survive SIGKILL")
        time.sleep(0.002)


def _set_limits(limits: dict, pid: int = 0) -> None:
    """The run's rlimits, on ourselves (a child about to exec) or on a pre-started child."""
    cpu = max(1, math.ceil(limits["cpu_seconds"]))
    nproc = limits["max_processes"]
    for which, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_NPROC, (nproc, nproc)),
                         (resource.RLIMIT_CORE, (0, 0))):
        resource.prlimit(pid, which, value)


def become(uid: int, limits: dict | None, fds: dict[int, int], private: bool) -> None:
    """In a freshly forked child (of the agent or of the fork server): own session, fds 0..n-1
    from ``fds`` and no other, cwd the workdir, the run's rlimits, with ``private`` its own IPC
    namespace, then the unprivileged ``uid`` without capabilities."""
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
    if private and ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWIPC) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWIPC) failed")
    if limits is not None:
        _set_limits(limits)
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)  # a non-root uid: every capability is gone
    os.umask(0o022)


def _child(command: list[str], env: dict, limits: dict | None, uid: int, fds: dict[int, int],
           private: bool = False) -> None:
    """In the forked child: set up (``become``), exec. Never returns."""
    try:
        become(uid, limits, fds, private)
        os.execvpe(command[0], command, env)
    except BaseException as e:  # noqa: BLE001 - report and leave the child with 127, like a shell
        try:
            os.write(2, f"sandbox: cannot run {command[0]!r}: {e}\n".encode())
        finally:
            os._exit(127)


class _Child:
    """A started program: its pid and our ends of its pipes (control/report only with a harness).

    Forked and exec'ed by us, or (``server``) forked by the fork server and re-parented to us.
    """

    def __init__(self, command: list[str], env: dict, uid: int, limits: dict | None, harness: bool,
                 private: bool = False, server: ForkServer | None = None):
        self.key = (command, env, uid)
        ends = {name: os.pipe() for name in ("stdin", "stdout", "stderr", *(("control", "report") if harness else ()))}
        fds = {0: ends["stdin"][0], 1: ends["stdout"][1], 2: ends["stderr"][1]}
        if harness:
            fds.update({3: ends["control"][0], 4: ends["report"][1]})
        self.server = server
        if server is not None:
            try:
                self.pid = server.fork(env, uid, limits, list(fds.values()), private)
            except BaseException:
                for fd in (*fds.values(), ends["stdin"][1], ends["stdout"][0], ends["stderr"][0],
                           *((ends["control"][1], ends["report"][0]) if harness else ())):
                    os.close(fd)
                raise
        else:
            self.pid = os.fork()
            if self.pid == 0:
                _child(command, env, limits, uid, fds, private)
        for fd in fds.values():
            os.close(fd)
        self.stdin, self.stdout, self.stderr = ends["stdin"][1], ends["stdout"][0], ends["stderr"][0]
        self.control = ends["control"][1] if harness else None
        self.report = ends["report"][0] if harness else None

    def wait(self, block: bool):
        """(pid or 0, status, rusage) as ``os.wait4`` gives them."""
        if self.server is not None:
            return self.server.wait(block)
        return os.wait4(self.pid, 0 if block else os.WNOHANG)

    def discard(self, keep: int = 0) -> None:
        for fd in (self.stdin, self.stdout, self.stderr, self.control, self.report):
            if fd is not None:
                os.close(fd)
        _kill_all(keep)


class ForkServer:
    """The harness in ``--fork-server`` mode, started by us as root before any request exists.

    Per run we send it the run's set-up (env, uid, rlimits, ``private``) and its fds 0..4 over a
    Unix socket (SCM_RIGHTS); it forks once, answers the child's pid, waits for the child and
    answers its exit status and rusage. The server itself never sees a request's files, stdin
    or control bytes, and runs no program code. One run at a time.
    """

    def __init__(self, command: list[str], serves: list[str], env: dict):
        import socket

        self.serves = serves
        self.pending = 0  # the pid whose exit report is still to be read
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock = ours
        null = os.open(os.devnull, os.O_RDWR)
        self.pid = os.fork()
        if self.pid == 0:
            try:
                os.setsid()
                for target, source in ((0, null), (1, null), (3, theirs.fileno())):
                    os.dup2(source, target)
                os.chdir("/")
                os.execvpe(command[0], command, env)
            finally:
                os._exit(127)
        os.close(null)
        theirs.close()
        if self.sock.recv(16) != b"ready":
            raise RuntimeError(f"fork server {command} did not start")

    def _receive(self) -> dict:
        message = self.sock.recv(4096)
        if not message:
            raise RuntimeError("the fork server ended")
        return json.loads(message)

    def fork(self, env: dict, uid: int, limits: dict | None, fds: list[int], private: bool) -> int:
        import socket

        if self.pending:
            self.wait(block=True)
        spec = json.dumps({"env": env, "uid": uid, "limits": limits, "private": private,
                           "argv": self.serves[1:]}).encode()
        socket.send_fds(self.sock, [spec], fds)
        answer = self._receive()
        if not answer.get("pid"):
            raise RuntimeError(f"fork server could not start the run: {answer.get('error', answer)}")
        self.pending = answer["pid"]
        return self.pending

    def wait(self, block: bool) -> tuple[int, int, resource.struct_rusage | None]:
        """Like ``os.wait4(pending, 0 or WNOHANG)``, from the server's exit report."""
        if not block:
            self.sock.setblocking(False)
        try:
            answer = self._receive()
        except BlockingIOError:
            return 0, 0, None
        finally:
            self.sock.setblocking(True)
        self.pending = 0
        usage = resource.struct_rusage((answer["utime"], answer["stime"], answer["maxrss"]) + (0,) * 13)
        return answer["exited"], answer["status"], usage


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
        self.server: ForkServer | None = None

    @property
    def keep(self) -> int:
        """The pid that outlives every run: the fork server's (0: none)."""
        return self.server.pid if self.server is not None else 0

    def start_fork_server(self, header: dict) -> None:
        self.server = ForkServer(header["command"], header["serves"], header["env"])

    def set_warm(self, header: dict) -> None:
        self.warm_spec = (header["command"], header["env"], header["uid"])
        self.start_warm()

    def start_warm(self, uid: int | None = None) -> None:
        """Pre-start the warm command (as ``uid``, default the warm uid); with a fork server, as its fork."""
        if self.warm_spec is not None and self.warm is None:
            command, env, warm_uid = self.warm_spec
            self.warm = _Child(command, env, warm_uid if uid is None else uid, limits=None, harness=True,
                               private=self.server is not None, server=self.server)

    def run(self, header: dict, stdin: bytes, control: bytes) -> tuple[dict, list[bytes]]:
        limits, uid, private = header["limits"], header["uid"], bool(header.get("private"))
        reset_workdir(uid, private)
        warm, self.warm = self.warm, None
        if warm is not None and control and warm.key == (header["command"], header["env"], uid):
            child = warm
            _set_limits(limits, child.pid)
        else:
            if warm is not None:
                warm.discard(self.keep)
            server = self.server if control and self.server and header["command"] == self.server.serves else None
            child = _Child(header["command"], header["env"], uid, limits, harness=bool(control), private=private,
                           server=server)
        result, out = self._collect(child, stdin, control, limits)
        if header.get("stash_after") and result["killed"] is None and result["exit_code"] == 0:
            stash_workdir()
        return result, out

    def _collect(self, child: _Child, stdin: bytes, control: bytes, limits: dict) -> tuple[dict, list[bytes]]:
        sel = selectors.DefaultSelector()
        sel.register(self.wakeup_r, selectors.EVENT_READ)
        pipes = _Pipes(sel, {"stdout": limits["max_output_bytes"], "stderr": limits["max_output_bytes"],
                             "report": REPORT_LIMIT})
        if child.server is not None:
            sel.register(child.server.sock, selectors.EVENT_READ)  # its exit report
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
            done, status, rusage = child.wait(block=False)
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
                elif child.server is not None and key.fd == child.server.sock.fileno():
                    pass  # the exit report: read at the top of the loop
                elif key.fd in pipes.writers:
                    pipes.write_some(key.fd)
                elif key.fd in pipes.readers:
                    pipes.read_some(key.fd)
        wall = time.monotonic() - start
        if killed:
            if self.keep:
                os.kill(child.pid, signal.SIGKILL)  # the rest follows in _kill_all
            else:
                try:
                    os.kill(-1, signal.SIGKILL)  # the program and all it started; its zombie waits for wait4
                except ProcessLookupError:
                    pass
            _, status, rusage = child.wait(block=True)
        _kill_all(self.keep)
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
            elif header["op"] == "fork_server":
                agent.start_fork_server(header)
                write_frame(write, {"op": "forking", "pid": agent.server.pid})
            elif header["op"] == "run":
                result, out = agent.run(header, blobs[0], blobs[1])
                write_frame(write, result, out)
                # for the next run in this sandbox; after the answer, off its path
                if header.get("warm_uid") is not None:
                    agent.start_warm(header["warm_uid"])  # batch mode: the next run's uid, as the host expects it
                elif header.get("more_runs") and agent.server is None:
                    agent.start_warm()
            else:
                write_frame(write, {"op": "error", "message": f"unknown op {header['op']!r}"})
        except Exception as e:  # noqa: BLE001 - the host turns this into SANDBOX_ERROR
            _kill_all(agent.keep)
            agent.warm = None
            write_frame(write, {"op": "error", "message": f"{type(e).__name__}: {e}"})


if __name__ == "__main__":
    sys.exit(main())
