"""Fixtures of the reward tests: a real sandbox service, tiny reward models built locally, scorers.

Everything started here is stopped by pid (``spawn_service``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from temper.reward.core import Scorer
from temper.reward.models import build_tiny_reward_model
from temper.reward.settings import RewardSettings
from temper.v1 import common_pb2
from tests.conftest import ServiceHandle, spawn_service


def component(traj: common_pb2.Trajectory, name: str) -> common_pb2.RewardComponent:
    found = [c for c in traj.reward.components if c.name == name]
    assert len(found) == 1, f"{name} not in {[c.name for c in traj.reward.components]}"
    return found[0]


def start_sandbox(workdir: Path, port: int = 0, kafka_bootstrap: str = "") -> ServiceHandle:
    """The sandbox service for the reward tests: 2 executions at once, 16 queued."""
    traces = ["--kafka-bootstrap", kafka_bootstrap] if kafka_bootstrap else ["--no-publish-traces"]
    return spawn_service("sandbox", workdir, *traces, "--max-concurrency", "2", "--max-queue", "16", port=port)


@pytest.fixture(scope="session")
def sandbox(tmp_path_factory):
    """The real sandbox service (gVisor runsc), shared by the reward tests."""
    svc = start_sandbox(tmp_path_factory.mktemp("reward-sandbox"))
    yield svc
    svc.stop()


@pytest.fixture(scope="session")
def tiny_rm_dir(tmp_path_factory) -> Path:
    """A random tiny value-head reward model (LlamaForTokenClassification over the tiny tokenizer)."""
    return build_tiny_reward_model(tmp_path_factory.mktemp("tiny-rm"), seed=1)


@pytest.fixture(scope="session")
def scorer():
    """The default scorer (no models, no sandbox): toy, math, reasoning-gym, format checks."""
    s = Scorer(RewardSettings())
    yield s
    s.close()
