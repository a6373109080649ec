"""`temper prm label` through the real inference service (tiny model, HF engine) and the real reward
service: labels produced, provenance present, budget respected; bad options refused before anything starts.

The toy verifier reads a completion's first word only, so whatever the (random) tiny policy writes
after a prefix, every rollout from a prefix whose first step is the answer is right and every one
from a prefix whose first step is wrong is wrong: the labels are known without knowing the policy.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from temper.cli.main import main
from temper.reward.dataset import records_from_group
from temper.tasks.toy import make_task
from temper.v1 import common_pb2
from tests.conftest import REPO

CONFIG = """
[job]
domains = ["toy.copy"]
max_tokens = 3
temperature = 1.0
[model]
preset = "tiny"
hidden_size = 64
layers = 1
heads = 2
[inference]
engine = "hf"
[reward.domains.toy]
weights = { exact_answer = 1.0 }
step_delimiter = " "
"""


def _temper(home, *args):
    return subprocess.run([sys.executable, "-m", "temper.cli.main", "--home", str(home), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=600)


def write_export(path, n: int) -> dict[str, str]:
    """``n`` exported toy.copy trajectories of 3 steps (words), half with the right first word; their ids -> kind."""
    groups, kinds = scored_groups(n)
    with open(path, "w") as f:
        for group in groups:
            for rec in records_from_group(group):
                f.write(json.dumps(rec) + "\n")
    return kinds


def scored_groups(n: int, jobs: tuple[str, ...] = ("job-x",)) -> tuple[list, dict[str, str]]:
    """``n`` scored toy.copy groups of one trajectory of 3 steps (words), half with the right first word, of
    the ``jobs`` in turn; and their trajectory ids -> kind."""
    rng = random.Random(0)
    kinds, groups = {}, []
    for i in range(n):
        task = make_task("toy.copy", rng, f"t{i}")
        right = i % 2 == 0
        first = task.reference_answer if right else str((int(task.reference_answer) + 1) % 10)
        ok = common_pb2.Reward(total=float(right), status=common_pb2.REWARD_STATUS_OK, components=[
            common_pb2.RewardComponent(name="exact_answer", value=float(right), weight=1.0,
                                       status=common_pb2.REWARD_STATUS_OK)])
        job = jobs[i % len(jobs)]
        groups.append(common_pb2.RolloutGroup(group_id=f"{job}/s0/p{i}", job_id=job, task=task, trajectories=[
            common_pb2.Trajectory(trajectory_id=f"{job}/s0/p{i}/0", completion_text=f"{first} 7 2",
                                  policy_version=2, finish_reason="length", reward=ok)]))
        kinds[f"{job}/s0/p{i}/0"] = "right" if right else "wrong"
    return groups, kinds


@pytest.mark.slow  # runs the `temper` command, which starts a broker, inference and reward
def test_labels_through_the_real_services(tmp_path):
    config = tmp_path / "job.toml"
    # the job budgets its labelling: no --k / --budget flag below
    config.write_text(CONFIG + "[job.step_labels]\nk = 3\nbudget = 20\n")
    export, out = tmp_path / "export.jsonl", tmp_path / "labels.jsonl"
    kinds = write_export(export, 6)
    # 3 steps -> 2 prefixes x k=3 = 6 rollouts a trajectory; a budget of 20 labels 3 of the 6
    r = _temper(tmp_path / "home", "--config", str(config), "prm", "label", "--from", str(export), "--out", str(out))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["labelled"] == 3 and summary["rollouts"] == 18 <= summary["budget"] == 20
    assert 18 <= summary["rollout_tokens"] <= 18 * 3  # max_tokens 3 each (EOS may end one at its first)
    assert summary["skipped"]["over_budget"] == 3 and summary["via"] == "services started for this command"
    assert summary["settings"] == {"k": 3, "budget": 20, "label": "soft", "threshold": 1.0, "min_steps": 2,
                                   "max_steps": 64, "delimiter": {"toy.copy": " "}}  # the [reward.domains.toy] split
    assert summary["settings_sources"]["budget"] == summary["settings_sources"]["k"] == "job.step_labels"
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 3
    for rec in records:
        assert rec["steps"][0] in (["0", "1", "2", "3", "4", "5", "6", "7", "8", "9"]) and rec["steps"][1:] == [" 7", " 2"]
        expected = [1.0, 1.0, 1.0] if kinds[rec["trajectory_id"]] == "right" else [0.0, 0.0, 0.0]
        assert rec["soft_labels"] == rec["step_labels"] == rec["hard_labels"] == expected
        prov = rec["provenance"]
        assert prov["job_id"] == "job-x" and prov["policy_version"] == 2 and prov["rollout_policy_version"] == 0
        assert (prov["verifier"], prov["k"], prov["delimiter"], prov["rollouts"]) == ("exact_answer", 3, " ", 6)
        assert (prov["budget"], prov["min_steps"], prov["max_steps"]) == (20, 2, 64)
    assert not (tmp_path / "home" / "state.json").exists()  # nothing of the command's own stack left in --home


def test_bad_options_are_refused_before_anything_starts(tmp_path, capsys):
    # in this process, in the fast tier: a refusal that started a service would fail the test (tests/conftest.py)
    config = tmp_path / "job.toml"
    config.write_text(CONFIG)
    export = tmp_path / "export.jsonl"
    write_export(export, 2)
    legacy = tmp_path / "legacy.jsonl"  # an export of before records carried their task
    legacy.write_text(json.dumps({"prompt": "copy 1 2 3", "completion": "3 4", "label": 1.0}) + "\n")
    for args, field in [(["--from", str(export), "--budget", "0"], "--budget"),
                        (["--from", str(export), "--k", "0"], "--k"),
                        (["--from", str(export), "--delimiter", "\\n"], "--delimiter"),  # no completion has one
                        (["--from", str(tmp_path / "missing.jsonl")], "--from"),
                        (["--from", str(legacy)], "--from"),
                        (["--from", "scored"], "--from scored: no running stack"),  # nothing up in --home
                        (["--from", str(export), "--from-job", "job-x"], "--from-job")]:
        rc = main(["--home", str(tmp_path / "home"), "--config", str(config), "prm", "label", *args,
                   "--out", str(tmp_path / "o" / "labels.jsonl")])
        err = capsys.readouterr().err
        assert rc == 1 and field in err, (field, err)
        assert not (tmp_path / "o").exists() and not (tmp_path / "home" / "state.json").exists()


@pytest.mark.slow  # runs the `temper` command: a broker, inference and reward, then trains a PRM
def test_grow_labels_trains_and_evaluates_a_prm(tmp_path):
    config = tmp_path / "job.toml"
    config.write_text(CONFIG + "[job.step_labels]\nbudget = 6\nthreshold = 0.5\n")  # --budget overrides the table's
    export, out = tmp_path / "export.jsonl", tmp_path / "grown"
    write_export(export, 8)
    r = _temper(tmp_path / "home", "--config", str(config), "prm", "grow", "--from", str(export), "--out", str(out),
                "--k", "2", "--budget", "32", "--heldout", "0.25", "--epochs", "2")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    result = json.loads((out / "grow.json").read_text())
    assert result["label"]["labelled"] == 8 and result["label"]["rollouts"] == 32
    assert (result["label"]["budget"], result["label"]["settings"]["threshold"]) == (32, 0.5)
    assert result["label"]["settings_sources"] == {"k": "flag --k", "budget": "flag --budget", "label": "default",
                                                   "threshold": "job.step_labels", "min_steps": "default",
                                                   "max_steps": "default", "delimiter": "default"}
    held = [json.loads(line) for line in (out / "heldout.jsonl").read_text().splitlines()]
    train = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    assert len(held) == 2 and len(train) == 6 and not {r["task_id"] for r in held} & {r["task_id"] for r in train}
    ev = result["eval"]
    assert ev["heldout_steps"] == 6 and 0.0 <= ev["step_accuracy"] <= 1.0
    assert ev["step_auc"] is None or 0.0 <= ev["step_auc"] <= 1.0
    assert len(result["train"]["loss_per_epoch"]) == 2
    assert (out / "prm" / "config.json").exists() and (out / "policy" / "config.json").exists()  # a PRM the service loads
    assert "temper reward load --prm" in result["register"]  # not asked to register: says how


def test_a_bad_step_labels_table_is_refused_before_anything_starts(tmp_path, capsys):
    export = tmp_path / "export.jsonl"
    write_export(export, 2)
    config = tmp_path / "job.toml"
    for table, field in [("budget = 0", "job.step_labels.budget: must be >= 1"),
                         ('label = "fuzzy"', "job.step_labels.label: one of soft, hard"),
                         ("rollouts = 4", "job.step_labels.rollouts: unknown key; allowed: k, budget,"),
                         ('delimiter = "\\n"', "job.step_labels.delimiter: '\\n' splits none")]:
        config.write_text(CONFIG + f"[job.step_labels]\n{table}\n")
        for command in ("label", "grow"):
            rc = main(["--home", str(tmp_path / "home"), "--config", str(config), "prm", command, "--from", str(export),
                       "--out", str(tmp_path / "o" / "out")])
            err = capsys.readouterr().err
            assert rc == 1 and field in err and "Traceback" not in err, (table, err)
    assert not (tmp_path / "o").exists() and not (tmp_path / "home" / "state.json").exists()


def test_grow_refuses_bad_options_before_anything_starts(tmp_path, capsys):
    config = tmp_path / "job.toml"
    config.write_text(CONFIG)
    export = tmp_path / "export.jsonl"
    write_export(export, 2)
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("")
    for args, field in [(["--base", str(tmp_path / "no-model")], "--base"),  # a PRM base that does not load
                        (["--heldout", "1.5"], "--heldout"), (["--epochs", "0"], "--epochs"),
                        (["--budget", "0"], "--budget"), (["--out", str(full)], "--out"),
                        (["--register"], "--register")]:  # no stack in --home to register with
        out = [] if args[0] == "--out" else ["--out", str(tmp_path / "grown")]
        rc = main(["--home", str(tmp_path / "home"), "--config", str(config), "prm", "grow", "--from", str(export),
                   *out, *args])
        err = capsys.readouterr().err
        assert rc == 1 and field in err, (field, err)
        assert not (tmp_path / "grown").exists() and not (tmp_path / "home" / "state.json").exists()


@pytest.mark.slow  # a running stack (broker, inference, reward), then the `temper` command grows a PRM into it
def test_grow_registers_the_prm_with_the_running_reward_service(tmp_path):
    from temper.client.sdk import RewardClient
    from temper.runtime.launcher import Launcher
    from tests.builders import rollout_group
    from tests.reward.conftest import component

    config = tmp_path / "job.toml"
    # the toy domain weighs the PRM before one exists (weight 0: kept in every reward, not in the total)
    config.write_text(CONFIG.replace("weights = { exact_answer = 1.0 }", "weights = { exact_answer = 1.0, prm = 0.0 }")
                      + "[reward.prm]\nload_later = true\n")
    export, out, home = tmp_path / "export.jsonl", tmp_path / "grown", tmp_path / "home"
    write_export(export, 8)
    launcher = Launcher(home=home, config=config)
    state = launcher.up(["inference", "reward"], timeout=300)
    try:
        address = state.services["reward"].address
        group = rollout_group("toy.copy", "4", ["4 7 2"], prompt="copy 4", tokens=1)
        with RewardClient(address) as reward:
            assert not reward.list_domains().process_reward_model_loaded
            assert component(reward.score(group).trajectories[0], "prm").status == common_pb2.REWARD_STATUS_ERROR
            r = _temper(home, "--config", str(config), "prm", "grow", "--from", str(export), "--out", str(out),
                        "--k", "2", "--budget", "32", "--epochs", "1", "--register")
            assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
            result = json.loads((out / "grow.json").read_text())
            assert result["label"]["via"] == f"the stack in {home}"  # labelled through the running stack too
            registered = result["register"]
            assert (registered["version"], registered["replaced"], registered["address"]) == (1, None, address)
            assert registered["model_dir"] == str((out / "prm").resolve()) == result["prm"]
            listing = reward.list_domains()  # the same service process, no restart
            assert listing.process_reward_model_loaded and listing.process_reward_model_dir == result["prm"]
            prm = component(reward.score(group).trajectories[0], "prm")
            assert prm.status == common_pb2.REWARD_STATUS_OK and prm.detail == "3 steps, min" and 0 <= prm.value <= 1
        assert launcher.load().services["reward"].pid == state.services["reward"].pid
    finally:
        launcher.down()


@pytest.mark.slow  # a running stack (broker, inference, reward); the job's groups on its scored topic
def test_labels_the_running_stacks_scored_topic(tmp_path):
    from temper.runtime import kafka
    from temper.runtime.launcher import Launcher

    config = tmp_path / "job.toml"
    config.write_text(CONFIG + "[job.step_labels]\nk = 2\nbudget = 64\n")
    home = tmp_path / "home"
    groups, kinds = scored_groups(6, jobs=("job-x", "job-x", "job-y"))  # two jobs' groups on the topic
    launcher = Launcher(home=home, config=config)
    state = launcher.up(["inference", "reward"], timeout=300)
    try:
        producer = kafka.ProtoProducer(state.kafka_bootstrap, "test-scheduler")
        for group in groups:
            producer.send(kafka.SCORED, group.group_id, group).get(30)
        producer.close()
        out = tmp_path / "labels.jsonl"
        r = _temper(home, "--config", str(config), "prm", "label", "--from", "scored", "--from-job", "job-x",
                    "--out", str(out))
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        summary = json.loads(r.stdout.strip().splitlines()[-1])
        assert summary["labelled"] == 4 and summary["via"] == f"the stack in {home}"  # job-x's four, not job-y's
        assert (tmp_path / "labels.export.jsonl").exists()
        for rec in (json.loads(line) for line in out.read_text().splitlines()):
            assert rec["job_id"] == "job-x"
            assert rec["soft_labels"] == ([1.0] * 3 if kinds[rec["trajectory_id"]] == "right" else [0.0] * 3)
    finally:
        launcher.down()
