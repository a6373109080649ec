"""A real job (tiny model, every real service) with curriculum and adaptive weights turned on in its TOML:
the scheduler learns each domain's outcomes from the `scored` stream and the job's status shows them."""

import json
import os
import subprocess
import sys

import pytest

from temper import jobs

pytestmark = pytest.mark.e2e
STEPS = 10
FLOOR = 0.05
SAMPLING = f"""
[job.sampling]
weights = {{ "toy.copy" = 2.0 }}

[job.sampling.curriculum]
domains = ["rg.chain_sum"]
window = 4

[job.sampling.adaptive]
window = 4
floor = {FLOOR}

"""


DYNAMIC = """
[job.sampling.dynamic_sampling]
max_refill_ratio = 1.0

[job.sampling.loss_weighting]
lagging = 1.0

"""


def run_job(tmp_path, sampling: str, domains: str = '["toy.copy", "toy.next", "rg.chain_sum"]',
            tables: str = "", stdout: list | None = None) -> dict:
    """`temper run` of the toy job over ``domains`` with ``sampling`` tables (and other ``tables`` appended to the
    file); its summary.json (its output appended to ``stdout``)."""
    text = jobs.path("toy").read_text()
    for old, new in (("steps = 150", f"steps = {STEPS}"), ('domains = ["toy.copy", "toy.next"]', f"domains = {domains}"),
                     ("size = 100", "size = 0"), ("\n[job.eval]\n", "\n" + sampling + "[job.eval]\n")):  # the table
        assert old in text
        text = text.replace(old, new, 1)
    text += tables
    config = tmp_path / "job.toml"
    config.write_text(text)
    proc = subprocess.run([sys.executable, "-m", "temper.cli.main", "--home", str(tmp_path / "home"),
                           "--config", str(config), "run", "--runs", str(tmp_path / "runs")],
                          capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if stdout is not None:
        stdout.append(proc.stdout)
    return json.loads((tmp_path / "runs" / "latest" / "summary.json").read_text())


def test_a_job_with_curriculum_and_adaptive_weights_reports_what_it_learned_per_domain(tmp_path):
    sampling = run_job(tmp_path, SAMPLING)["sampling"]
    by = {d["domain"]: d for d in sampling["domains"]}
    assert list(by) == ["toy.copy", "toy.next", "rg.chain_sum"]
    total = STEPS * 16
    # the scheduler learned every scored group once (the report waits for its consumer of `scored` to catch up)
    assert sampling["groups_scored"] == total
    assert sum(d["groups"] for d in by.values()) == sampling["groups_scored"]
    assert sum(d["drawn"] for d in by.values()) == total
    assert all(d["groups"] > 0 and d["trajectories"] == 8 * d["groups"] for d in by.values())
    assert all(0.0 <= d["pass_rate"] <= 1.0 for d in by.values())
    assert by["toy.copy"]["total_pass_rate"] > 0  # the tiny model answers some copies right
    # curriculum: chain_sum has a ladder (reasoning-gym's own) and, never solved, stays at its easiest level
    chain = by["rg.chain_sum"]
    assert chain["max_difficulty"] > 0 and chain["difficulty"] == 0 and chain["level_changes"] == 0
    assert json.loads(chain["difficulty_options"])["max_terms"] == 2
    assert chain["total_pass_rate"] == 0.0
    # adaptive weights: a distribution with every domain at or above the floor, and measured progress
    assert sum(d["weight"] for d in by.values()) == pytest.approx(1.0)
    assert all(d["weight"] >= FLOOR - 1e-9 for d in by.values())
    assert all(d["learning_progress"] >= 0 for d in by.values())
    assert chain["weight"] <= max(by["toy.copy"]["weight"], by["toy.next"]["weight"])


def test_dynamic_sampling_and_loss_weights_in_the_real_loop(tmp_path):
    learnability = SAMPLING.replace(f"floor = {FLOOR}\n", f'floor = {FLOOR}\nsignal = "learnability"\n')
    assert learnability != SAMPLING
    summary = run_job(tmp_path, learnability + DYNAMIC)
    sampling = summary["sampling"]
    by = {d["domain"]: d for d in sampling["domains"]}
    # the learner trained every step on a full batch: the scheduler published prompts_per_step groups per step
    assert len(summary["steps"]) == STEPS and all(s["samples"] == 16 * 8 for s in summary["steps"])
    # rg.chain_sum is never solved by the tiny model: its groups are all-zero, dropped and replaced
    dropped = sampling["zero_variance_groups_dropped"]
    assert dropped > 0 and by["rg.chain_sum"]["zero_variance_groups"] == by["rg.chain_sum"]["groups"] > 0
    assert sampling["refill_groups"] == dropped  # every dropped group was replaced by a fresh draw...
    assert sampling["groups_scored"] == STEPS * 16 + dropped  # ...and every scored one is accounted for
    assert sum(d["groups"] for d in by.values()) == sum(d["drawn"] for d in by.values()) == sampling["groups_scored"]
    # loss weights: the lagging domain's groups weigh more than the leading one's
    assert by["rg.chain_sum"]["loss_weight"] >= 1.0 >= min(by["toy.copy"]["loss_weight"], by["toy.next"]["loss_weight"])
    # learnability weights: chain_sum's groups never disagree (no GRPO signal): it is drawn at the floor only
    assert by["rg.chain_sum"]["learning_progress"] == 0.0
    assert by["rg.chain_sum"]["weight"] == pytest.approx(FLOOR)


def test_rm_confidence_with_a_real_reward_model_in_the_loop(tmp_path):
    """toy.next is rewarded by a learned reward model (a random tiny one, served by the reward service) with its
    exact-answer verifier kept at weight 0: the scheduler measures how far the RM's scores are from the verifier's
    (confidence = 1 - |rm - verifier mean| per group), and moves draw weight and loss weight away from it;
    toy.copy, rewarded by its verifier alone, has no RM and keeps its full weight."""
    from temper.reward.models import build_tiny_reward_model

    rm = build_tiny_reward_model(tmp_path / "rm", seed=1)
    tables = (f'\n[reward.rm]\ndir = "{rm}"\n\n'
              '[reward.domains."toy.next"]\nweights = { rm = 1.0, exact_answer = 0.0 }\n')
    summary = run_job(tmp_path, "[job.sampling.rm_confidence]\nwindow = 8\nmin_factor = 0.2\n\n",
                      '["toy.copy", "toy.next"]', tables)
    by = {d["domain"]: d for d in summary["sampling"]["domains"]}
    assert by["toy.copy"]["rm_confidence"] == -1.0  # no reward model: no confidence to weigh
    confidence = by["toy.next"]["rm_confidence"]
    assert 0.0 <= confidence < 0.99, confidence  # a random RM does not agree with the verifier
    # draw weight and loss weight scale by min_factor + (1 - min_factor) * confidence against toy.copy's
    factor = 0.2 + 0.8 * confidence
    assert by["toy.next"]["weight"] / by["toy.copy"]["weight"] == pytest.approx(factor, rel=1e-3)
    assert by["toy.next"]["loss_weight"] / by["toy.copy"]["loss_weight"] == pytest.approx(factor, rel=1e-3)
    samples = [s for step in summary["samples"].values() for s in step if s["domain"] == "toy.next"]
    assert samples and all("rm" in s["components"] and s["reward"] == s["components"]["rm"] for s in samples)


def test_a_domain_with_few_distinct_prompts_shows_its_repeats_and_is_warned_of(tmp_path):
    """A user dataset of four rows, drawn in about half of the job's 160 draws: every draw after a row's first
    repeats it. The job's summary counts them per domain, and the scheduler warns that the domain is being
    memorised."""
    rows = [{"q": f"copy {a} {a} {a}", "a": str(a)} for a in (1, 2, 3, 4)]
    (tmp_path / "four.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tables = ('\n[job.domain_config."data.four"]\npath = "four.jsonl"\nprompt_field = "q"\nanswer_field = "a"\n'
              'verifier = "exact_answer"\n')
    out: list[str] = []
    summary = run_job(tmp_path, "", '["data.four", "toy.copy"]', tables, out)
    by = {d["domain"]: d for d in summary["sampling"]["domains"]}
    four, copy = by["data.four"], by["toy.copy"]
    assert four["drawn"] + copy["drawn"] == STEPS * 16 and four["drawn"] > 8
    assert four["drawn"] - 4 <= four["repeated_prompts"] < four["drawn"]  # at most four first draws
    assert copy["repeated_prompts"] < copy["drawn"] / 4  # a thousand distinct prompts: few repeats
    log = (tmp_path / "home" / "logs" / "scheduler.log").read_text()
    warned = [json.loads(line) for line in log.splitlines() if '"training prompts repeat"' in line]
    assert [w["domain"] for w in warned] == ["data.four"], warned
    # and `temper run` says so at the end, naming that domain alone
    (line,) = [x for x in out[0].splitlines() if x.startswith("training prompts repeated")]
    assert f"data.four {four['repeated_prompts']}/{four['drawn']}" in line and "toy.copy" not in line
