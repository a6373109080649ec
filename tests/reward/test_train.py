"""Training the reward models from the data the system produces: loss decreases, the saved model
loads in the service's engine and scores what it learned."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

from temper.models.tiny import ensure_tiny_model
from temper.reward.dataset import export, records_from_group, records_from_trace
from temper.reward.models import RewardModelEngine
from temper.reward.train import train
from temper.runtime import kafka
from temper.v1 import common_pb2, sandbox_pb2
from tests.builders import rollout_group
from tests.conftest import REPO

pytestmark = pytest.mark.slow  # runs the training entry point as a process


def write_records(path, n: int, seed: int = 0) -> None:
    """Tiny data with a learnable rule: a completion digit below 5 is good, 5 and above bad."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            prompt = "copy " + " ".join(str(rng.randint(0, 9)) for _ in range(3))
            good, bad = str(rng.randint(0, 4)), str(rng.randint(5, 9))
            kind = i % 3
            if kind == 0:
                rec = {"prompt": prompt, "chosen": good, "rejected": bad}
            elif kind == 1:
                c = rng.choice([good, bad])
                rec = {"prompt": prompt, "completion": c, "label": float(c == good)}
            else:
                steps = [rng.choice([good, bad]) for _ in range(3)]
                rec = {"prompt": prompt, "steps": [s if k == 0 else "\n\n" + s for k, s in enumerate(steps)],
                       "step_labels": [float(int(s) < 5) for s in steps]}
            f.write(json.dumps(rec) + "\n")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The policy-like causal LM a reward model starts from (its head starts at random)."""
    return ensure_tiny_model(tmp_path_factory.mktemp("rm-base") / "tiny")


def test_train_entry_point(base, tmp_path):
    data, out = tmp_path / "data.jsonl", tmp_path / "rm"
    write_records(data, 60)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "temper.reward.train", "--data", str(data), "--base", str(base),
                           "--out", str(out), "--epochs", "4", "--lr", "5e-3", "--batch-size", "10"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    log = json.loads((out / "train_log.json").read_text())
    losses = log["loss_per_epoch"]
    assert len(losses) == 4 and losses[-1] < 0.8 * losses[0], losses
    assert log["examples"] == {"pair": 20, "outcome": 20, "process": 20}
    engine = RewardModelEngine(out)
    try:
        prompts = [f"copy {a} {b} {c}" for a, b, c in [(1, 2, 3), (9, 8, 7), (0, 5, 5), (4, 4, 6)]]
        good = [engine.score(p, d) for p in prompts for d in "0134"]
        bad = [engine.score(p, d) for p in prompts for d in "5689"]
        assert min(good) > max(bad)  # it learned the rule, and the service's engine reads it
        steps = engine.score_steps("copy 1 2 3", ["2", "\n\n7", "\n\n1"])
        assert steps[0] > steps[1] < steps[2]
    finally:
        engine.close()


def test_bad_training_data_is_refused(base, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "p", "chosen": "a", "rejected": "b"}\n{"prompt": "p", "completion": "a", "label": 3}\n')
    with pytest.raises(SystemExit, match=r"bad.jsonl:2: not a pair"):
        train([data], base, tmp_path / "out")
    data.write_text('{"prompt": "p", "steps": ["a", "b"], "step_labels": [1]}\n')
    with pytest.raises(SystemExit, match=r"bad.jsonl:1"):
        train([data], base, tmp_path / "out")
    data.write_text("not json\n")
    with pytest.raises(SystemExit, match=r"bad.jsonl:1: not JSON"):
        train([data], base, tmp_path / "out")


def scored_group(i: int) -> common_pb2.RolloutGroup:
    g = rollout_group("toy.copy", "4", ["4", "5", "4 4"], prompt=f"copy {i} 2 4", group_id=f"job/s0/p{i}")
    for traj, value in zip(g.trajectories, [1.0, 0.0, 1.0]):
        traj.reward.CopyFrom(common_pb2.Reward(total=value - 0.1, status=common_pb2.REWARD_STATUS_OK, components=[
            common_pb2.RewardComponent(name="exact_answer", value=value, weight=1.0, status=common_pb2.REWARD_STATUS_OK),
            common_pb2.RewardComponent(name="rm", value=0.9, weight=0.5, status=common_pb2.REWARD_STATUS_OK),
            common_pb2.RewardComponent(name="length_penalty", value=-0.2, weight=1.0,
                                       status=common_pb2.REWARD_STATUS_OK)]))
    return g


def run_tests_trace(source: str, passed: int, tests: int) -> sandbox_pb2.ExecutionTrace:
    return sandbox_pb2.ExecutionTrace(
        execution_id=f"e{passed}", method="RunTests",
        verdict=sandbox_pb2.VERDICT_OK if passed == tests else sandbox_pb2.VERDICT_WRONG_ANSWER,
        run_tests_request=sandbox_pb2.RunTestsRequest(
            program=sandbox_pb2.ExecuteRequest(language="python3", files=[sandbox_pb2.SourceFile(content=source.encode())]),
            tests=[sandbox_pb2.TestCase(stdin=b"1\n", expected_stdout=b"1\n")] * tests),
        run_tests_response=sandbox_pb2.RunTestsResponse(passed=passed))


def test_records_from_what_the_system_produces():
    recs = records_from_group(scored_group(1))
    outcomes = [r for r in recs if "label" in r]
    assert [(r["completion"], r["label"]) for r in outcomes] == [("4", 1.0), ("5", 0.0), ("4 4", 1.0)]  # rm excluded
    pairs = [r for r in recs if "chosen" in r]
    assert pairs == [{"prompt": "copy 1 2 4", "chosen": "4", "rejected": "5"},
                     {"prompt": "copy 1 2 4", "chosen": "4 4", "rejected": "5"}]
    errored = scored_group(2)
    errored.trajectories[1].reward.status = common_pb2.REWARD_STATUS_ERROR
    assert not [r for r in records_from_group(errored) if r.get("completion") == "5" or r.get("rejected") == "5"]
    assert records_from_trace(run_tests_trace("print(1)", 3, 4)) == [{"prompt": "", "completion": "print(1)", "label": 0.75}]
    assert records_from_trace(sandbox_pb2.ExecutionTrace(method="Execute")) == []


def test_export_from_the_topics_then_train(broker, base, tmp_path):
    kafka.ensure_topics(broker)
    producer = kafka.ProtoProducer(broker, "test")
    for i in range(4):
        producer.send(kafka.SCORED, f"job/s0/p{i}", scored_group(i)).get(10)
    producer.send(kafka.SANDBOX_TRACES, "e1", run_tests_trace("print(1)", 1, 2)).get(10)
    producer.close()
    data = tmp_path / "exported.jsonl"
    counts = export(broker, data)
    assert counts == {"groups": 4, "traces": 1, "records": 4 * (3 + 2) + 1, "joined": 0, "unjoined": 0, "undecodable": 0}
    summary = train([data], base, tmp_path / "rm", epochs=1, batch_size=8, log=lambda _: None)
    assert summary["examples"] == {"pair": 8, "outcome": 13, "process": 0}
    engine = RewardModelEngine(tmp_path / "rm")
    try:
        assert 0.0 < engine.score("copy 1 2 4", "4") < 1.0
    finally:
        engine.close()
