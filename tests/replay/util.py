"""Helpers shared by the replay tests (groups: tests/builders.py)."""

from __future__ import annotations

from pathlib import Path

from temper.runtime.launcher import Launcher


def start_replay(home: Path, model_dir: Path, replay_toml: str) -> tuple[Launcher, list[int]]:
    """Broker + `python -m temper.replay` with ``replay_toml`` as its config; returns the launcher
    and the PIDs it started (stop with ``launcher.down()``)."""
    home.mkdir(parents=True, exist_ok=True)
    config = home / "temper.toml"
    config.write_text(f'[model]\ndir = "{model_dir}"\n\n{replay_toml}\n')
    launcher = Launcher(home=home / "home", config=config)
    state = launcher.up(["replay"])
    return launcher, [state.broker.pid, state.services["replay"].pid]
