"""Fixtures of the reward tests: a real sandbox service, tiny reward models built locally, scorers.

Everything started here is stopped by pid.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from temper.reward.core import Scorer
from temper.reward.models import build_tiny_reward_model
from temper.reward.settings import RewardSettings
from temper.runtime.broker import free_port
from temper.runtime.rpc import check_health
from temper.v1 import common_pb2

REPO = Path(__file__).resolve().parents[2]


def group(domain: str, reference: str, texts, prompt: str = "", group_id: str = "g", metadata=None,
          token_counts=None) -> common_pb2.RolloutGroup:
    trajs = []
    for i, t in enumerate(texts):
        n = token_counts[i] if token_counts else 0
        trajs.append(common_pb2.Trajectory(trajectory_id=f"{group_id}/{i}", group_id=group_id, completion_text=t,
                                           completion_token_ids=list(range(n)), completion_logprobs=[-0.1] * n))
    return common_pb2.RolloutGroup(group_id=group_id, task=common_pb2.Task(
        domain=domain, prompt=prompt, reference_answer=reference, metadata=metadata or {}), trajectories=trajs)


def component(traj: common_pb2.Trajectory, name: str) -> common_pb2.RewardComponent:
    found = [c for c in traj.reward.components if c.name == name]
    assert len(found) == 1, f"{name} not in {[c.name for c in traj.reward.components]}"
    return found[0]


class ServiceProcess:
    """``python -m temper.<name>`` on a free loopback port; stopped by pid."""

    def __init__(self, name: str, workdir: Path, *args: str, port: int | None = None):
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log = workdir / f"{name}.log"
        argv = [sys.executable, "-m", f"temper.{name}", "--host", "127.0.0.1", "--port", str(self.port),
                "--metrics-port", "-1", "--data-dir", str(workdir / f"{name}-data"), "--grace-seconds", "2", *args]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO,
                                         start_new_session=True)
        deadline = time.monotonic() + 90
        while check_health(self.address, timeout=0.5) != "SERVING":
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{name} did not come up; its log ends:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.1)

    def kill(self) -> None:
        """SIGKILL, as a crash: nothing is flushed or committed."""
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_sandbox(workdir: Path, port: int | None = None, kafka_bootstrap: str = "") -> ServiceProcess:
    traces = ["--kafka-bootstrap", kafka_bootstrap] if kafka_bootstrap else ["--no-publish-traces"]
    return ServiceProcess("sandbox", workdir, *traces, "--max-concurrency", "2", "--max-queue", "16", port=port)


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
