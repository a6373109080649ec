"""Local launcher: the broker and every service as separate processes on loopback.

``up`` starts them, waits until each answers its health check and records pids and
addresses in ``<home>/state.json``; ``status`` reads them back; ``down`` stops exactly the
recorded pids (SIGTERM, then SIGKILL after a grace period) — never anything by name.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from temper import jobs
from temper.runtime.broker import free_port, start_broker
from temper.runtime.rpc import check_health

# start order: dependencies first
SERVICES = ("inference", "sandbox", "reward", "replay", "monitor", "learner", "scheduler")


@dataclass
class Proc:
    name: str
    pid: int
    address: str
    log: str
    metrics_port: int = -1
    args: list[str] = field(default_factory=list)


@dataclass
class State:
    home: str
    config: str
    broker: Proc | None = None
    services: dict[str, Proc] = field(default_factory=dict)

    @property
    def kafka_bootstrap(self) -> str:
        return self.broker.address if self.broker else ""


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of ours counts as gone
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return True


class Launcher:
    def __init__(self, home: str | Path = ".temper", config: str | Path | None = None):
        self.home = Path(home).resolve()
        self.config_path = Path(config).resolve() if config else jobs.path()
        self.state_file = self.home / "state.json"

    # -- state -----------------------------------------------------------------------------
    def load(self) -> State | None:
        if not self.state_file.exists():
            return None
        raw = json.loads(self.state_file.read_text())
        broker = Proc(**raw["broker"]) if raw.get("broker") else None
        return State(home=raw["home"], config=raw["config"], broker=broker,
                     services={k: Proc(**v) for k, v in raw.get("services", {}).items()})

    def _save(self, state: State) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(state), indent=2))
        tmp.replace(self.state_file)

    def config(self) -> dict:
        with open(self.config_path, "rb") as f:
            return tomllib.load(f)

    # -- up --------------------------------------------------------------------------------
    def up(self, services: list[str] | None = None, timeout: float = 120.0) -> State:
        names = list(services or SERVICES)
        unknown = [n for n in names if n not in SERVICES]
        if unknown:
            raise ValueError(f"unknown service(s) {unknown}; known: {list(SERVICES)}")
        state = self.load()
        if state and any(pid_alive(p.pid) for p in [*state.services.values(), *([state.broker] if state.broker else [])]):
            raise RuntimeError(f"Temper is already up in {self.home} (run `temper down` first)")
        cfg = self.config()
        logs = self.home / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        state = State(home=str(self.home), config=str(self.config_path))
        try:
            port = free_port()
            proc = start_broker(port, logs / "broker.log")
            state.broker = Proc("broker", proc.pid, f"127.0.0.1:{port}", str(logs / "broker.log"))
            self._save(state)
            from temper.runtime.kafka import ensure_topics
            ensure_topics(state.kafka_bootstrap)
            model_dir = self._model_dir(cfg)
            addresses = {n: f"127.0.0.1:{free_port()}" for n in SERVICES}
            for name in [n for n in SERVICES if n in names]:
                state.services[name] = self._spawn(name, addresses, state, cfg, model_dir, logs)
                self._save(state)
            self._wait_healthy(state, timeout)
        except BaseException:
            self.down()
            raise
        return state

    def _model_dir(self, cfg: dict) -> Path:
        from temper.models.tiny import ensure_tiny_model

        model = dict(cfg.get("model", {}))
        model_dir = Path(model.pop("dir", self.home / "models" / "tiny"))
        if not model_dir.is_absolute():
            model_dir = Path.cwd() / model_dir
        return ensure_tiny_model(model_dir, **model)

    def _spawn(self, name: str, addresses: dict[str, str], state: State, cfg: dict, model_dir: Path,
               logs: Path) -> Proc:
        host, port = addresses[name].rsplit(":", 1)
        metrics_port = free_port()
        args = [sys.executable, "-m", f"temper.{name}", "--config", str(self.config_path), "--host", host,
                "--port", port, "--metrics-port", str(metrics_port), "--kafka-bootstrap", state.kafka_bootstrap,
                "--data-dir", str(self.home / "data" / name), "--trace-file", str(logs / f"{name}.spans.jsonl")]
        if name in ("inference", "learner"):
            args += ["--model-dir", str(model_dir)]
        if name == "learner":
            args += ["--replay-address", addresses["replay"], "--inference-addresses", addresses["inference"],
                     "--groups-per-step", str(cfg.get("job", {}).get("prompts_per_step", 16))]
        if name == "scheduler":
            args += ["--inference-address", addresses["inference"]]
        if name == "reward":
            args += ["--sandbox-address", addresses["sandbox"]]
        return self._start(Proc(name, 0, addresses[name], str(logs / f"{name}.log"), metrics_port, args))

    @staticmethod
    def _start(p: Proc) -> Proc:
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
               "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
        with open(p.log, "ab") as log:
            proc = subprocess.Popen(p.args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, env=env)
        p.pid = proc.pid
        return p

    def _service(self, name: str) -> tuple[State, Proc]:
        state = self.load()
        if state is None or name not in state.services:
            raise RuntimeError(f"{name} is not up in {self.home}")
        return state, state.services[name]

    def stop_service(self, name: str, kill: bool = False) -> None:
        """Stop one service (SIGTERM with a grace period, or SIGKILL); it stays in the state file."""
        _, p = self._service(name)
        if kill:
            _signal(p.pid, signal.SIGKILL)
        _terminate([p], grace=15.0)

    def start_service(self, name: str, timeout: float = 60.0) -> Proc:
        """Start a stopped service again with the same address and arguments."""
        state, p = self._service(name)
        if pid_alive(p.pid):
            raise RuntimeError(f"{name} is still running (pid {p.pid})")
        state.services[name] = self._start(p)
        self._save(state)
        self._wait_healthy(State(state.home, state.config, state.broker, {name: p}), timeout)
        return p

    def restart(self, name: str, timeout: float = 60.0, kill: bool = False) -> Proc:
        self.stop_service(name, kill=kill)
        return self.start_service(name, timeout)

    def _wait_healthy(self, state: State, timeout: float) -> None:
        deadline = time.monotonic() + timeout

        def wait(p: Proc) -> None:
            while time.monotonic() < deadline:
                if not pid_alive(p.pid):
                    raise RuntimeError(f"{p.name} exited during start-up; its log ({p.log}) ends:\n{_tail(p.log)}")
                if check_health(p.address, timeout=0.5) == "SERVING":
                    return
                time.sleep(0.1)
            raise TimeoutError(f"{p.name} not healthy after {timeout:.0f}s; its log ({p.log}) ends:\n{_tail(p.log)}")

        with ThreadPoolExecutor(len(state.services) or 1) as pool:
            for f in [pool.submit(wait, p) for p in state.services.values()]:
                f.result()

    # -- status / down ---------------------------------------------------------------------
    def status(self) -> list[dict]:
        state = self.load()
        if state is None:
            return []
        rows = []
        if state.broker:
            rows.append({"name": "broker", "address": state.broker.address, "pid": state.broker.pid,
                         "health": "RUNNING" if pid_alive(state.broker.pid) else "DEAD"})
        for p in state.services.values():
            health = check_health(p.address) if pid_alive(p.pid) else "DEAD"
            rows.append({"name": p.name, "address": p.address, "pid": p.pid, "health": health,
                         "metrics": f"127.0.0.1:{p.metrics_port}"})
        return rows

    def down(self, grace: float = 15.0) -> list[str]:
        """Stop every recorded process (services in reverse start order, then the broker)."""
        state = self.load()
        if state is None:
            return []
        procs = [state.services[n] for n in reversed(SERVICES) if n in state.services]
        stopped = _terminate(procs, grace) + (_terminate([state.broker], 5.0) if state.broker else [])
        self.state_file.unlink(missing_ok=True)
        return stopped


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
