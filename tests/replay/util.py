"""Helpers shared by the replay tests (groups: tests/builders.py)."""

from __future__ import annotations

from pathlib import Path

from temper.replay.wire import LegacyRolloutGroup, recode_token_ids
from temper.runtime.launcher import Launcher
from temper.v1 import common_pb2


def start_replay(home: Path, model_dir: Path, replay_toml: str) -> tuple[Launcher, list[int]]:
    """Broker + `python -m temper.replay` with ``replay_toml`` as its config; returns the launcher
    and the PIDs it started (stop with ``launcher.down()``)."""
    home.mkdir(parents=True, exist_ok=True)
    config = home / "temper.toml"
    config.write_text(f'[model]\ndir = "{model_dir}"\n\n{replay_toml}\n')
    launcher = Launcher(home=home / "home", config=config)
    state = launcher.up(["replay"])
    return launcher, [state.broker.pid, state.services["replay"].pid]


def schema1_bytes(group: common_pb2.RolloutGroup) -> bytes:
    """``group`` as replay schema 1 stored it: token ids as varints (``int32``)."""
    return recode_token_ids(group, LegacyRolloutGroup).SerializeToString()
