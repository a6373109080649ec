"""A job on the user's own dataset files, as `temper run` runs it: real processes, real broker, the tiny model.

Two JSONL files written here are the job's only domains, each with its own verifier (exact_answer; math,
which the ``data`` domain's default spec does not weigh), and a fifth of each held out for evaluation. The
tasks the stream scored came from the files' training rows, carry the row's answer, and were scored by the
declared verifier alone; the evaluation drew only held-out rows.
"""

import json
import os
import random
import subprocess
import sys

import pytest

from temper.tasks import data

pytestmark = pytest.mark.e2e

STEPS = 4


def rows(word: str, pick, seed: int) -> list[dict]:
    rng = random.Random(seed)
    triples = sorted({tuple(rng.randint(0, 9) for _ in range(3)) for _ in range(200)})[:40]
    return [{"prompt": f"{word} {a} {b} {c}", "answer": str(pick(a, b, c)), "id": i}
            for i, (a, b, c) in enumerate(triples)]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("dataset-job")
    files = {"max": rows("max", max, 1), "min": rows("min", min, 2)}
    for name, content in files.items():
        (base / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in content))
    (base / "job.toml").write_text(f"""
[job]
steps = {STEPS}
prompts_per_step = 4
group_size = 4
domains = ["data.max", "data.min"]
max_tokens = 2

[job.domain_config."data.max"]
path = "max.jsonl"
prompt_field = "prompt"
answer_field = "answer"
verifier = "exact_answer"
eval_fraction = 0.2

[job.domain_config."data.min"]
path = "min.jsonl"
prompt_field = "prompt"
answer_field = "answer"
verifier = "math"
eval_fraction = 0.2

[job.eval]
size = 4

[model]
preset = "tiny"

[inference]
engine = "hf"

[reward.math]
answer_format = "auto"   # the tiny model answers with a bare number
""")
    runs = base / "runs"
    proc = subprocess.run([sys.executable, "-m", "temper.cli.main", "--home", str(base / "home"), "run", "--config",
                           str(base / "job.toml"), "--runs", str(runs), "--job-timeout", "600"],
                          capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          cwd=base.parent)  # not the job file's folder: the paths are taken from the file's
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # which rows are held out is a function of the file alone (the smallest hashes of the prompts)
    held_out = {r.prompt for name in files for r in data.load(f"data.{name}", {
        "path": str(base / f"{name}.jsonl"), "prompt_field": "prompt", "answer_field": "answer",
        "verifier": "exact_answer", "eval_fraction": 0.2}).held_out}
    assert len(held_out) == 16
    return files, held_out, json.loads((runs / "latest" / "summary.json").read_text())


def test_the_tasks_come_from_the_training_rows_and_the_declared_verifier_scores_them(run):
    files, held_out, summary = run
    assert len(summary["steps"]) == STEPS
    samples = [s for step in summary["samples"].values() for s in step]
    assert len(samples) >= STEPS and {s["domain"] for s in samples} <= {"data.max", "data.min"}
    for s in samples:
        name = s["domain"].removeprefix("data.")
        answers = {r["prompt"]: r["answer"] for r in files[name]}
        assert s["prompt"] in answers and s["reference"] == answers[s["prompt"]]
        assert s["prompt"] not in held_out
        verifier = {"max": "exact_answer", "min": "math"}[name]
        assert list(s["components"]) == [verifier], s
        if verifier == "exact_answer":  # the first word of the completion against the row's answer
            words = s["completion"].split()
            assert s["reward"] == float(bool(words) and words[0] == s["reference"]), s
    domains_rewarded = {d for step in summary["steps"] for d in step["domain_mean_reward"]}
    assert domains_rewarded == {"data.max", "data.min"}  # the seeded draws train both


def test_the_evaluation_scores_both_datasets(run):
    _, _, summary = run
    ev = summary["eval"]
    assert set(ev["before"]["accuracy"]) == {"data.max", "data.min"} and ev["problems_per_domain"] == 4
    assert set(ev["after"]["accuracy"]) == {"data.max", "data.min"}
