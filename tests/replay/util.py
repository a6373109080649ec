"""Builders shared by the replay tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from temper.runtime.launcher import Launcher
from temper.v1 import common_pb2


def make_group(gid: str, n: int = 2, domain: str = "toy.copy", version: int = 0, tokens: int = 2,
               seed: int = 0) -> common_pb2.RolloutGroup:
    """A scored GRPO group of ``n`` trajectories of ``tokens`` completion tokens each."""
    rng = np.random.default_rng(seed)
    return common_pb2.RolloutGroup(group_id=gid, task=common_pb2.Task(domain=domain), trajectories=[
        common_pb2.Trajectory(trajectory_id=f"{gid}/{k}", group_id=gid, policy_version=version,
                              prompt_token_ids=[1, 2, 3],
                              completion_token_ids=rng.integers(0, 50_000, tokens).tolist(),
                              completion_logprobs=(-rng.random(tokens)).tolist(),
                              reward=common_pb2.Reward(total=float(k % 2), status=common_pb2.REWARD_STATUS_OK))
        for k in range(n)])


def start_replay(home: Path, model_dir: Path, replay_toml: str) -> tuple[Launcher, list[int]]:
    """Broker + `python -m temper.replay` with ``replay_toml`` as its config; returns the launcher
    and the PIDs it started (stop with ``launcher.down()``)."""
    home.mkdir(parents=True, exist_ok=True)
    config = home / "temper.toml"
    config.write_text(f'[model]\ndir = "{model_dir}"\n\n{replay_toml}\n')
    launcher = Launcher(home=home / "home", config=config)
    state = launcher.up(["replay"])
    return launcher, [state.broker.pid, state.services["replay"].pid]
