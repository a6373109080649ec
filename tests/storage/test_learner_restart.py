"""A restarted learner whose disk is gone resumes from object storage: real broker, inference, replay and
learner processes on loopback, checkpoints uploaded to a real S3 server (SeaweedFS)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from temper.client.sdk import InferenceClient, LearnerClient, ReplayClient
from temper.runtime.launcher import Launcher, pid_alive
from temper.runtime.storage import Mirror, ObjectStore
from tests.conftest import wait_until
from tests.learner.test_service import make_groups

CONFIG = """
[job]
prompts_per_step = 4

[model]
preset = "tiny"
dir = "{model_dir}"

[learner]
epochs = 1
checkpoint_every = 2
checkpoint_url = "{url}"

[replay]
[inference]
engine = "hf"
"""


def test_a_learner_on_a_new_disk_resumes_from_the_object_store(s3_env, tmp_path):
    url = f"s3://temper/restart-{os.getpid()}"
    config = tmp_path / "temper.toml"
    config.write_text(CONFIG.format(model_dir=tmp_path / "model", url=url))
    launcher = Launcher(home=tmp_path / "home", config=config)
    state = launcher.up(["inference", "replay", "learner"])  # the children inherit the S3 endpoint and keys
    pids = [p.pid for p in state.services.values()] + [state.broker.pid]
    try:
        addr = {n: p.address for n, p in state.services.items()}
        inference, replay = InferenceClient(addr["inference"]), ReplayClient(addr["replay"])
        learner = LearnerClient(addr["learner"])
        replay.insert(make_groups(inference, 8, seed=1))  # two steps of four groups: a checkpoint at step 2
        wait_until(lambda: learner.status().checkpoint_step == 2, 180, what="the step-2 checkpoint")
        assert Mirror(ObjectStore(url)).latest() == "step-00000002"

        launcher.stop_service("learner", kill=True)
        shutil.rmtree(tmp_path / "home" / "data" / "learner")  # the pod's volume is gone
        launcher.start_service("learner", timeout=180)
        pids.append(launcher.load().services["learner"].pid)
        status = learner.status()
        assert status.resumed and status.step == 2 and status.policy_version >= 2
        assert Path(status.checkpoint_path).name == "step-00000002"
        assert Path(status.checkpoint_path).is_relative_to(tmp_path / "home" / "data" / "learner")
        assert inference.policy_version() == status.policy_version
        replay.insert(make_groups(inference, 4, seed=2))
        wait_until(lambda: learner.status().step == 3, 120, what="a step after the resume")
        learner.close()
    finally:
        launcher.down()
    assert not [p for p in pids if pid_alive(p)], "processes left behind"
