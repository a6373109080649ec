"""gVisor backend: ``runsc run`` sandboxes booted ahead of time into a warm pool.

Isolated mode (the default): one sandbox per call. A pooled sandbox waits with its agent up and,
for the warm language (Python), the harness's interpreter already started as the program's uid
and blocked before reading anything: a call then pays for file transfer and the program's own
run, not for booting gVisor or Python.

Batch mode: one sandbox per group of programs (a RunTestsBatch call), which run one after the
other, program i as uid ``batch_uid_base + i`` with a private workdir (0700) and its own IPC
namespace; between programs every process is killed and /work, /tmp, /dev/shm are wiped. A
pooled batch sandbox holds the warm language's harness as a fork server (root, clean, started
before any request): each Python run is a fork of it, not a new interpreter.

Isolation of one sandbox (an OCI bundle run by runsc on the ptrace platform):
- its own gVisor kernel: the program's system calls never reach the host kernel directly;
- no network (``--network=none``: loopback only, no DNS, nothing outside);
- a read-only root made of an empty skeleton, the host's ``/usr`` (and whatever ``binds`` adds)
  bound read-only, a minimal ``/etc`` of our own, and ``/grader`` (agent + harness) read-only;
  no host path with data on it (home directories, /tmp, /etc, the service's state) is visible;
- fresh tmpfs mounts for ``/work`` (the workdir), ``/tmp`` and ``/stash`` (root-only), gone
  when the sandbox ends;
- the program runs as an unprivileged uid without capabilities (the agent, pid 1, is root
  inside the sandbox and keeps only what it needs to drop to that uid and clean up);
- limits: wall time (agent, with a host-side backstop), CPU time and process count (rlimits),
  output bytes (agent), memory (a host cgroup around the whole sandbox, lowered before each run
  to what the sandbox already uses plus the run's limit; crossing it kills the sandbox), CPU
  share (cgroup quota).

The cgroups are this service's own (cgroup v1, under the service's cgroup): runsc runs with
``--ignore-cgroups`` and is started inside them, so every process it creates is accounted,
limited and, at the end, killed by pid from ``cgroup.procs``.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from temper.runtime.logs import get_logger
from temper.sandbox import agent
from temper.sandbox.core import MiB, Limits, RunFacts, SandboxUnavailable, SourceFile

CGROUP_ROOT = Path("/sys/fs/cgroup")
GRADER_FILES = ("agent.py", "harness.py")
# what the agent needs to drop to the program's uid, set its rlimits (prlimit) and clean up
AGENT_CAPS = ["CAP_SETUID", "CAP_SETGID", "CAP_KILL", "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_SYS_RESOURCE"]
INSTALL_HINT = "install it with `apt-get install runsc` (or `make system-deps`)"

_log = get_logger(component="sandbox.runsc")


@dataclass(frozen=True)
class RunscSettings:
    runsc: str = "runsc"
    platform: str = "ptrace"
    extra_flags: tuple[str, ...] = ()
    python: str = ""  # the sandbox's Python for the agent; "" = first of /usr/bin/python3, /usr/local/bin/python3
    binds: tuple[str, ...] = ("/usr",)  # host directories bound read-only at the same path
    state_dir: str = ".temper/data/sandbox"
    workdir_mb: int = 256  # size of the /work and /tmp tmpfs
    cpus: float = 1.0  # CPU quota of one sandbox, in cores
    memory_slack_mb: int = 32  # headroom over the run's limit for the sandbox's own growth
    boot_memory_mb: int = 4096  # cgroup limit while booting and between runs
    boot_timeout_seconds: float = 30.0
    # host backstop beyond the run's wall limit: above the agent's own clean-up bound (agent._kill_all,
    # 10 s) with room for a loaded host, so a run the agent still judges is never cut off as SANDBOX_ERROR
    answer_grace_seconds: float = 30.0
    uid: int = 65534
    warm_command: tuple[str, ...] = ()  # pre-started in every sandbox, blocked on its control pipe
    warm_env: Mapping[str, str] = field(default_factory=dict)
    batch: bool = False  # batch mode: programs of a group share a sandbox (see the module doc)
    batch_uid_base: int = 10000  # program i of a group runs as this + i
    max_batch_programs: int = 64
    fork_server: tuple[str, ...] = ()  # batch mode: started as root at boot; forks the runs of warm_command


def check_host(settings: RunscSettings) -> str:
    """The runsc binary's path; a clear error if this host cannot run sandboxes."""
    path = shutil.which(settings.runsc)
    if path is None:
        raise RuntimeError(f"gVisor's runsc was not found (looked for {settings.runsc!r} on PATH); {INSTALL_HINT}")
    if os.geteuid() != 0:
        raise RuntimeError("the sandbox service must run as root: runsc (gVisor) and its cgroups need it")
    if not (CGROUP_ROOT / "memory" / "memory.limit_in_bytes").exists():
        raise RuntimeError("the sandbox service needs the cgroup v1 memory controller at /sys/fs/cgroup/memory "
                           "(cgroup v2-only hosts are not supported yet)")
    return path


def _sandbox_python(settings: RunscSettings) -> str:
    if settings.python:
        return settings.python
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(candidate):
            return candidate
    raise RuntimeError("no python3 under /usr for the sandbox's agent; set [sandbox] python")


# -- rootfs and bundle ------------------------------------------------------------------------------
def build_rootfs(state_dir: Path, binds: tuple[str, ...], batch_uids: range = range(0)) -> tuple[Path, Path]:
    """An empty read-only skeleton (mount points, /etc of our own) and the grader directory."""
    rootfs = state_dir / "rootfs"
    for d in ("proc", "dev", "etc", "work", "tmp", "stash", "grader", *[b.lstrip("/") for b in binds]):
        (rootfs / d).mkdir(parents=True, exist_ok=True)
    for link, target in (("bin", "usr/bin"), ("lib", "usr/lib"), ("lib64", "usr/lib64"), ("sbin", "usr/sbin")):
        if not (rootfs / link).is_symlink() and os.path.exists(f"/{target}"):
            (rootfs / link).symlink_to(target)
    etc = rootfs / "etc"
    (etc / "passwd").write_text("root:x:0:0:root:/root:/usr/sbin/nologin\n"
                                "nobody:x:65534:65534:nobody:/work:/usr/sbin/nologin\n"
                                + "".join(f"p{u}:x:{u}:{u}::/work:/usr/sbin/nologin\n" for u in batch_uids))
    (etc / "group").write_text("root:x:0:\nnogroup:x:65534:\n" + "".join(f"p{u}:x:{u}:\n" for u in batch_uids))
    (etc / "hosts").write_text("127.0.0.1 localhost\n::1 localhost\n")
    if os.path.exists("/etc/ld.so.cache"):
        shutil.copyfile("/etc/ld.so.cache", etc / "ld.so.cache")
    grader = state_dir / "grader"
    grader.mkdir(parents=True, exist_ok=True)
    here = Path(__file__).parent
    for name in GRADER_FILES:
        target = grader / name
        target.unlink(missing_ok=True)
        shutil.copyfile(here / name, target)
        target.chmod(0o444)
    grader.chmod(0o555)
    return rootfs, grader


def oci_spec(rootfs: Path, grader: Path, settings: RunscSettings, python: str) -> dict:
    tmpfs = [("/work", f"mode=0755,size={settings.workdir_mb}m"), ("/tmp", f"mode=1777,size={settings.workdir_mb}m"),
             ("/stash", f"mode=0700,size={settings.workdir_mb}m")]
    return {
        "ociVersion": "1.0.0",
        "process": {
            "user": {"uid": 0, "gid": 0},
            "args": [python, "-I", "-S", "/grader/agent.py"],
            "env": ["PATH=/usr/local/bin:/usr/bin:/bin", "LANG=C.UTF-8"],
            "cwd": "/",
            # batch mode: CAP_SYS_ADMIN for each program's own IPC namespace (dropped with the uid)
            "capabilities": {k: AGENT_CAPS + (["CAP_SYS_ADMIN"] if settings.batch else [])
                             for k in ("bounding", "effective", "permitted")},
            "noNewPrivileges": True,
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}],
        },
        "root": {"path": str(rootfs), "readonly": True},
        "hostname": "sandbox",
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs"},
            *[{"destination": d, "type": "tmpfs", "source": "tmpfs", "options": o.split(",")} for d, o in tmpfs],
            *[{"destination": b, "type": "bind", "source": b, "options": ["rbind", "ro", "nosuid", "nodev"]}
              for b in settings.binds],
            {"destination": "/grader", "type": "bind", "source": str(grader), "options": ["bind", "ro", "nosuid", "nodev"]},
        ],
        "linux": {"namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")]},
    }


# -- cgroups (v1) -----------------------------------------------------------------------------------
def _own_cgroup(controller: str) -> str:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return path.lstrip("/")
    return ""


class Cgroup:
    """One sandbox's memory and cpu cgroups (v1)."""

    def __init__(self, memory: Path, cpu: Path):
        self.memory, self.cpu = memory, cpu

    def create(self, limit_bytes: int, cpus: float) -> None:
        self.memory.mkdir(parents=True)
        self.cpu.mkdir(parents=True)
        self.set_memory_limit(limit_bytes)
        period = 100_000
        (self.cpu / "cpu.cfs_period_us").write_text(str(period))
        (self.cpu / "cpu.cfs_quota_us").write_text(str(int(cpus * period)))

    @property
    def procs_files(self) -> list[Path]:
        return [self.memory / "cgroup.procs", self.cpu / "cgroup.procs"]

    def _read_int(self, name: str) -> int:
        return int((self.memory / name).read_text())

    def set_memory_limit(self, limit_bytes: int) -> None:
        (self.memory / "memory.limit_in_bytes").write_text(str(limit_bytes))

    def memory_usage(self) -> int:
        return self._read_int("memory.usage_in_bytes")

    def oom_kills(self) -> int:
        for line in (self.memory / "memory.oom_control").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return self._read_int("memory.failcnt")  # kernels without the counter

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in (self.memory / "cgroup.procs").read_text().split()]
        except FileNotFoundError:
            return []

    def kill_all(self, timeout: float = 10.0) -> None:
        """SIGKILL every process of the sandbox (runsc, gofer, sentry, stubs), until none is left."""
        deadline = time.monotonic() + timeout
        while pids := self.pids():
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes {pids} survive in {self.memory}")
            time.sleep(0.01)

    def remove(self) -> None:
        _rmdir(self.memory)
        _rmdir(self.cpu)


def _rmdir(d: Path) -> None:
    for _ in range(100):
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:  # EBUSY while the last exiting tasks are being reaped
            time.sleep(0.01)


def _pid_alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def _remove_cgroup_tree(root: Path) -> None:
    """Kill every process under ``root`` (a dead service instance's sandboxes) and remove the tree."""
    for child in sorted((d for d in root.rglob("*") if d.is_dir()), key=lambda d: len(d.parts), reverse=True):
        for pid in (child / "cgroup.procs").read_text().split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
    for d in sorted((d for d in [root, *root.rglob("*")] if d.is_dir()), key=lambda d: len(d.parts), reverse=True):
        _rmdir(d)


class CgroupTree:
    """This service instance's cgroups: ``<own cgroup>/temper-sandbox-<pid>/<sandbox id>``.

    A crashed instance's sandboxes end by themselves (their agent reads EOF once the service's
    end of the pipe is gone); what they leave, an empty tree, is removed by the next instance.
    """

    def __init__(self):
        name = f"temper-sandbox-{os.getpid()}"
        self.memory = CGROUP_ROOT / "memory" / _own_cgroup("memory") / name
        self.cpu = CGROUP_ROOT / "cpu" / _own_cgroup("cpu") / name
        for base in {self.memory.parent, self.cpu.parent}:
            for stale in base.glob("temper-sandbox-*"):
                pid = stale.name.rsplit("-", 1)[1]
                if pid.isdigit() and not _pid_alive(int(pid)):
                    _remove_cgroup_tree(stale)
        self.memory.mkdir(parents=True, exist_ok=True)
        self.cpu.mkdir(parents=True, exist_ok=True)

    def sandbox(self, sandbox_id: str) -> Cgroup:
        return Cgroup(self.memory / sandbox_id, self.cpu / sandbox_id)

    def remove(self) -> None:
        Cgroup(self.memory, self.cpu).remove()


# -- one sandbox ------------------------------------------------------------------------------------
class GVisorSandbox:
    """One booted gVisor sandbox with the agent waiting; implements ``core.Session``."""

    def __init__(self, backend: RunscBackend, sandbox_id: str):
        self.backend = backend
        self.id = sandbox_id
        self.bundle = backend.bundles / sandbox_id
        self.cgroup = backend.cgroups.sandbox(sandbox_id)
        self.proc: subprocess.Popen | None = None
        self.uid = backend.settings.uid
        self._dead = False
        self._lock = threading.Lock()

    # lifecycle
    def boot(self) -> GVisorSandbox:
        s = self.backend.settings
        self.bundle.mkdir(parents=True)
        (self.bundle / "config.json").write_text(json.dumps(self.backend.spec))
        self.cgroup.create(s.boot_memory_mb * MiB, s.cpus)
        args = [self.backend.runsc, "--root", str(self.backend.runsc_root), "--platform", s.platform,
                "--network", "none", "--ignore-cgroups", "--file-access-mounts", "exclusive", *s.extra_flags,
                "run", "--bundle", str(self.bundle), self.id]
        # enter the cgroups first, then exec runsc: everything it starts is inside them
        enter = 'for f in $TEMPER_CGROUP_PROCS; do echo $$ > "$f" || exit 97; done; exec "$@"'
        with open(self.bundle / "runsc.log", "wb") as log:
            self.proc = subprocess.Popen(
                ["/bin/sh", "-c", enter, "temper-sandbox", *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=log, start_new_session=True,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                     "TEMPER_CGROUP_PROCS": " ".join(str(p) for p in self.cgroup.procs_files)})
        try:
            header, _ = self._exchange(None, s.boot_timeout_seconds)
            if header.get("op") != "ready":
                raise RuntimeError(f"unexpected first frame {header}")
            if s.batch and s.fork_server:
                start = {"op": "fork_server", "command": list(s.fork_server), "serves": list(s.warm_command),
                         "env": {**self.backend.base_env, **s.warm_env}}
                header, _ = self._exchange((start, []), s.boot_timeout_seconds)
                if header.get("op") != "forking":
                    raise RuntimeError(f"agent could not start the fork server {s.fork_server}: {header}")
            if s.warm_command and (s.fork_server or not s.batch):
                # batch mode: the group's first program (uid batch_uid_base) pre-forked from the fork server
                warm = {"op": "warm", "command": list(s.warm_command), "env": {**self.backend.base_env, **s.warm_env},
                        "uid": s.batch_uid_base if s.batch else s.uid}
                header, _ = self._exchange((warm, []), s.boot_timeout_seconds)
                if header.get("op") != "warmed":
                    raise RuntimeError(f"agent could not pre-start {s.warm_command}: {header}")
        except Exception as e:
            log_tail = self._log_tail()
            self.close()
            raise SandboxUnavailable(f"sandbox failed to boot: {e}; runsc said: {log_tail}") from e
        return self

    @property
    def alive(self) -> bool:
        return not self._dead and self.proc is not None and self.proc.poll() is None

    def close(self) -> None:
        """End the sandbox (EOF to the agent, then SIGKILL of whatever is left) and remove its traces."""
        with self._lock:
            if self.proc is not None:
                try:
                    self.proc.stdin.close()
                    self.proc.wait(timeout=2)
                except (OSError, subprocess.TimeoutExpired):
                    pass
            self._dead = True
            try:
                self.cgroup.kill_all()
            finally:
                if self.proc is not None:
                    self.proc.wait()
                    self.proc.stdout.close()
                self.cgroup.remove()
                for f in self.backend.runsc_root.glob(f"{self.id}_sandbox:*"):
                    f.unlink(missing_ok=True)
                shutil.rmtree(self.bundle, ignore_errors=True)

    def _kill(self) -> None:
        self._dead = True
        try:
            self.cgroup.kill_all()
        except (OSError, RuntimeError):
            _log.exception("could not kill sandbox", sandbox=self.id)

    def _log_tail(self, limit: int = 2000) -> str:
        try:
            return (self.bundle / "runsc.log").read_bytes()[-limit:].decode(errors="replace").strip() or "(nothing)"
        except OSError:
            return "(no log)"

    # the agent protocol
    def _exchange(self, request: tuple[dict, list[bytes]] | None, timeout: float) -> tuple[dict, list[bytes]]:
        """Send one frame (if any) and read the answer; the sandbox is killed if none comes in time."""
        fired = threading.Event()

        def expire():
            fired.set()
            self._kill()

        watchdog = threading.Timer(timeout, expire)
        watchdog.daemon = True
        watchdog.start()
        try:
            if request is not None:
                self.proc.stdin.write(agent.encode_frame(*request))
                self.proc.stdin.flush()
            return agent.read_frame(self.proc.stdout.read)
        except (OSError, EOFError, ValueError) as e:
            self._dead = True
            raise _SandboxDied(str(e), timed_out=fired.is_set()) from e
        finally:
            watchdog.cancel()

    def begin(self, index: int) -> None:
        """Batch mode: the next runs are program ``index`` of the group's (its own uid)."""
        s = self.backend.settings
        if not s.batch or not 0 <= index < s.max_batch_programs:
            raise ValueError(f"program index {index} outside a batch sandbox's 0..{s.max_batch_programs - 1}")
        self.uid = s.batch_uid_base + index

    def _warm_uid(self, command: list[str], more_runs: bool) -> int | None:
        """Batch mode, after a run of the warm command: pre-fork the next run's process, as the uid
        of this program (more test cases follow) or of the group's next one. None: nothing."""
        s = self.backend.settings
        if not s.batch or not s.fork_server or tuple(command) != tuple(s.warm_command):
            return None
        uid = self.uid if more_runs else self.uid + 1
        return uid if uid < s.batch_uid_base + s.max_batch_programs else None

    def prepare(self, files: list[SourceFile]) -> None:
        header = {"op": "prepare", "files": [{"path": f.path, "executable": f.executable} for f in files]}
        try:
            answer, _ = self._exchange((header, [f.content for f in files]), self.backend.settings.boot_timeout_seconds)
        except _SandboxDied as e:
            raise SandboxUnavailable(f"sandbox died while preparing files: {e}; runsc said: {self._log_tail()}") from e
        if answer.get("op") != "prepared":
            raise SandboxUnavailable(f"agent could not prepare the files: {answer.get('message', answer)}")

    def run(self, command: list[str], env: Mapping[str, str], stdin: bytes, limits: Limits,
            control: bytes = b"", stash_after: bool = False, more_runs: bool = False) -> RunFacts:
        s = self.backend.settings
        header = {"op": "run", "command": command, "env": {**self.backend.base_env, **env}, "uid": self.uid,
                  "stash_after": stash_after, "more_runs": more_runs, "private": s.batch, "warm_uid": self._warm_uid(
                      command, more_runs),
                  "limits": {"wall_seconds": limits.wall_seconds, "cpu_seconds": limits.cpu_seconds,
                             "max_processes": limits.max_processes, "max_output_bytes": limits.max_output_bytes}}
        # the run may use its limit on top of what the sandbox holds now (agent, request bytes in flight)
        ooms = self.cgroup.oom_kills()
        self.cgroup.set_memory_limit(self.cgroup.memory_usage() + (limits.memory_mb + s.memory_slack_mb) * MiB
                                     + 2 * (len(stdin) + len(control)))
        try:
            answer, blobs = self._exchange((header, [stdin, control]), limits.wall_seconds + s.answer_grace_seconds)
        except _SandboxDied as e:
            self._kill()
            if self.cgroup.oom_kills() > ooms:
                return RunFacts(exit_code=-1, signal=signal.SIGKILL, killed="memory",
                                max_rss_bytes=limits.memory_mb * MiB)
            why = "did not answer in time" if e.timed_out else f"died ({e})"
            error = f"sandbox {why}; runsc said: {self._log_tail()}"
            _log.warning("sandbox failed during a run", sandbox=self.id, error=error)
            return RunFacts(exit_code=-1, killed="sandbox", error=error)
        finally:
            if not self._dead:
                self.cgroup.set_memory_limit(s.boot_memory_mb * MiB)
        if answer.get("op") != "result":
            # the agent could not run or clean up after the run: nothing of this sandbox is trusted again
            error = f"agent error: {answer.get('message', answer)}"
            _log.warning("sandbox agent failed during a run", sandbox=self.id, error=error)
            self._kill()
            return RunFacts(exit_code=-1, killed="sandbox", error=error)
        stdout, stderr, report = blobs
        return RunFacts(exit_code=answer["exit_code"], signal=answer["signal"], wall_seconds=answer["wall_seconds"],
                        cpu_seconds=answer["cpu_seconds"], max_rss_bytes=answer["max_rss_kb"] * 1024,
                        killed=answer["killed"], stdout=stdout, stderr=stderr, stdout_bytes=answer["stdout_bytes"],
                        stderr_bytes=answer["stderr_bytes"], report=report)


class _SandboxDied(Exception):
    def __init__(self, message: str, timed_out: bool):
        super().__init__(message)
        self.timed_out = timed_out


# -- backend and warm pool --------------------------------------------------------------------------
class RunscBackend:
    """Everything sandboxes of this service instance share: runsc, rootfs, spec, cgroup tree."""

    def __init__(self, settings: RunscSettings):
        self.settings = settings
        self.runsc = check_host(settings)
        base = Path(settings.state_dir).resolve()
        for stale in base.glob("instance-*"):  # left by an instance of this service that died
            pid = stale.name.split("-", 1)[1]
            if pid.isdigit() and not _pid_alive(int(pid)):
                shutil.rmtree(stale, ignore_errors=True)
        state = base / f"instance-{os.getpid()}"
        shutil.rmtree(state, ignore_errors=True)
        state.mkdir(parents=True)
        self.state = state
        self.bundles = state / "bundles"
        self.runsc_root = state / "runsc"
        self.bundles.mkdir()
        self.runsc_root.mkdir()
        rootfs, grader = build_rootfs(state, settings.binds, range(settings.batch_uid_base,
                                                                   settings.batch_uid_base + settings.max_batch_programs)
                                      if settings.batch else range(0))
        self.spec = oci_spec(rootfs, grader, settings, _sandbox_python(settings))
        self.base_env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/work", "TMPDIR": "/tmp",
                         "LANG": "C.UTF-8"}
        self.cgroups = CgroupTree()
        self._counter = 0
        self._lock = threading.Lock()

    def new_sandbox(self) -> GVisorSandbox:
        with self._lock:
            self._counter += 1
            sandbox_id = f"temper-{os.getpid()}-{self._counter}"
        return GVisorSandbox(self, sandbox_id).boot()

    def close(self) -> None:
        self.cgroups.remove()
        shutil.rmtree(self.state, ignore_errors=True)


class SandboxPool:
    """Keeps ``size`` booted sandboxes ready; each is used by one call (one program, or in batch
    mode one group of programs), then destroyed.

    ``size`` refill threads each own one pool slot: boot a sandbox, offer it, wait until it is
    taken, boot the next. So at most ``size`` sandboxes wait ready and at most ``size`` boot at
    once. With ``size`` 0 every acquire boots its own sandbox (cold start).
    Used sandboxes are destroyed on a background thread, off the caller's path.
    """

    def __init__(self, backend: RunscBackend, size: int, acquire_timeout: float = 60.0):
        self.backend = backend
        self.size = size
        self.acquire_timeout = acquire_timeout
        self._ready: queue.Queue[tuple[GVisorSandbox, threading.Event]] = queue.Queue()
        self._retired: queue.Queue[GVisorSandbox | None] = queue.Queue()
        self._stop = threading.Event()
        self.last_boot_error: str = ""
        self.booted = 0
        self._threads = [threading.Thread(target=self._refill, name=f"sandbox-refill-{i}", daemon=True)
                         for i in range(size)]
        self._threads.append(threading.Thread(target=self._reap, name="sandbox-reaper", daemon=True))
        for t in self._threads:
            t.start()

    @property
    def ready(self) -> int:
        return self._ready.qsize()

    def _refill(self) -> None:
        backoff = 0.5
        while not self._stop.is_set():
            try:
                sandbox = self.backend.new_sandbox()
            except Exception as e:  # noqa: BLE001 - keep trying; acquire reports the reason
                self.last_boot_error = str(e)
                _log.error("sandbox boot failed", error=str(e))
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 30.0)
                continue
            backoff = 0.5
            self.last_boot_error = ""
            self.booted += 1
            taken = threading.Event()
            self._ready.put((sandbox, taken))
            while not taken.wait(0.5):
                if self._stop.is_set():
                    return
        # stopping: whatever is still queued is closed by close()

    def _reap(self) -> None:
        while (sandbox := self._retired.get()) is not None:
            try:
                sandbox.close()
            except Exception:  # noqa: BLE001
                _log.exception("closing a sandbox failed", sandbox=sandbox.id)

    def acquire(self) -> GVisorSandbox:
        if self._stop.is_set():
            raise SandboxUnavailable("the sandbox service is shutting down")
        if self.size == 0:
            return self.backend.new_sandbox()
        deadline = time.monotonic() + self.acquire_timeout
        while True:
            try:
                sandbox, taken = self._ready.get(timeout=0.5)
            except queue.Empty:
                if self._stop.is_set():
                    raise SandboxUnavailable("the sandbox service is shutting down") from None
                if time.monotonic() > deadline:
                    raise SandboxUnavailable(f"no sandbox ready after {self.acquire_timeout:.0f}s"
                                             + (f"; last boot error: {self.last_boot_error}"
                                                if self.last_boot_error else "")) from None
                continue
            taken.set()
            if sandbox.alive:
                return sandbox
            self._retired.put(sandbox)

    def release(self, sandbox: GVisorSandbox) -> None:
        """A used sandbox is never reused: it is destroyed in the background."""
        self._retired.put(sandbox)

    def close(self) -> None:
        self._stop.set()
        for t in self._threads[:-1]:
            t.join(timeout=self.backend.settings.boot_timeout_seconds + 5)
        while True:
            try:
                sandbox, taken = self._ready.get_nowait()
            except queue.Empty:
                break
            taken.set()
            self._retired.put(sandbox)
        self._retired.put(None)
        self._threads[-1].join()
        self.backend.close()
