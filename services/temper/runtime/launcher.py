"""Local launcher: the broker and every service as separate processes on loopback.

``up`` starts them, waits until each answers its health check and records pids, addresses and
metrics ports in ``<home>/state.json``; ``status`` reads them back; ``down`` stops exactly the
recorded pids (SIGTERM, then SIGKILL after a grace period) — never anything by name.

Wiring comes from the services' config classes (``temper.<svc>.config``), never from code here:
a field made with ``address_of(S)`` gets the address service S reported, ``model_dir()`` the
job's ``[model]`` resolved to a folder (built only when some service to start declares it, so
``temper up replay`` builds no model), ``from_job(K)`` the value of ``[job].K`` (the learner's
``groups_per_step`` is ``[job].prompts_per_step``), ``shared_dir(N)`` the folder ``<home>/data/shared/N``
(the same for every service declaring N; emptied by ``up``). Every service is started with ``--port 0
--metrics-port 0 --port-file F``: it binds, and writes the ports it got to F (before it loads
anything slow). Services start in dependency waves: a service starts once every service whose
address it needs (and that is being started) has reported its address; then the launcher waits
for every one to be SERVING. A service that needs an address of a service not being started
keeps its config's value.

Replicas: a service whose config has a ``replicas`` field (``[inference] replicas = 2``) is started that
many times, as ``inference``, ``inference-1``, ...: each its own process, port, port file, log, data dir
and state entry, supervised and restarted on its own port like any service. A dependent gets every
replica's address: a ``list[str]`` field the list, a ``str`` field one ``ipv4:a:p,b:q`` target
(``temper.client.discovery``), whose channel spreads calls over all of them.

Restart (``temper restart``, ``start_service``, and the supervisor after a crash,
``temper.runtime.supervisor``): the service is started again on the port it had (and the same
metrics port), passed explicitly. The port was the service's own and is free
once the process is gone, and the dependents keep the address they were given, so nothing else
has to be restarted or told. If another process took the port in the meantime, the service
exits with "cannot bind" and the restart fails with its log: a loud failure, never a silent
re-wiring.

Concurrency: the state file may be written by the process that ran ``up`` (its supervisor), by
a detached supervisor, and by ``temper restart`` in another terminal. A write replaces one
service's entry under ``<home>/state.lock`` (never the whole file from a stale copy), and every
stop or start of a service holds ``<home>/locks/<service>.lock``, so a deliberate stop and a
supervisor's restart never interleave.

The broker (Tansu) cannot bind port 0 and report it, so its port is picked free just before it
starts; if another process takes it first, Tansu's "address in use" error is recognised in its
log and a new port is picked (``broker.start_broker_on_free_port``). It is supervised too: with
``[broker] storage = "s3"`` (a local object store, ``broker-storage`` in the state, its data in
``<home>/data/broker``, kept across ``down``/``up`` as the services' data is) a crashed broker, or
one whose store crashed, is started again on its port; with the default memory storage its topics
died with it, so it is marked failed with that reason instead (``temper.runtime.broker``).
"""

from __future__ import annotations

import fcntl
import importlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

from temper import jobs
from temper.client.discovery import target_of
from temper.client.transport import AUTH_TOKEN_FILE_ENV, TLS_DIR_ENV
from temper.runtime.auth import AuthConfig, write_token
from temper.runtime.broker import (BrokerConfig, start_broker, start_broker_on_free_port, start_object_store,
                                   store_env)
from temper.runtime.config import ServiceConfig, wiring
from temper.runtime.rpc import check_health
from temper.runtime.service import read_port_file
from temper.runtime.supervisor import Exit, LauncherConfig, Supervisor
from temper.runtime.tls import CLIENT, tls_dir_of, write_certificates

# every service, in the order `down` reverses (dependencies first); the start order is derived from the configs
SERVICES = ("inference", "sandbox", "reward", "replay", "monitor", "learner", "scheduler")


@dataclass
class Proc:
    name: str
    pid: int
    address: str
    log: str
    metrics_port: int = -1
    args: list[str] = field(default_factory=list)
    port_file: str = ""
    started_at: float = 0.0     # wall-clock time of the last start
    restarts: int = 0           # starts by the supervisor after a crash (as a pod's RESTARTS)
    last_exit: str = ""         # how the process before the last restart ended
    stopped: bool = False       # stopped on purpose (stop_service): the supervisor leaves it alone
    failed: str = ""            # the supervisor gave up on it: why


@dataclass
class State:
    home: str
    config: str
    broker: Proc | None = None
    services: dict[str, Proc] = field(default_factory=dict)
    broker_storage: Proc | None = None  # [broker] storage = "s3": the object store the broker keeps its logs in
    stopping: bool = False      # `down` has begun: nothing is restarted any more
    supervisor_pid: int = 0     # the detached supervisor `temper up` left (0: none, or a thread of the up process)
    auth_token_file: str = ""   # [auth] mode = "token": the token's file (its path only; services get it in their env)
    tls_dir: str = ""           # [auth] tls = true: <home>/tls, one identity folder per service and the client's

    @property
    def kafka_bootstrap(self) -> str:
        return self.broker.address if self.broker else ""


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs; a zombie (dead, not yet reaped by its parent, whoever that is) counts as gone.

    Never reaps: the supervisor reaps its children and wants their exit status."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True


def config_class(service: str) -> type[ServiceConfig]:
    """The config class of ``service``: the ServiceConfig subclass of ``temper.<service>.config`` for its section."""
    module = importlib.import_module(f"temper.{service}.config")
    found = {v for v in vars(module).values()
             if isinstance(v, type) and issubclass(v, ServiceConfig) and v.section == service}
    if len(found) != 1:
        raise RuntimeError(f"temper.{service}.config must define exactly one ServiceConfig with section "
                           f"{service!r}, found {sorted(c.__name__ for c in found)}")
    return found.pop()


def service_of(name: str) -> str:
    """The service a process name belongs to: ``inference-1`` -> ``inference`` (a replica's name)."""
    return name.split("-", 1)[0]


def replica_names(service: str, cfg: dict) -> list[str]:
    """The processes ``service`` runs as: ``[service]``, or with ``[service] replicas = N`` (a field of its
    config) ``[service, service-1, ..., service-(N-1)]``."""
    cls = config_class(service)
    if "replicas" not in cls.model_fields:
        return [service]
    n = cfg.get(service, {}).get("replicas", cls.model_fields["replicas"].default)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"[{service}] replicas: must be an integer >= 1 (got {n!r})")
    return [service] + [f"{service}-{i}" for i in range(1, n)]


def dependencies(service: str) -> set[str]:
    """The services whose addresses ``service``'s config declares it needs."""
    return {w["address_of"] for w in wiring(config_class(service)).values() if "address_of" in w}


def waves(names: list[str]) -> list[list[str]]:
    """The start order of ``names``: each wave holds every service whose needed addresses (of services in
    ``names``) are known from the waves before it; each wave in ``SERVICES`` order."""
    pending, started, out = [n for n in SERVICES if n in names], set(), []
    while pending:
        wave = [n for n in pending if all(d in started or d not in names for d in dependencies(n))]
        if not wave:
            raise RuntimeError(f"circular address_of dependencies among {pending}")
        out.append(wave)
        started.update(wave)
        pending = [n for n in pending if n not in wave]
    return out


def _set_flag(args: list[str], flag: str, value: str) -> list[str]:
    """``args`` with ``flag``'s value replaced (or appended)."""
    args = list(args)
    if flag in args:
        args[args.index(flag) + 1] = value
    else:
        args += [flag, value]
    return args


class Launcher:
    def __init__(self, home: str | Path = ".temper", config: str | Path | None = None):
        self.home = Path(home).resolve()
        self.config_path = Path(config).resolve() if config else jobs.path()
        self.state_file = self.home / "state.json"
        self.supervisor: Supervisor | None = None
        self._children: dict[int, subprocess.Popen] = {}
        self._own_env: dict[str, str | None] | None = None  # $TEMPER_AUTH_TOKEN_FILE / $TEMPER_TLS_DIR before up
        self.jobs_ended: list[str] = []  # the scheduler's jobs the last `down` stopped

    # -- state -----------------------------------------------------------------------------
    def load(self) -> State | None:
        if not self.state_file.exists():
            return None
        raw = json.loads(self.state_file.read_text())
        broker = Proc(**raw["broker"]) if raw.get("broker") else None
        storage = Proc(**raw["broker_storage"]) if raw.get("broker_storage") else None
        return State(home=raw["home"], config=raw["config"], broker=broker, broker_storage=storage,
                     services={k: Proc(**v) for k, v in raw.get("services", {}).items()},
                     stopping=raw.get("stopping", False), supervisor_pid=raw.get("supervisor_pid", 0),
                     auth_token_file=raw.get("auth_token_file", ""), tls_dir=raw.get("tls_dir", ""))

    def _save(self, state: State) -> None:
        with self._locked(self.home / "state.lock"):
            self._write(state)

    def _write(self, state: State) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_name(f".state.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(asdict(state), indent=2))
        tmp.replace(self.state_file)

    def _update(self, change) -> State | None:
        """``change(state)`` applied to the state file as it is now, under its lock; None if nothing is up."""
        with self._locked(self.home / "state.lock"):
            state = self.load()
            if state is not None:
                change(state)
                self._write(state)
            return state

    def _save_service(self, p: Proc) -> None:
        def put(state: State) -> None:
            state.services[p.name] = p
        self._update(put)

    @contextmanager
    def _locked(self, path: Path) -> Iterator[None]:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _service_lock(self, name: str):
        return self._locked(self.home / "locks" / f"{name}.lock")

    def config(self) -> dict:
        with open(self.config_path, "rb") as f:
            return tomllib.load(f)

    # -- up --------------------------------------------------------------------------------
    def up(self, services: list[str] | None = None, timeout: float = 120.0, supervise: str = "thread") -> State:
        """Start the broker and ``services`` (all by default) and wait until every one is SERVING.

        ``supervise``: ``"thread"`` supervises them (``temper.runtime.supervisor``) from a thread of
        this process until ``down``; ``"process"`` from a detached process that outlives this one
        (``temper up``); ``"off"``: nothing restarts a crashed service."""
        if supervise not in ("thread", "process", "off"):
            raise ValueError(f"supervise: {supervise!r} is not thread, process or off")
        names = list(services or SERVICES)
        unknown = [n for n in names if n not in SERVICES]
        if unknown:
            raise ValueError(f"unknown service(s) {unknown}; known: {list(SERVICES)}")
        names = [n for n in SERVICES if n in names]
        state = self.load()
        if state and any(pid_alive(p.pid) for p in [*state.services.values(), *filter(None, [state.broker,
                                                                                           state.broker_storage])]):
            raise RuntimeError(f"Temper is already up in {self.home} (run `temper down` first)")
        cfg = self.config()
        policy = LauncherConfig.from_config(cfg, self.config_path)
        auth = AuthConfig.from_config(cfg, self.config_path)
        broker = BrokerConfig.from_config(cfg, self.config_path)
        # the model is resolved (the tiny recipe built) before anything starts, and only if a service loads it
        needs_model = any(w.get("model") for n in names for w in wiring(config_class(n)).values())
        model_dir = self._model_dir(cfg) if needs_model else None
        logs = self.home / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        state = State(home=str(self.home), config=str(self.config_path))
        if auth.mode == "token":
            state.auth_token_file = str(write_token(self.home))
        if auth.tls:  # a certificate for every service (a later `temper up replay` may start any), and the client's
            state.tls_dir = str(write_certificates(self.home, SERVICES))
        # this process's own calls (temper run follows the job through the SDK) carry the token / certificate too
        own = {AUTH_TOKEN_FILE_ENV: state.auth_token_file, TLS_DIR_ENV: tls_dir_of(state.tls_dir, CLIENT)}
        own = {k: v for k, v in own.items() if v}
        if own:
            self._own_env = {k: os.environ.get(k) for k in own}
            os.environ.update(own)
        deadline = time.monotonic() + timeout
        try:
            state.broker, state.broker_storage = self._start_broker(broker, logs)
            self._save(state)
            from temper.runtime.kafka import ensure_topics
            # one partition per reward replica: each member of the consumer group scores its share of `rollouts`;
            # a multiple of the replay shards, so that each owns as many partitions of `scored` as the others
            ensure_topics(state.kafka_bootstrap, partitions=math.lcm(len(replica_names("reward", cfg)),
                                                                     len(replica_names("replay", cfg))))
            shutil.rmtree(self.home / "data" / "shared", ignore_errors=True)  # a past stack's policy is not ours
            started = []
            for wave in waves(names):
                procs = [r for name in wave for r in replica_names(name, cfg)]
                for name in procs:
                    state.services[name] = self._start(self._proc(name, state, cfg, model_dir, logs), state)
                    self._save(state)
                self._wait_all(procs, state, deadline, self._wait_reported)
                self._save(state)
                started += procs
            self._wait_all(started, state, deadline, self._wait_serving)
            if supervise == "thread":
                self.supervisor = Supervisor(self, policy).start()
            elif supervise == "process":
                state.supervisor_pid = self._start_supervisor_process(logs, state)
                self._save(state)
        except BaseException:
            self.down()
            raise
        return state

    def _start_broker(self, config: BrokerConfig, logs: Path, port: int | None = None,
                      storage: Proc | None = None) -> tuple[Proc, Proc | None]:
        """The broker (on ``port``, else one picked free) and, for s3 storage, its object store (``storage`` if
        it still runs, else a new one on the same data); both are this launcher's children."""
        env = None
        if config.storage == "s3":
            if storage is None or not pid_alive(storage.pid):
                log = logs / "broker-storage.log"
                proc, endpoint = start_object_store(self.home / "data" / "broker", log)
                self._children[proc.pid] = proc
                storage = Proc("broker-storage", proc.pid, endpoint, str(log), started_at=time.time(),
                               restarts=storage.restarts + 1 if storage else 0)
            env = store_env(storage.address)
        log = logs / "broker.log"
        if port is None:
            proc, port = start_broker_on_free_port(log, engine=config.engine, env=env)
        else:
            proc = start_broker(port, log, engine=config.engine, env=env)
        self._children[proc.pid] = proc
        return Proc("broker", proc.pid, f"127.0.0.1:{port}", str(log), started_at=time.time()), storage

    def broker_exit(self) -> Exit | None:
        """None while the broker (and its object store, if any) runs; else how the one that ended ended."""
        state = self.load()
        if state is None or state.broker is None:
            return None
        exit = self.exit_of(state.broker.pid)
        if exit is None and state.broker_storage is not None:
            exit = self.exit_of(state.broker_storage.pid)
        return exit

    def not_restartable(self, name: str) -> str:
        """Why the supervisor must not restart ``name`` after a crash ("": it may)."""
        if name == "broker" and BrokerConfig.from_config(self.config(), self.config_path).storage == "memory":
            return ("its storage is memory: its topics, offsets and producer ids ended with it, so it is not "
                    "restarted (a job survives a broker crash with [broker] storage = \"s3\")")
        return ""

    def _restart_broker(self, pid: int, reason: str) -> Proc | None:
        with self._service_lock("broker"):
            state = self.load()
            if state is None or state.stopping or state.broker is None:
                return None
            old = state.broker
            if old.pid != pid or old.stopped or old.failed:
                return None
            if pid_alive(old.pid):  # its object store ended: the broker goes too, and both start again
                _terminate([old], 5.0)
                self.exit_of(old.pid)
                reason = f"its object store {reason}"
            config = BrokerConfig.from_config(self.config(), self.config_path)
            new, storage = self._start_broker(config, Path(old.log).parent, int(old.address.rsplit(":", 1)[1]),
                                              state.broker_storage)
            new.restarts, new.last_exit = old.restarts + 1, reason

            def put(s: State) -> None:
                s.broker, s.broker_storage = new, storage
            self._update(put)
            return new

    def _start_supervisor_process(self, logs: Path, state: State) -> int:
        with open(logs / "supervisor.log", "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", "temper.runtime.supervisor", "--home", str(self.home)],
                                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, env=_service_env("", tls_dir_of(state.tls_dir, CLIENT)))
        return proc.pid

    def _model_dir(self, cfg: dict) -> Path:
        """The one folder every service that declares ``model_dir()`` loads: the job's [model] table resolved
        and checked (temper.models: any HF causal-LM folder, or preset = "tiny"), field named on error."""
        from temper.models import check_service_tables, resolve_model

        model_dir = resolve_model(cfg.get("model"), home=self.home).dir
        check_service_tables(cfg, model_dir)
        return model_dir

    def _proc(self, name: str, state: State, cfg: dict, model_dir: Path | None, logs: Path) -> Proc:
        addresses: dict[str, list[str]] = {}
        for n, p in state.services.items():
            addresses.setdefault(service_of(n), []).append(p.address)
        args = [sys.executable, "-m", f"temper.{service_of(name)}",
                *self.service_flags(name, cfg, model_dir, addresses, state.kafka_bootstrap)]
        return Proc(name, 0, "", str(logs / f"{name}.log"), -1, args, str(self.home / "ports" / f"{name}.json"))

    def service_flags(self, name: str, cfg: dict, model_dir: Path | None, addresses: dict[str, str | list[str]],
                      kafka_bootstrap: str) -> list[str]:
        """The arguments process ``name`` (a service, or one of its replicas) is started with: the flags every
        service shares, then what its config's wiring asks for (an address only of a service in ``addresses``,
        which maps a service to its replicas' addresses; ``--kafka-bootstrap`` only when given)."""
        logs = self.home / "logs"
        telemetry = LauncherConfig.from_config(cfg, self.config_path)
        args = ["--config", str(self.config_path), "--host", "127.0.0.1", "--port", "0",
                "--metrics-port", "0" if telemetry.metrics else "-1",
                "--port-file", str(self.home / "ports" / f"{name}.json"), "--data-dir", str(self.home / "data" / name),
                "--trace-sample-ratio", repr(telemetry.trace_sample_ratio)]
        if telemetry.traces:
            args += ["--trace-file", str(logs / f"{name}.spans.jsonl")]
        if kafka_bootstrap:
            args += ["--kafka-bootstrap", kafka_bootstrap]
        job = cfg.get("job", {})
        cls = config_class(service_of(name))
        for field_name, w in wiring(cls).items():
            flag = "--" + field_name.replace("_", "-")
            if "address_of" in w and w["address_of"] in addresses:
                found = addresses[w["address_of"]]
                found = [found] if isinstance(found, str) else found
                is_list = getattr(cls.model_fields[field_name].annotation, "__origin__", None) is list
                args += [flag, ",".join(found) if is_list else target_of(found)]
            elif "shared_dir" in w:
                args += [flag, str(self.home / "data" / "shared" / w["shared_dir"])]
            elif w.get("model") and model_dir is not None:
                args += [flag, str(model_dir)]
            elif "from_job" in w and w["from_job"] in job:
                value = job[w["from_job"]]  # a table gives its keys, a list its items (a list field's flag: a,b)
                args += [flag, ",".join(map(str, value)) if isinstance(value, dict | list) else str(value)]
            elif w.get("shard"):
                replicas = replica_names(service_of(name), cfg)
                if len(replicas) > 1:
                    args += [flag, f"{replicas.index(name)}/{len(replicas)}"]
        return args

    def _cpu_threads(self, service: str) -> int:
        """The ``cpu_threads`` of a service's table in the config (0: none set)."""
        value = self.config().get(service, {}).get("cpu_threads", 0)
        return value if isinstance(value, int) and not isinstance(value, bool) else 0

    def _start(self, p: Proc, state: State) -> Proc:
        if p.port_file:  # a report left by an earlier process must not be taken for this one's
            Path(p.port_file).unlink(missing_ok=True)
        with open(p.log, "ab") as log:
            proc = subprocess.Popen(p.args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True,
                                    env=_service_env(state.auth_token_file,
                                                     tls_dir_of(state.tls_dir, service_of(p.name)),
                                                     self._cpu_threads(service_of(p.name))))
        # kept: a dropped Popen of a live child is reaped by the next Popen's clean-up, status lost
        self._children[proc.pid] = proc
        p.pid, p.started_at = proc.pid, time.time()
        return p

    def exit_of(self, pid: int) -> Exit | None:
        """None while ``pid`` runs; else how it ended (reaped here if it is a child this launcher started;
        a process another one started is only seen gone, its status unknown)."""
        proc = self._children.get(pid)
        if proc is None:
            return None if pid_alive(pid) else Exit()
        code = proc.poll()
        if code is None:
            return None
        return Exit(signal=-code) if code < 0 else Exit(code=code)

    def reap(self) -> None:
        """Reap every child of this launcher that ended (also ones replaced meanwhile by `temper restart`
        from another process): no zombies; each one's status stays readable through ``exit_of``."""
        for proc in list(self._children.values()):
            proc.poll()

    def _service(self, name: str) -> tuple[State, Proc]:
        state = self.load()
        if state is None or name not in state.services:
            raise RuntimeError(f"{name} is not up in {self.home}")
        return state, state.services[name]

    def stop_service(self, name: str, kill: bool = False) -> None:
        """Stop one service (SIGTERM with a grace period, or SIGKILL); it stays in the state file, marked
        stopped, so no supervisor starts it again until ``start_service``."""
        with self._service_lock(name):
            self._stop_locked(name, kill)

    def start_service(self, name: str, timeout: float = 60.0) -> Proc:
        """Start a stopped or crashed service again, on the port and metrics port it had (module docstring)."""
        with self._service_lock(name):
            return self._start_locked(name, timeout)

    def restart(self, name: str, timeout: float = 60.0, kill: bool = False) -> Proc:
        """Stop ``name`` (if it still runs) and start it again; works on a crashed or given-up service too."""
        with self._service_lock(name):
            self._stop_locked(name, kill)
            return self._start_locked(name, timeout)

    def restart_crashed(self, name: str, pid: int, reason: str, timeout: float = 60.0) -> Proc | None:
        """The supervisor's restart of ``name`` after process ``pid`` ended (``reason``); None (nothing done)
        when the stack is stopping, the service was stopped on purpose, or someone already started it again."""
        if name == "broker":
            return self._restart_broker(pid, reason)
        with self._service_lock(name):
            state = self.load()
            if state is None or state.stopping or name not in state.services:
                return None
            p = state.services[name]
            if p.pid != pid or p.stopped or p.failed or pid_alive(p.pid):
                return None
            p.restarts += 1
            p.last_exit = reason
            return self._start_locked(name, timeout, p)

    def mark_failed(self, name: str, message: str) -> None:
        """The supervisor gave up on ``name``: recorded with the reason, for ``status`` and ``raise_if_failed``."""
        def mark(state: State) -> None:
            if name in state.services:
                state.services[name].failed = message
            elif name == "broker" and state.broker is not None:
                state.broker.failed = message
        self._update(mark)

    def raise_if_failed(self) -> None:
        """A RuntimeError naming each service the supervisor gave up on, with its log's end (for a job's loop)."""
        state = self.load()
        failed = [p for p in ([*filter(None, [state.broker]), *state.services.values()] if state else []) if p.failed]
        if failed:
            raise RuntimeError("; ".join(f"{p.failed}; its log ({p.log}) ends:\n{_tail(p.log, 15)}" for p in failed))

    def _stop_locked(self, name: str, kill: bool) -> None:
        _, p = self._service(name)
        p.stopped = True
        self._save_service(p)
        if kill:
            _signal(p.pid, signal.SIGKILL)
        _terminate([p], grace=15.0)
        self.exit_of(p.pid)  # reaped, if ours

    def _start_locked(self, name: str, timeout: float, p: Proc | None = None) -> Proc:
        state, recorded = self._service(name)
        p = p or recorded
        if pid_alive(p.pid):
            raise RuntimeError(f"{name} is still running (pid {p.pid})")
        p.args = _set_flag(_set_flag(p.args, "--port", p.address.rsplit(":", 1)[1]), "--metrics-port",
                           str(p.metrics_port))
        p.stopped, p.failed = False, ""
        self._start(p, state)
        self._save_service(p)
        state.services[name] = p
        deadline = time.monotonic() + timeout
        self._wait_all([name], state, deadline, self._wait_reported)
        self._save_service(p)
        self._wait_all([name], state, deadline, self._wait_serving)
        return p

    @staticmethod
    def _wait_all(names: list[str], state: State, deadline: float, wait) -> None:
        with ThreadPoolExecutor(len(names) or 1) as pool:
            for f in [pool.submit(wait, state.services[n], deadline) for n in names]:
                f.result()

    @staticmethod
    def _wait_reported(p: Proc, deadline: float) -> None:
        """Until ``p`` wrote its port file; then its address and metrics port are ``p``'s."""
        while time.monotonic() < deadline:
            report = read_port_file(p.port_file)
            if report is not None and report.get("pid") == p.pid:
                p.address, p.metrics_port = report["address"], report["metrics_port"]
                return
            if not pid_alive(p.pid):
                raise RuntimeError(f"{p.name} exited during start-up; its log ({p.log}) ends:\n{_tail(p.log)}")
            time.sleep(0.05)
        raise TimeoutError(f"{p.name} reported no port in time; its log ({p.log}) ends:\n{_tail(p.log)}")

    def _wait_serving(self, p: Proc, deadline: float) -> None:
        tls_dir = self._client_tls_dir()
        while time.monotonic() < deadline:
            if not pid_alive(p.pid):
                raise RuntimeError(f"{p.name} exited during start-up; its log ({p.log}) ends:\n{_tail(p.log)}")
            if check_health(p.address, timeout=0.5, tls_dir=tls_dir) == "SERVING":
                return
            time.sleep(0.1)
        raise TimeoutError(f"{p.name} not healthy in time; its log ({p.log}) ends:\n{_tail(p.log)}")

    def _client_tls_dir(self) -> str:
        """The launcher's own TLS identity for the stack in ``home`` ("": plaintext): health checks use it
        whichever process (``up``, the supervisor, another ``temper`` command) makes them."""
        state = self.load()
        return tls_dir_of(state.tls_dir, CLIENT) if state else ""

    # -- status / down ---------------------------------------------------------------------
    def status(self) -> list[dict]:
        state = self.load()
        if state is None:
            return []
        tls_dir = tls_dir_of(state.tls_dir, CLIENT)
        rows = []
        for p in filter(None, [state.broker, state.broker_storage]):
            rows.append({"name": p.name, "address": p.address, "pid": p.pid,
                         "health": "RUNNING" if pid_alive(p.pid) else "FAILED" if p.failed else "DEAD",
                         "metrics": "-", "restarts": p.restarts, "last_exit": p.last_exit, "failed": p.failed})
        if state.supervisor_pid:
            rows.append({"name": "supervisor", "address": "-", "pid": state.supervisor_pid,
                         "health": "RUNNING" if pid_alive(state.supervisor_pid) else "DEAD"})
        for p in state.services.values():
            if pid_alive(p.pid):
                health = check_health(p.address, tls_dir=tls_dir)
            else:
                health = "FAILED" if p.failed else "STOPPED" if p.stopped else "DEAD"
            rows.append({"name": p.name, "address": p.address, "pid": p.pid, "health": health,
                         "metrics": f"127.0.0.1:{p.metrics_port}" if p.metrics_port >= 0 else "-", "restarts": p.restarts,
                         "last_exit": p.last_exit, "failed": p.failed})
        return rows

    def down(self, grace: float = 15.0) -> list[str]:
        """Stop every recorded process (supervision first, then services in reverse start order, then the broker).

        Before the scheduler stops, every job it still runs or holds paused is stopped through StopJob
        (``jobs_ended`` lists them): ``down`` is the user ending the stack, so its saved jobs are STOPPED and a
        later ``up`` on this home does not resume them. (A crash, or the supervisor's restart, leaves them
        RUNNING: that scheduler resumes them.)"""
        def stopping(state: State) -> None:
            state.stopping = True
        state = self._update(stopping)
        if state is None:
            return []
        if self.supervisor is not None:
            self.supervisor.stop()
            self.supervisor = None
        if state.supervisor_pid:
            _terminate([Proc("supervisor", state.supervisor_pid, "", "")], 10.0)
        for name in [*state.services, "broker"]:  # a restart under way finishes (and records its pid) first
            with self._service_lock(name):
                pass
        state = self.load()
        self.jobs_ended = self._end_jobs(state)
        procs = [p for s in reversed(SERVICES) for n, p in state.services.items() if service_of(n) == s]
        stopped = _terminate(procs, grace) + _terminate([p for p in (state.broker, state.broker_storage) if p], 5.0)
        self.reap()
        if self._own_env is not None:  # this process's SDK calls go back to what they were
            for key, value in self._own_env.items():
                os.environ.pop(key, None)
                if value is not None:
                    os.environ[key] = value
            self._own_env = None
        self.state_file.unlink(missing_ok=True)
        return stopped


    def _end_jobs(self, state: State) -> list[str]:
        """StopJob for each RUNNING or PAUSED job of the stack's live scheduler; the ids stopped. Best effort:
        a scheduler that does not answer keeps its jobs as saved (and ``down`` goes on)."""
        p = state.services.get("scheduler")
        if p is None or not pid_alive(p.pid):
            return []
        from temper.client.sdk import SchedulerClient
        from temper.v1 import scheduler_pb2

        active = (scheduler_pb2.JOB_STATE_RUNNING, scheduler_pb2.JOB_STATE_PAUSED)
        token = Path(state.auth_token_file).read_text().strip() if state.auth_token_file else None
        ended = []
        try:
            with SchedulerClient(p.address, timeout=60, token=token,
                                 tls_dir=tls_dir_of(state.tls_dir, CLIENT)) as scheduler:
                for job in scheduler.list_jobs():
                    if job.state in active:
                        scheduler.stop_job(job.job_id)
                        ended.append(job.job_id)
        except grpc.RpcError as e:
            print(f"temper down: could not stop the scheduler's jobs ({e.code().name}: {e.details()}); "
                  f"saved jobs stay as they are", file=sys.stderr)
        return ended


def _terminate(procs: list[Proc], grace: float) -> list[str]:
    live = [p for p in procs if pid_alive(p.pid)]
    for p in live:
        _signal(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(pid_alive(p.pid) for p in live):
        time.sleep(0.05)
    for p in live:
        if pid_alive(p.pid):
            _signal(p.pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(pid_alive(p.pid) for p in live):
        time.sleep(0.05)
    return [p.name for p in live]


def _service_env(auth_token_file: str, tls_dir: str = "", cpu_threads: int = 0) -> dict[str, str]:
    """A child's environment: ours, with the auth token's file and the child's own TLS identity folder when the
    stack has them (and never another's); ``cpu_threads`` > 0 (its table's ``cpu_threads``): its OMP_NUM_THREADS."""
    env = {k: v for k, v in os.environ.items() if k not in (AUTH_TOKEN_FILE_ENV, TLS_DIR_ENV)}
    if auth_token_file:
        env[AUTH_TOKEN_FILE_ENV] = auth_token_file
    if tls_dir:
        env[TLS_DIR_ENV] = tls_dir
    # Seven services and the broker share the machine's cores: an OpenMP thread that spins while it waits
    # (libgomp's default) takes a core another service needs. Passive waiting measured here: vLLM's greedy
    # answers to 150 SmolLM2 prompts took 40 s instead of 72 s with other work on both cores.
    threads = str(cpu_threads) if cpu_threads > 0 else os.environ.get("OMP_NUM_THREADS", "1")
    return {**env, "OMP_NUM_THREADS": threads,
            "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
            "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _tail(path: str, lines: int = 30) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
