"""The capacity model's recurrence, plan search and calibration fit, on hand-worked numbers."""

from __future__ import annotations

import json
import math

import pytest
from pydantic import ValidationError

from temper.capacity.calibrate import _line, fit, measure_run
from temper.capacity.model import Allocation, CapacitySpec, Cluster, Costs, Workload, generate_seconds, plan, predict

# generate 1.0 s (10 iterations x (0.02 + 0.01 x 8 seqs)), score 0.4 s, store 0.1 s, train 0.5 + push 0.1 s
COSTS = Costs(iteration_seconds=0.02, seq_seconds=0.01, learner_tokens_per_second=100.0, push_seconds=0.1,
              reward_group_seconds=0.1, replay_group_seconds=0.025, gpus_per_inference_replica=1)
WORK = Workload(prompts_per_step=4, group_size=2, prompt_tokens=0, completion_tokens=10, mean_completion_tokens=6.25)


def test_lag_zero_runs_the_stages_one_after_another():
    p = predict(COSTS, WORK, Allocation())
    t = p.stages
    assert (t.generate, t.score, t.store, t.train, t.push) == pytest.approx((1.0, 0.4, 0.1, 0.5, 0.1))
    # generation, then the scoring stream, then the last group's store (0.1 / 4), then train and push
    assert p.step_seconds == pytest.approx(1.0 + 0.4 + 0.025 + 0.5 + 0.1)
    assert p.bottleneck == "generate"
    assert p.busy["generate"] == pytest.approx(1.0 / 2.025)


def test_a_lag_overlaps_generation_with_training():
    # lag L: generation of step k waits for version k - 1 - L, so the whole chain (2.025 s) may span L + 1
    # steps, and no stage can go faster than its own work: max(chain / (L + 1), slowest stage)
    lag1 = predict(COSTS, WORK.model_copy(update={"max_policy_lag": 1}), Allocation())
    assert lag1.step_seconds == pytest.approx(2.025 / 2)
    p = predict(COSTS, WORK.model_copy(update={"max_policy_lag": 2}), Allocation())
    assert p.step_seconds == pytest.approx(1.0)
    assert p.busy["generate"] == pytest.approx(1.0)
    # training the bottleneck: 2.0 s per step whatever the lag
    slow = COSTS.model_copy(update={"learner_tokens_per_second": 20.0})  # 50 tokens -> 2.5 s + push
    assert predict(slow, WORK.model_copy(update={"max_policy_lag": 3}), Allocation()).step_seconds == pytest.approx(2.6)
    assert predict(slow, WORK.model_copy(update={"max_policy_lag": 3}), Allocation()).bottleneck == "train"


def test_replicas_split_the_stage_work():
    a = Allocation(inference_replicas=2, reward_replicas=2, learner_ranks=2)
    t = predict(COSTS, WORK, a).stages
    assert t.generate == pytest.approx(10 * (0.02 + 0.01 * 4))   # 2 prompts x 2 samples each
    assert t.score == pytest.approx(0.2)
    assert t.train == pytest.approx(50 / (100 * 2 * 0.9))        # one doubling of ranks at 0.9
    assert t.push == pytest.approx(0.2)                          # sequential: one push per replica
    assert predict(COSTS.model_copy(update={"push_mode": "broadcast"}), WORK, a).stages.push == pytest.approx(0.1)


def test_waves_of_max_num_seqs():
    c = COSTS.model_copy(update={"max_num_seqs": 3})   # 8 sequences: waves of 3, 3, 2
    assert generate_seconds(c, WORK, 1) == pytest.approx(10 * (0.02 + 0.03) * 2 + 10 * (0.02 + 0.02))


def test_code_groups_wait_for_sandbox_slots():
    w = WORK.model_copy(update={"code_fraction": 0.5, "executions_per_sample": 2})  # 2 groups x 2 x 2 = 8 runs
    c = COSTS.model_copy(update={"sandbox_seconds": 0.3})
    t = predict(c, w, Allocation(sandbox_slots=2)).stages
    assert t.detail["sandbox"] == pytest.approx(8 * 0.3 / 2)
    assert t.score == pytest.approx(1.2)   # the busier of reward (0.4) and sandbox (1.2)
    with pytest.raises(ValueError, match="sandbox_slots"):
        predict(c, w, Allocation(sandbox_slots=0))


def test_plan_balances_the_cluster():
    w = WORK.model_copy(update={"prompts_per_step": 64, "max_policy_lag": 1, "code_fraction": 1.0})
    c = COSTS.model_copy(update={"sandbox_seconds": 0.05})
    best = plan(c, w, Cluster(gpus=8, cpu_cores=64))
    a = best.allocation
    assert a.gpus(c) == 8 and a.cores() == 64
    every = [predict(c, w, Allocation(inference_replicas=r, learner_ranks=8 - r, reward_replicas=64 - s,
                                      sandbox_slots=s)).step_seconds for r in range(1, 8) for s in range(1, 64)]
    assert best.step_seconds == pytest.approx(min(every), rel=0.02)
    with pytest.raises(ValueError, match="gpus"):
        plan(c, w, Cluster(gpus=1, cpu_cores=8))


def test_spec_names_bad_fields():
    base = {"costs": COSTS.model_dump(), "workload": WORK.model_dump()}
    with pytest.raises(ValidationError, match="cluster"):
        CapacitySpec.model_validate(base)
    with pytest.raises(ValidationError, match="prompts_per_step"):
        CapacitySpec.model_validate({**base, "workload": {**WORK.model_dump(), "prompts_per_step": 0},
                                     "cluster": {"gpus": 8, "cpu_cores": 8}})
    with pytest.raises(ValidationError, match="gpu_count"):
        CapacitySpec.model_validate({**base, "cluster": {"gpu_count": 8, "gpus": 8, "cpu_cores": 8}})


def test_line_fit_recovers_the_parts():
    assert _line([(1, 3.0), (2, 5.0), (4, 9.0)]) == pytest.approx((1.0, 2.0))
    assert _line([(2, 4.0), (2, 6.0)]) == pytest.approx((0.0, 2.5))   # one batch size: all per unit


def _run(tmp_path, name: str, prompts: int, gen_s: float, train_s: float, interval: float, replicas: int = 1):
    """A run folder and home as `temper run` leaves them, with spans of the given durations."""
    home = tmp_path / name / "home"
    (home / "logs").mkdir(parents=True)
    ns = 1_000_000_000
    spans: dict[str, list] = {"scheduler": [], "inference": [], "learner": [], "reward": [], "replay": []}

    def span(service, name, trace, start, seconds, **kw):
        spans[service].append({"name": name, "context": {"trace_id": trace, "span_id": "0x1"}, "kind": kw.get("kind"),
                               "start_time_unix_nano": int(start * ns), "end_time_unix_nano": int((start + seconds) * ns),
                               "attributes": kw.get("attributes", {}), "links": kw.get("links", [])})

    steps = []
    for k in range(8):
        trace, t0 = f"0xs{k}", 100 + k * interval
        span("scheduler", "scheduler.step", trace, t0, 0.1, attributes={"temper.job_id": name, "temper.step": k})
        span("inference", "/temper.v1.InferenceService/Generate", trace, t0, gen_s, kind="SERVER")
        for _ in range(prompts):
            span("reward", "consume rollouts", trace, t0 + gen_s, 0.01)
            span("replay", "consume scored", trace, t0 + gen_s, 0.002)
            span("replay", "consume scored", "0xother", t0, 5.0)   # another job's: left out
        span("learner", "learner.step", f"0xl{k}", t0, interval, links=[{"context": {"trace_id": trace}}])
        span("learner", "/temper.v1.InferenceService/UpdateWeights", f"0xl{k}", t0 + interval - 0.05, 0.05)
        steps.append({"step": k + 1, "samples": prompts * 2, "values": {"tokens": prompts * 2 * 10.0,
                      "input_tokens": prompts * 2 * 14.0, "train_seconds": train_s}})
    for service, rows in spans.items():
        (home / "logs" / f"{service}.spans.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / name / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({
        "home": str(home), "steps": steps,
        "job": {"job_id": name, "prompts_per_step": prompts, "group_size": 2, "max_tokens": 10, "max_policy_lag": 0},
        "config": {"learner": {"epochs": 1}, "inference": {"replicas": replicas}}}))
    return run


def test_fit_on_runs_then_predict_another(tmp_path):
    # generation 0.1 + 0.01 x seqs per iteration x 10; training 0.2 + tokens / 1000
    small = _run(tmp_path, "a", 4, 10 * (0.1 + 0.01 * 8), 0.2 + 112 / 1000, interval=3.0)
    large = _run(tmp_path, "b", 16, 10 * (0.1 + 0.01 * 32), 0.2 + 448 / 1000, interval=6.0)
    runs = [measure_run(small), measure_run(large)]
    assert runs[0].step_interval == pytest.approx(3.0) and runs[0].store == pytest.approx([0.002] * 24)
    costs = fit(runs)
    assert (costs.iteration_seconds, costs.seq_seconds) == pytest.approx((0.1, 0.01))
    assert (costs.train_step_seconds, costs.learner_tokens_per_second) == pytest.approx((0.2, 1000.0))
    assert costs.push_seconds == pytest.approx(0.05) and costs.reward_group_seconds == pytest.approx(0.01)
    # what the stages leave of the intervals (about 0.8 and 0.9 s): the overhead
    assert 0.7 < costs.step_overhead_seconds < 1.0
    # a batch of 8 prompts, not fitted on: between the two
    mid = predict(costs, runs[0].workload.model_copy(update={"prompts_per_step": 8}), runs[0].allocation)
    assert 3.0 < mid.step_seconds < 6.0 and not math.isnan(mid.step_seconds)


def test_a_run_too_short_is_refused(tmp_path):
    run = _run(tmp_path, "a", 4, 1.0, 0.5, 2.0)
    summary = json.loads((run / "summary.json").read_text())
    summary["steps"] = summary["steps"][:3]
    (run / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(ValueError, match="steps"):
        measure_run(run)


def test_enough_replicas_keep_up_with_the_step():
    w = WORK.model_copy(update={"code_fraction": 1.0})   # 8 runs of 0.3 s; reward 0.4 s of work
    c = COSTS.model_copy(update={"sandbox_seconds": 0.3})
    p = predict(c, w, Allocation(sandbox_slots=16, reward_replicas=4))
    # step: generate 1.0 + score max(0.1, 0.15) + store 0.025 + train 0.6 = 1.775 s
    assert p.step_seconds == pytest.approx(1.775)
    assert p.enough == {"reward_replicas": 1, "sandbox_slots": 2, "replay_shards": 1}   # 2.4 / 1.775 -> 2


def test_the_shipped_cluster_example_plans():
    from pathlib import Path
    import tomllib

    spec = CapacitySpec.model_validate(tomllib.loads(
        (Path(__file__).parents[2] / "deploy" / "capacity" / "7b-code-64gpu.toml").read_text()))
    p = plan(spec.costs, spec.workload, spec.cluster)
    assert p.allocation.gpus(spec.costs) == 64 and p.allocation.cores() == 512
    assert p.bottleneck in ("generate", "train") and p.step_seconds > 0
