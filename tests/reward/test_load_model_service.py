"""LoadModel on a real reward service (a process, real gRPC over loopback, a real broker): a domain that
weighs the PRM before one exists ([reward.prm] load_later), a PRM loaded and scoring, replaced by
another without a restart, bad requests refused with their code and field (the loaded PRM keeps
serving), the call refused without the stack's token, and `temper reward load` doing the same."""

from __future__ import annotations

import json

import grpc
import pytest

from temper.cli.main import main
from temper.client.sdk import RewardClient
from temper.reward.models import RewardModelEngine, build_tiny_reward_model
from temper.reward.steps import split_steps
from temper.runtime.auth import write_token
from temper.v1 import common_pb2, reward_pb2
from tests.builders import rollout_group
from tests.conftest import spawn_service
from tests.reward.conftest import component

OK, ERROR = common_pb2.REWARD_STATUS_OK, common_pb2.REWARD_STATUS_ERROR
GROUP = rollout_group("toy.copy", "6", ["6 = 3 * 2", "7 is it"], prompt="copy 6", tokens=1)
CONFIG = """
[reward]
prm_step_delimiter = " "
[reward.prm]
load_later = true
[reward.domains.toy]
weights = { exact_answer = 1.0, prm = 0.5 }
"""


def direct(model_dir) -> list[list[float]]:
    engine = RewardModelEngine(model_dir)
    try:
        return [engine.score_steps(GROUP.task.prompt, split_steps(t.completion_text, " ")) for t in GROUP.trajectories]
    finally:
        engine.close()


def rpc_error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value


def test_load_a_prm_into_the_running_service_then_replace_it(broker, tmp_path, monkeypatch, capsys):
    a, b = build_tiny_reward_model(tmp_path / "prm-a", seed=1), build_tiny_reward_model(tmp_path / "prm-b", seed=2)
    seq = build_tiny_reward_model(tmp_path / "rm-seq", seed=3, sequence_classifier=True)
    config = tmp_path / "reward.toml"
    config.write_text(CONFIG)
    monkeypatch.setenv("TEMPER_AUTH_TOKEN_FILE", str(write_token(tmp_path / "home")))  # as a token stack runs it
    reward = spawn_service("reward", tmp_path, "--config", str(config), "--kafka-bootstrap", broker)
    try:
        with RewardClient(reward.address, timeout=60) as client:
            # before any PRM: the domain is served, its prm component an explicit ERROR
            listing = client.list_domains()
            assert not listing.process_reward_model_loaded and listing.process_reward_model_dir == ""
            first = client.score(GROUP).trajectories[0]
            assert component(first, "prm").status == ERROR and first.reward.status == ERROR

            loaded = client.load_model(str(a), slot="prm")
            assert (loaded.slot, loaded.version, loaded.replaced_dir) == (reward_pb2.MODEL_SLOT_PRM, 1, "")
            assert loaded.model_dir == str(a.resolve()) and loaded.per_token and loaded.step_delimiter == " "
            assert loaded.architecture == "LlamaForTokenClassification" and "step_tag" in loaded.metadata
            listing = client.list_domains()
            assert listing.process_reward_model_loaded and listing.process_reward_model_dir == str(a.resolve())
            expected_a, expected_b = direct(a), direct(b)
            scored = client.score(GROUP)
            for traj, steps in zip(scored.trajectories, expected_a):
                assert traj.reward.status == OK and component(traj, "prm").status == OK
                assert list(traj.reward.step_rewards) == pytest.approx(steps)
            assert scored.trajectories[0].reward.total == pytest.approx(1.0 + 0.5 * min(expected_a[0]))

            # bad requests: the code and the field, and the loaded PRM keeps serving
            for request, code, field in [
                    (reward_pb2.LoadModelRequest(model_dir=str(b)), grpc.StatusCode.INVALID_ARGUMENT, "slot"),
                    (reward_pb2.LoadModelRequest(slot=reward_pb2.MODEL_SLOT_PRM), grpc.StatusCode.INVALID_ARGUMENT,
                     "model_dir"),
                    (reward_pb2.LoadModelRequest(slot=reward_pb2.MODEL_SLOT_PRM, model_dir=str(tmp_path / "nope")),
                     grpc.StatusCode.INVALID_ARGUMENT, "model_dir"),
                    (reward_pb2.LoadModelRequest(slot=reward_pb2.MODEL_SLOT_PRM, model_dir=str(tmp_path)),
                     grpc.StatusCode.FAILED_PRECONDITION, "model_dir"),  # a folder, not a checkpoint
                    (reward_pb2.LoadModelRequest(slot=reward_pb2.MODEL_SLOT_PRM, model_dir=str(seq)),
                     grpc.StatusCode.FAILED_PRECONDITION, "model_dir")]:  # an outcome-only head in the prm slot
                e = rpc_error(lambda r=request: client.stub.LoadModel(r, timeout=60))
                assert e.code() == code and e.details().startswith(f"{field}: "), (request, e.code(), e.details())
            assert client.list_domains().process_reward_model_dir == str(a.resolve())
            for traj, steps in zip(client.score(GROUP).trajectories, expected_a):
                assert list(traj.reward.step_rewards) == pytest.approx(steps)

            # without the stack's token the mutating call is refused like every other
            with RewardClient(reward.address, timeout=60, token="not-the-token") as stranger:
                e = rpc_error(lambda: stranger.load_model(str(b), slot="prm"))
                assert e.code() == grpc.StatusCode.PERMISSION_DENIED

            # `temper reward load` replaces it: the same service, no restart, the new model's scores
            assert main(["--home", str(tmp_path / "home"), "reward", "load", "--prm", str(b),
                         "--address", reward.address]) == 0
            out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
            assert (out["version"], out["replaced"], out["model_dir"]) == (2, str(a.resolve()), str(b.resolve()))
            for traj, steps in zip(client.score(GROUP).trajectories, expected_b):
                assert list(traj.reward.step_rewards) == pytest.approx(steps)
            assert expected_a[0] != pytest.approx(expected_b[0])
            # a refusal through the command names the field and leaves b serving
            assert main(["--home", str(tmp_path / "home"), "reward", "load", "--prm", str(seq),
                         "--address", reward.address]) == 1
            assert "model_dir" in capsys.readouterr().err
            assert client.list_domains().process_reward_model_dir == str(b.resolve())
        assert reward.proc.poll() is None  # nothing of this killed the service
    finally:
        reward.stop()
