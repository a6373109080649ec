"""Supervision of the embedded mode: a crashed service is started again, with backoff.

As the kubelet restarts a pod's container: the supervisor notices that a service's process (or the
broker's, or its object store's: ``Launcher.broker_exit``) is
gone (the launcher's own children are reaped, so a dead one never lingers as a zombie and its
exit status is known),
decides from the ``[launcher]`` restart policy whether to start it again, waits
``backoff_seconds * 2**(n-1)`` (capped at ``max_backoff_seconds``) before the n-th restart in a
row, and gives up after ``max_restarts`` restarts in a row: the service is then marked failed in
the state file with the reason, and ``temper run`` fails the job with that message instead of
waiting forever. A service that stayed up ``stable_seconds`` starts its count afresh.

Restarts go through ``Launcher.start_service``: the same command line on the port (and metrics
port) the service had, so every dependent keeps the address it was given and its gRPC channel
reconnects by itself; the new process reports its ports in the same port file. A Kafka consumer
commits an offset only after the message's effect is durable (``temper.runtime.kafka``), so a
message in flight when the process died is delivered again to its successor.

Where it runs: in the process that ran ``Launcher.up`` (a thread; ``temper run``, or any program
that embeds the launcher), or, after ``temper up`` returns, in a detached
``python -m temper.runtime.supervisor --home H`` process recorded in the state file. It acts only
on services the state file says should run: ``temper restart`` / ``stop_service`` and ``down``
take the service's lock and mark it stopped (or the stack stopping) first, so the supervisor never
races a deliberate stop.

``restart``: ``"on-failure"`` (default) restarts a process that was killed by a signal or exited
non-zero (or whose status is unknown: it was not our child); ``"always"`` also one that exited 0;
``"never"`` restarts nothing, and the first crash fails the job.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from temper.runtime.config import job_table
from temper.runtime.logs import get_logger

if TYPE_CHECKING:
    from temper.runtime.launcher import Launcher

_log = get_logger(component="supervisor")


class LauncherConfig(BaseModel):
    """The ``[launcher]`` table of a job config (every key optional): how the local services are supervised
    (restart policy) and what telemetry they are started with."""

    model_config = ConfigDict(extra="forbid")

    restart: Literal["on-failure", "always", "never"] = Field(
        "on-failure", description="on-failure | always | never: which exits of a service start it again")
    max_restarts: int = Field(5, ge=0, description="restarts in a row (each within stable_seconds of the last "
                                                   "start) before the supervisor gives up and the job fails")
    backoff_seconds: float = Field(1.0, gt=0, description="wait before the first restart; doubled for each "
                                                         "further one in a row")
    max_backoff_seconds: float = Field(30.0, gt=0, description="the longest wait between restarts")
    stable_seconds: float = Field(60.0, gt=0, description="a service that ran this long counts its restarts "
                                                         "in a row from zero again")
    poll_seconds: float = Field(0.2, gt=0, description="how often the supervisor looks at every process")
    # the local services' telemetry (the flags the launcher starts each one with)
    traces: bool = Field(True, description="each service's spans to <home>/logs/<service>.spans.jsonl "
                                           "(false: no span export, unless a service's own table sets one)")
    trace_sample_ratio: float = Field(1.0, ge=0.0, le=1.0, description="every service's trace_sample_ratio: "
                                                                      "the share of traces recorded, 0 to 1")
    metrics: bool = Field(True, description="each service's Prometheus /metrics endpoint on a port of its own "
                                            "(false: none)")

    @classmethod
    def from_config(cls, cfg: dict, source: str | Path = "config") -> LauncherConfig:
        """The policy of a whole job config; a mistake is a ValueError naming ``launcher.KEY``."""
        return job_table(cls, cfg, "launcher", source)

    def delay(self, restarts_in_a_row: int) -> float:
        """Seconds to wait before restart number ``restarts_in_a_row`` (1, 2, ...) of a crash loop."""
        return min(self.backoff_seconds * 2 ** max(restarts_in_a_row - 1, 0), self.max_backoff_seconds)

    def restarts(self, exit: Exit) -> bool:
        if self.restart == "never":
            return False
        return self.restart == "always" or exit.failed


@dataclass(frozen=True)
class Exit:
    """How a process ended: its exit code, or the signal that killed it; neither if it was not our child."""

    code: int | None = None
    signal: int | None = None

    @property
    def failed(self) -> bool:
        return self.code != 0  # a signal, a non-zero code, or unknown

    def describe(self) -> str:
        if self.signal is not None:
            return f"killed by {signal.Signals(self.signal).name}"
        if self.code is not None:
            return f"exited with code {self.code}"
        return "exited (status unknown: started by another process)"


@dataclass
class _Watch:
    pid: int
    in_a_row: int = 0          # restarts in a row (the crash loop's length)
    due: float | None = None   # monotonic time of the next restart, while one is pending
    exit: Exit | None = None


class Supervisor:
    """Watches the services in the launcher's state file and restarts crashed ones (module docstring)."""

    def __init__(self, launcher: Launcher, policy: LauncherConfig):
        self.launcher = launcher
        self.policy = policy
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watches: dict[str, _Watch] = {}

    # -- running it ----------------------------------------------------------------------
    def start(self) -> Supervisor:
        self._thread = threading.Thread(target=self.run, name="temper-supervisor", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 90.0) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def run(self) -> None:
        """Until ``stop`` or the stack goes down (no state file, or ``down`` marked it stopping)."""
        while not self._stop.is_set():
            state = self.launcher.load()
            if state is None or state.stopping:
                return
            self.launcher.reap()
            watched = {**({"broker": state.broker} if state.broker else {}), **state.services}
            for name, p in watched.items():
                if self._stop.is_set():
                    return
                try:
                    self._look_at(name, p)
                except Exception:  # noqa: BLE001 - one bad restart must not end supervision of the rest
                    _log.exception("supervising failed", service=name)
            self._stop.wait(self.policy.poll_seconds)

    # -- one service -----------------------------------------------------------------------
    def _look_at(self, name: str, p) -> None:
        w = self._watches.get(name)
        if w is None or w.pid != p.pid:  # new, or started again on purpose (`temper restart`): a fresh count
            w = self._watches[name] = _Watch(p.pid)
        if p.stopped or p.failed:
            return
        if w.due is None:
            exit = self.launcher.broker_exit() if name == "broker" else self.launcher.exit_of(p.pid)
            if exit is None:
                return
            w.exit = exit
            ran = time.time() - p.started_at if p.started_at else 0.0
            if ran >= self.policy.stable_seconds:
                w.in_a_row = 0
            why_not = self.launcher.not_restartable(name)
            if why_not:
                self._give_up(name, f"{name} {exit.describe()}; {why_not}")
                return
            if not self.policy.restarts(exit):
                self._give_up(name, f"{name} {exit.describe()}; [launcher] restart = \"{self.policy.restart}\"")
                return
            if w.in_a_row >= self.policy.max_restarts:
                self._give_up(name, f"{name} {exit.describe()} after {w.in_a_row} restarts in a row "
                                    f"([launcher] max_restarts = {self.policy.max_restarts}); giving up")
                return
            delay = self.policy.delay(w.in_a_row + 1)
            w.due = time.monotonic() + delay
            self._note(name, f"{name} (pid {p.pid}) {exit.describe()}; restarting in {delay:.1f}s "
                             f"(restart {w.in_a_row + 1} in a row, at most {self.policy.max_restarts})")
            return
        if time.monotonic() < w.due:
            return
        w.due = None
        w.in_a_row += 1
        try:
            new = self.launcher.restart_crashed(name, w.pid, w.exit.describe() if w.exit else "")
        except (RuntimeError, TimeoutError) as e:  # it died again while starting: the next crash of the loop
            self._note(name, f"{name} restart failed: {e}")
            state = self.launcher.load()
            self._watches[name] = _Watch((state.broker if name == "broker" else state.services[name]).pid, w.in_a_row)
            return
        if new is None:  # someone else started it (or the stack is stopping)
            return
        self._watches[name] = _Watch(new.pid, w.in_a_row)
        self._note(name, f"{name} restarted: pid {new.pid} on {new.address} (restarts so far: {new.restarts})")

    def _give_up(self, name: str, message: str) -> None:
        self._note(name, message)
        self.launcher.mark_failed(name, message)

    def _note(self, name: str, message: str) -> None:
        """To the supervisor's log and the service's own log, where a user looks first."""
        _log.warning(message, service=name)
        line = f"[temper supervisor {time.strftime('%H:%M:%S')}] {message}\n"
        for path in (self.launcher.home / "logs" / "supervisor.log",
                     self.launcher.home / "logs" / f"{name}.log"):
            try:
                with open(path, "a") as f:
                    f.write(line)
            except OSError:
                pass


def main(argv: list[str] | None = None) -> int:
    """The detached supervisor ``temper up`` leaves behind: supervises the stack of ``--home`` until it is down."""
    from temper.runtime.launcher import Launcher

    parser = argparse.ArgumentParser(prog="temper-supervisor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--home", required=True)
    args = parser.parse_args(argv)
    launcher = Launcher(home=args.home)
    state = launcher.load()
    if state is None:
        sys.exit(f"temper-supervisor: nothing is up in {args.home}")
    launcher = Launcher(home=args.home, config=state.config)
    supervisor = Supervisor(launcher, LauncherConfig.from_config(launcher.config(), state.config))
    signal.signal(signal.SIGTERM, lambda *_: supervisor.stop(timeout=0))
    supervisor.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
