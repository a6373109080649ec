"""Post-training side by side with TRL's GRPOTrainer: SmolLM2-135M-Instruct, the same wall-clock budget.

Both sides take everything from the shipped job ``services/temper/jobs/smollm2.toml``, read at
bench time: model folder, reasoning-gym families and their domain_config knobs, group size,
prompts per step, temperature, max tokens, chat template + the prefilled ``response_prefix``,
learning rate, clip range, grad-norm clip, epochs. The held-out problems are the job's own
(``JobSpec.eval_sets()``, i.e. temper.scheduler.evaluation.EvalSets, disjoint from training), and
TRL's training prompts are the ones Temper's scheduler draws for the same seed, in the same order
(the scheduler's draw loop replayed: rng.choice of a domain, then ``draw_training_task``).

Budget: ``TEMPER_BENCH_BUDGET_S`` seconds (default 1800, the issue's 30 minutes) of training loop,
start-up and the two evaluations outside it, on each side:
- TRL (tests/bench/trl_peer.py in the bench-only venv): from ``on_train_begin`` to the first step
  boundary past the budget (the step in flight at the budget completes and counts).
- Temper (``temper run``'s machinery: Launcher.up + StartJob on the job's JobSpec, steps set to the
  maximum, i.e. "steps large, stop at the budget"): from the end of the job's "before" evaluation;
  at the budget the job is stopped (StopJob: no new step starts), the learner step in flight
  completes (the first StepMetrics after the budget: TRL's step boundary) and the learner is then
  SIGKILLed, so nothing more is pushed; the serving policy is evaluated on the same held-out sets
  by temper.scheduler.evaluation.evaluate as the job's own evaluations are ([job.eval] samples,
  temperature and seed: pass@1 over that many answers per problem), through the same inference and
  reward services. With L >= 1 the rollouts generated ahead for the next
  step are lost (counted in Temper's generated tokens, never trained on).
One evaluator: TRL's trained weights are also scored by ``temper eval`` (Temper's evaluator: the same vLLM
engine, reward service, held-out sets and [job.eval] sampling as Temper's side), and the report's "x TRL"
column divides by TRL's gain by that evaluator (its own HF-generate figures are printed beside it).
Generated tokens/s: completion tokens generated during that window / its seconds (Temper: every
rollout the scheduler published before the stop; TRL: every completion the reward saw).
Steps instead of a budget: with ``TEMPER_BENCH_STEPS=N`` both sides train exactly N steps on the same prompts
(TRL: ``max_steps``; Temper: the job's ``steps``, its own "before" and final evaluations), so per-step learning
is compared apart from throughput; parts and report are suffixed ``-stepsN`` instead of ``-budgetB``.
Same batch: ``test_same_batch_update`` puts one real batch through both trainers for one step and compares the
gradients, the AdamW step and what each did to the batch's logprobs (the update rules, apart from the loop).

Parts (each a test, so each fits a run of its own): ``test_trl_side[seedS]`` and
``test_temper_side[seedS-lagL]`` write ``$TEMPER_BENCH_OUT/<part>-budget<B>.json`` (default
bench-results/trl/); ``test_report`` prints the table from the parts present for this budget and
writes ``trl_vs_temper-budget<B>.json``. Seeds: ``TEMPER_BENCH_SEEDS`` (default 0,3: the
README's seeds, so parts from earlier runs stay comparable; any seed runs); lags:
``TEMPER_BENCH_LAGS`` (default 0,1,2). Goal: Temper's gain >= 1.5x TRL's.
Run: ``make bench-peers`` once, then ``make bench`` (or ``pytest -s -m bench tests/bench/test_trl_bench.py``).
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from safetensors.torch import load_file

from temper import jobs
from temper.cli.plan import job_spec
from temper.learner.export import export_policy
from temper.reward.settings import RewardSettings
from temper.scheduler.core import MAX_STEPS
from temper.scheduler.evaluation import draw_training_task

ROOT = Path(__file__).resolve().parents[2]
TRL_VENV = Path(os.environ.get("TEMPER_TRL_VENV", "/work/bench-venvs/trl"))
TRL_PYTHON = TRL_VENV / "bin" / "python"
PEER = Path(__file__).with_name("trl_peer.py")
JOB = jobs.path("smollm2")
BUDGET_S = float(os.environ.get("TEMPER_BENCH_BUDGET_S", "1800"))
# > 0: both sides train exactly this many steps (the same prompts) instead of for BUDGET_S: per-step learning
# compared apart from throughput
STEPS = int(os.environ.get("TEMPER_BENCH_STEPS", "0"))
RUN = f"steps{STEPS}" if STEPS else f"budget{BUDGET_S:g}"  # the parts' and report's file-name suffix
SEEDS = [int(s) for s in os.environ.get("TEMPER_BENCH_SEEDS", "0,3").split(",") if s.strip()]
LAGS = [int(s) for s in os.environ.get("TEMPER_BENCH_LAGS", "0,1,2").split(",") if s.strip()]
OUT = Path(os.environ.get("TEMPER_BENCH_OUT", ROOT / "bench-results" / "trl"))
TRL_THREADS = os.environ.get("TEMPER_BENCH_TRL_THREADS", "2")  # the machine's 2 cores, to one process
TRL_BF16 = os.environ.get("TEMPER_BENCH_TRL_BF16", "0") == "1"  # off: fp32 generates 2x faster on this CPU
# held-out problems per domain: the job's eval.size unless set (a smaller set is a prefix of the job's:
# the same seeded draws); for quick runs of the bench only
EVAL_SIZE = int(os.environ.get("TEMPER_BENCH_EVAL_SIZE", "0"))
# start-up, two evaluations and the step in flight, on top of the budget (steps: at most 90 s each)
SIDE_TIMEOUT = (STEPS * 90 if STEPS else BUDGET_S) + 1800


def _job_table() -> dict:
    with open(JOB, "rb") as f:
        return tomllib.load(f)


def _model_dir() -> Path:
    raw = os.environ.get("TEMPER_SMOLLM2_DIR") or _job_table()["model"]["dir"]
    path = Path(raw)
    return path if path.is_absolute() else ROOT / path


needs_model = pytest.mark.skipif(not (_model_dir() / "config.json").exists(),
                                 reason=f"no SmolLM2 folder at {_model_dir()} (make setup converts it; "
                                        "TEMPER_SMOLLM2_DIR names another)")
needs_trl = pytest.mark.skipif(not (TRL_VENV / ".installed").exists(),
                               reason=f"no TRL bench venv at {TRL_VENV} (make bench-peers creates it)")


def _part(name: str) -> Path:
    return OUT / f"{name}-{RUN}.json"


def _spec(seed: int, lag: int):
    """The shipped job's JobSpec, as `temper run --seed` builds it, with this lag and steps to spare."""
    table = dict(_job_table()["job"], max_policy_lag=lag)
    if EVAL_SIZE:
        table["eval"] = dict(table.get("eval", {}), size=EVAL_SIZE)
    return job_spec(table, JOB, steps=STEPS or MAX_STEPS, seed=seed)


def _config_text(seed: int, lag: int) -> str:
    """The shipped job file with the model folder absolute and [job] seed/lag/steps set (services read
    their job-derived settings from it; the job itself is submitted as ``_spec``)."""
    text = JOB.read_text()
    for pattern, new in ((r'(?m)^dir = ".*"$', f'dir = "{_model_dir()}"'), (r"(?m)^seed = \d+", f"seed = {seed}"),
                         (r"(?m)^max_policy_lag = \d+", f"max_policy_lag = {lag}"),
                         (r"(?m)^steps = \d+", f"steps = {STEPS or MAX_STEPS}")):
        text, n = re.subn(pattern, new, text, count=1)
        assert n == 1, f"{JOB}: no line matching {pattern}"
    return text


def _task(t) -> dict:
    return {"prompt": t.prompt, "domain": t.domain, "metadata": dict(t.metadata)}


def training_tasks(spec, eval_sets, steps: int) -> list:
    """The prompts Temper's scheduler draws for ``spec`` (Job.run_step's loop), ``steps`` steps of them."""
    rng = random.Random(spec.seed)
    out = []
    for step in range(steps):
        for i in range(spec.prompts_per_step):
            domain = rng.choice(spec.domains)
            task, _ = draw_training_task(domain, rng, f"bench/s{step}/p{i}", spec.domain_config.get(domain), eval_sets)
            out.append(task)
    return out


def repeat_counts(tasks) -> dict:
    """Per domain, the training prompts drawn and how many of them repeat an earlier one (as the scheduler's
    ``repeated_prompts`` counts them): a domain whose few problems a side trains on again and again."""
    out: dict[str, dict[str, int]] = {}
    seen: set[str] = set()
    for t in tasks:
        d = out.setdefault(t.domain, {"drawn": 0, "repeated": 0})
        d["drawn"] += 1
        d["repeated"] += t.prompt in seen
        seen.add(t.prompt)
    return out


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else 0.0


# -- TRL --------------------------------------------------------------------------------------------
def trl_side(tmp: Path, seed: int) -> dict:
    spec = _spec(seed, 0)
    eval_sets = spec.eval_sets()
    learner = _job_table().get("learner", {})
    # TRL cannot take more steps than the budget allows at 2 s a step (measured: ~15 s on this machine)
    train = training_tasks(spec, eval_sets, STEPS or int(BUDGET_S / 2) + 10)
    peer_spec = {
        "model_dir": str(_model_dir()), "seed": seed, "budget_s": 1e9 if STEPS else BUDGET_S, "max_steps": STEPS,
        "work_dir": str(tmp / "trl-out"),
        "save_dir": str(tmp / "trl-weights"),
        "group_size": spec.group_size, "prompts_per_step": spec.prompts_per_step, "temperature": spec.temperature,
        "max_tokens": spec.max_tokens, "eval_max_tokens": spec.eval.max_tokens or spec.max_tokens,
        "eval_samples": spec.eval.samples, "eval_temperature": spec.eval.temperature, "eval_seed": spec.eval.seed,
        "response_prefix": spec.response_prefix, "bf16": TRL_BF16, "lr": learner.get("lr", 1e-5),
        "clip_low": learner.get("clip_low", 0.2), "clip_high": learner.get("clip_high", 0.28),
        "max_grad_norm": learner.get("max_grad_norm", 1.0), "epochs": learner.get("epochs", 1),
        "warmup_steps": learner.get("warmup_steps", 0),
        "reward_weights": rg_reward_weights(),
        "train": [_task(t) for t in train],
        "eval": [_task(t) for ts in eval_sets.sets.values() for t in ts],
    }
    assert spec.chat_template, "the job's prompts are chat turns; the peer renders them the same way"
    assert learner.get("lr_schedule", "constant") == "constant", "the peer ramps the lr as a constant schedule does"
    (tmp / "trl-spec.json").write_text(json.dumps(peer_spec))
    env = {**os.environ, "OMP_NUM_THREADS": TRL_THREADS, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": ""}
    t0 = time.monotonic()
    log = tmp / "trl.log"  # the peer's progress, step by step (tail -f it)
    print(f"\nTRL side: {len(train)} training prompts, {len(peer_spec['eval'])} held-out; log: {log}", flush=True)
    with open(log, "w") as f:
        proc = subprocess.run([str(TRL_PYTHON), str(PEER), str(tmp / "trl-spec.json"), str(tmp / "trl-result.json")],
                              stdout=f, stderr=subprocess.STDOUT, timeout=SIDE_TIMEOUT, env=env)
    assert proc.returncode == 0, f"TRL side failed ({proc.returncode}): {log.read_text()[-5000:]}"
    result = json.loads((tmp / "trl-result.json").read_text())
    result["total_seconds"] = time.monotonic() - t0
    result["eval_problems_per_domain"] = spec.eval.size
    result["training_prompts"] = repeat_counts(train[:result["steps"] * spec.prompts_per_step])
    # one evaluator for both sides: the base model and TRL's trained weights scored as Temper's side is; the
    # weights go into a folder with the base folder's config and tokenizer (this venv's transformers reads
    # those), as the learner exports a policy
    weights = {n: t for f in sorted((tmp / "trl-weights").glob("*.safetensors")) for n, t in load_file(f).items()}
    trained = tmp / "trl-final"
    export_policy(weights, _model_dir(), trained, dtype="float32")  # as TRL trained and saved them
    before, after = (temper_evaluator(tmp, seed, m, name) for m, name in ((_model_dir(), "base"), (trained, "trl")))
    result["eval_temper_evaluator"] = {
        "before": before, "after": after,
        "gain": {d: after["accuracy"][d] - before["accuracy"][d] for d in before["accuracy"]}}
    return result


PEER_COMPONENTS = ("reasoning_gym", "reasoning_gym.exact")  # the reward components trl_peer.reward computes


def _job_reward_settings() -> RewardSettings:
    """The job's ``[reward]`` as the reward service reads it (its domain tables over the service's defaults)."""
    return RewardSettings(**_job_table().get("reward", {}))


def rg_reward_weights() -> dict[str, float]:
    """The reward weights of the job's domains, which the peer reproduces: one table for all of them (the peer
    takes one), in which only the components it computes carry a weight."""
    settings = _job_reward_settings()
    tables = {d: settings.domain_spec(d)[1].weights for d in _spec(0, 0).domains}
    weights = next(iter(tables.values()))
    assert all(w == weights for w in tables.values()), f"the TRL peer takes one reward table for all domains: {tables}"
    other = {c: w for c, w in weights.items() if w and c not in PEER_COMPONENTS}
    assert not other, f"the TRL peer computes {PEER_COMPONENTS} only; the job also weighs {other}"
    return {c: w for c, w in weights.items() if c in PEER_COMPONENTS}


def temper_evaluator(tmp: Path, seed: int, model: Path, name: str) -> dict:
    """``temper eval`` of ``model`` on the job's held-out sets, as the Temper side's evaluations score (the
    same inference engine, reward service, [job.eval] samples, temperature and seed)."""
    spec = _spec(seed, 0)
    config = tmp / f"eval-{name}.toml"
    config.write_text(_config_text(seed, 0))
    out = tmp / f"eval-{name}.json"
    cmd = [str(Path(sys.executable).with_name("temper")), "eval", "--config", str(config), "--home", str(tmp / "eval-home"),
           "--model", str(model), "--size", str(spec.eval.size), "--seed", str(spec.eval.seed), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, f"temper eval of {model} failed: {proc.stderr[-3000:]}"
    result = json.loads(out.read_text())
    print(f"Temper's evaluator, {name}: {result['accuracy']}", flush=True)
    return {k: result[k] for k in ("accuracy", "samples", "temperature", "seconds", "generated_tokens")}


def _evaluate_served(state, spec, eval_sets, job_id: str):
    """The serving policy on the held-out sets, as the job's own evaluations (its "before" included) score:
    [job.eval] samples, temperature and seed, through the stack's inference and reward services."""
    from temper.client.sdk import InferenceClient, RewardClient
    from temper.scheduler.evaluation import evaluate

    with InferenceClient(state.services["inference"].address) as inference, \
            RewardClient(state.services["reward"].address) as reward:
        inference.timeout = reward.timeout = 1200

        def answer(prompts, max_tokens, n, temperature, seed):
            return inference.generate(prompts, n=n, temperature=temperature, max_tokens=max_tokens, seed=seed,
                                      apply_chat_template=spec.chat_template, assistant_prefix=spec.response_prefix)

        return evaluate(eval_sets, answer, reward.score, spec.eval.max_tokens or spec.max_tokens, "final",
                        job_id=job_id, response_prefix=spec.response_prefix, samples=spec.eval.samples,
                        temperature=spec.eval.temperature, seed=spec.eval.seed)


# -- Temper -----------------------------------------------------------------------------------------
def temper_side(tmp: Path, seed: int, lag: int) -> dict:
    from kafka import KafkaConsumer
    from kafka.structs import TopicPartition

    from temper.client.sdk import SchedulerClient
    from temper.runtime import kafka
    from temper.runtime.launcher import Launcher
    from temper.v1 import common_pb2, scheduler_pb2

    config = tmp / f"smollm2-seed{seed}-lag{lag}.toml"
    config.write_text(_config_text(seed, lag))
    spec = _spec(seed, lag)
    eval_sets = spec.eval_sets()
    launcher = Launcher(home=tmp / f"home-seed{seed}-lag{lag}", config=config)
    t0 = time.monotonic()
    state = launcher.up(timeout=600)
    up_seconds = time.monotonic() - t0
    try:
        consumer = KafkaConsumer(bootstrap_servers=state.kafka_bootstrap, group_id=None, enable_auto_commit=False,
                                 fetch_max_wait_ms=100, max_partition_fetch_bytes=64 << 20)
        tp_metrics, tp_rollouts = TopicPartition(kafka.METRICS, 0), TopicPartition(kafka.ROLLOUTS, 0)
        consumer.assign([tp_metrics, tp_rollouts])
        consumer.seek_to_end(tp_metrics, tp_rollouts)
        consumer.position(tp_metrics)
        consumer.position(tp_rollouts)
        scheduler = SchedulerClient(state.services["scheduler"].address)
        job_id = scheduler.start_job(spec.to_proto()).job_id
        steps: dict[int, common_pb2.StepMetrics] = {}
        generated: list[tuple[int, int]] = []  # (created_unix_ms, completion tokens) per rollout group
        t_train = t_budget = t_stop = stop_unix_ms = t_last = None
        status = None
        deadline = time.monotonic() + SIDE_TIMEOUT
        while True:
            assert time.monotonic() < deadline, f"Temper job {job_id}: no end after {SIDE_TIMEOUT:.0f}s"
            for part, records in consumer.poll(timeout_ms=200).items():
                for r in records:
                    if part == tp_rollouts:
                        g = common_pb2.RolloutGroup.FromString(r.value)
                        if g.job_id == job_id:
                            generated.append((g.created_unix_ms, sum(len(t.completion_token_ids) for t in g.trajectories)))
                    else:
                        m = common_pb2.StepMetrics.FromString(r.value)
                        if m.job_id == job_id and m.step not in steps:
                            steps[m.step] = m
                            t_last = time.monotonic()
                            print(f"temper L={lag} step {m.step} reward {m.mean_reward:.3f} v{m.policy_version} "
                                  f"{m.seconds:.1f}s", flush=True)
                            if t_budget is not None:  # the step in flight at the budget is in: stop here
                                t_stop = time.monotonic()
            if t_budget is not None and t_stop is None and time.monotonic() - t_budget > SIDE_TIMEOUT / 2:
                t_stop = time.monotonic()  # no step came after the budget (none was in flight)
            if t_stop is not None:
                launcher.stop_service("learner", kill=True)  # nothing more is trained or pushed
                stop_unix_ms = int(time.time() * 1000)
                break
            if t_budget is not None:
                continue
            status = scheduler.job(job_id)
            if STEPS and status.state == scheduler_pb2.JOB_STATE_DONE:  # its steps and its own final evaluation
                t_stop, stop_unix_ms = t_last, int(time.time() * 1000)  # training ended with the last step
                break
            assert status.state not in (scheduler_pb2.JOB_STATE_FAILED, scheduler_pb2.JOB_STATE_STOPPED), status.error
            if t_train is None and status.evals:
                t_train = time.monotonic()  # the "before" evaluation is in: training starts now
            if not STEPS and t_train is not None and time.monotonic() - t_train >= BUDGET_S:
                scheduler.stop_job(job_id)  # no new step starts; the learner step in flight completes
                t_budget = time.monotonic()
        before = status.evals[0]
        scheduler.close()
        consumer.close()
        if STEPS:  # the job's own final evaluation: the same evaluator, sampling and seed as its "before"
            after = status.evals[-1]
            assert before.phase == "before" and after.phase == "final", status.evals
        else:
            after = _evaluate_served(state, spec, eval_sets, job_id)
    finally:
        launcher.down()
    wall = t_stop - t_train
    tokens = sum(n for ms, n in generated if ms <= stop_unix_ms)
    trained = [steps[k] for k in sorted(steps)]

    def ev(e) -> dict:
        return {"accuracy": dict(e.accuracy), "policy_version": e.policy_version, "problems": e.problems,
                "seconds": e.seconds, "generated_tokens": e.generated_tokens}

    return {
        "side": "temper", "seed": seed, "max_policy_lag": lag, "budget_s": BUDGET_S, "train_seconds": wall,
        "up_seconds": up_seconds, "steps": len(trained), "step_seconds": [m.seconds for m in trained],
        "completions": sum(m.samples for m in trained), "rollout_groups": len(generated),
        "generated_tokens": tokens, "generated_tokens_per_s": tokens / wall,
        "mean_reward_per_step": [m.mean_reward for m in trained],
        "sample_lag_max": max((m.policy_version - 1 - m.min_sample_policy_version for m in trained), default=0),
        "eval": {"before": ev(before), "after": ev(after),
                 "gain": {d: after.accuracy[d] - before.accuracy[d] for d in before.accuracy}},
        "eval_problems_per_domain": spec.eval.size, "total_seconds": time.monotonic() - t0,
        "training_prompts": {d.domain: {"drawn": d.drawn, "repeated": d.repeated_prompts} for d in status.domains},
    }


def _save(name: str, result: dict) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    _part(name).write_text(json.dumps(result, indent=2))
    acc = result["eval"]
    print(f"\n{name}: held-out {_mean(acc['before']['accuracy'].values()):.3f} -> "
          f"{_mean(acc['after']['accuracy'].values()):.3f} in {result['steps']} steps, "
          f"{result['train_seconds']:.0f}s, {result['generated_tokens_per_s']:.1f} generated tok/s; "
          f"training prompts repeated: {_repeats(result)}; {_part(name)}")


def _repeats(result: dict) -> str:
    counts = result.get("training_prompts", {})
    return ", ".join(f"{d} {c['repeated']}/{c['drawn']}" for d, c in sorted(counts.items())) or "not recorded"


def _check(result: dict) -> None:
    ev = result["eval"]
    assert result["steps"] >= 1 and result["generated_tokens"] > 0, result
    assert set(ev["before"]["accuracy"]) == set(ev["after"]["accuracy"]) == set(_spec(0, 0).domains)
    assert all(0.0 <= a <= 1.0 for e in (ev["before"], ev["after"]) for a in e["accuracy"].values())
    if STEPS:
        assert result["steps"] == STEPS, result["steps"]  # exactly the steps asked, on both sides
    else:
        assert result["train_seconds"] >= BUDGET_S  # trained for the whole budget


@pytest.mark.bench
@needs_model
@needs_trl
@pytest.mark.timeout(SIDE_TIMEOUT + 300)
@pytest.mark.parametrize("seed", SEEDS, ids=lambda s: f"seed{s}")
def test_trl_side(tmp_path, seed):
    result = trl_side(tmp_path, seed)
    _check(result)
    assert result["eval"]["before"]["problems"] == len(_spec(seed, 0).domains) * result["eval_problems_per_domain"]
    _save(f"trl-seed{seed}", result)


@pytest.mark.bench
@needs_model
@pytest.mark.timeout(SIDE_TIMEOUT + 300)
@pytest.mark.parametrize("lag", LAGS, ids=lambda v: f"lag{v}")
@pytest.mark.parametrize("seed", SEEDS, ids=lambda s: f"seed{s}")
def test_temper_side(tmp_path, seed, lag):
    result = temper_side(tmp_path, seed, lag)
    _check(result)
    assert result["sample_lag_max"] <= lag
    _save(f"temper-seed{seed}-lag{lag}", result)


def test_the_peer_pays_what_the_reward_service_pays():
    """TRL's reward is Temper's for the job's domains: the same total on the reference answer, a partial-credit
    answer (the reference with a digit appended, which reasoning-gym's default scorer pays in part), a wrong
    one and one without tags, under the shipped job's [reward.domains.rg] weights."""
    from temper.reward.core import Scorer
    from tests.bench.trl_peer import reward
    from tests.builders import rollout_group

    spec = _spec(0, 0)
    weights = rg_reward_weights()
    scorer = Scorer(_job_reward_settings())
    try:
        for task in training_tasks(spec, spec.eval_sets(), 1):
            ref = task.reference_answer
            texts = [f"<answer>{ref}</answer>", f"<answer>{ref}0</answer>", "<answer>x</answer>", ref]
            scored = scorer.score_group(rollout_group(task.domain, ref, texts, metadata=dict(task.metadata)))
            ours = [t.reward.total for t in scored.trajectories]
            peer = [reward(weights, dict(task.metadata), "", text, True) for text in texts]
            assert peer == pytest.approx(ours, abs=1e-9), (task.domain, ref, texts, ours, peer)
            assert ours[0] == 1.0 and ours[2:] == [0.0, 0.0]
    finally:
        scorer.close()


def test_the_peer_ramps_the_lr_as_the_learner_does():
    """TRL's optimiser under the job's [learner] warm-up takes the learning rate Temper's learner takes at every update
    (the peer runs in TRL's venv and imports nothing of Temper, so its ramp is pinned to ``lr_factor`` here)."""
    import torch

    from temper.learner.schedules import lr_factor
    from tests.bench.trl_peer import warmed_up

    learner = _job_table()["learner"]
    warmup, lr = learner.get("warmup_steps", 0), learner["lr"]
    assert warmup > 0, "the shipped job ramps its lr; a job without warm-up leaves TRL's optimiser its own"
    optimizer, scheduler = warmed_up(torch.nn.Linear(2, 2), {"lr": lr, "warmup_steps": warmup})
    for k in range(warmup + 3):
        assert optimizer.param_groups[0]["lr"] == pytest.approx(lr * lr_factor(k, "constant", warmup, 0, 0.0)), k
        optimizer.step()
        scheduler.step()
    assert warmed_up(torch.nn.Linear(2, 2), {"lr": lr, "warmup_steps": 0}) == (None, None)


# -- the same batch through both update rules -------------------------------------------------------
def same_batch(groups: int = 8, signal: int = 6, seed: int = 0) -> tuple[list[dict], dict]:
    """A real first step's batch: the job's first training prompts (seed 0), ``group_size`` answers each sampled
    from the base model by HF generate at the job's temperature (as TRL's side samples), scored by the
    reasoning-gym reward as the job weighs it; ``signal`` groups whose rewards differ, the rest all-equal (no
    learning signal, but their tokens count in both losses' denominators, as in a real step)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.bench.trl_peer import _eos_ids, reward

    spec = _spec(seed, 0)
    tokenizer = AutoTokenizer.from_pretrained(_model_dir())
    model = AutoModelForCausalLM.from_pretrained(_model_dir(), dtype=torch.float32).eval()
    eos = set(_eos_ids(model, tokenizer))  # as TRL's side cuts its answers
    weights = rg_reward_weights()  # as both sides pay them
    torch.manual_seed(seed)
    with_signal, without = [], []
    for task in training_tasks(spec, spec.eval_sets(), 8):
        text = tokenizer.apply_chat_template([{"role": "user", "content": task.prompt}], add_generation_prompt=True,
                                             tokenize=False) + spec.response_prefix
        ids = tokenizer(text, add_special_tokens=False).input_ids
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), do_sample=True, temperature=spec.temperature, top_p=1.0, top_k=0,
                                 num_return_sequences=spec.group_size, max_new_tokens=spec.max_tokens,
                                 pad_token_id=tokenizer.pad_token_id)
        completions, rewards = [], []
        for row in out[:, len(ids):].tolist():
            cut = next((i for i, t in enumerate(row) if t in eos), None)
            completions.append(row if cut is None else row[:cut + 1])  # the EOS is a trained token on both sides
            rewards.append(reward(weights, dict(task.metadata), spec.response_prefix,
                                 tokenizer.decode(row[:cut] if cut is not None else row, skip_special_tokens=True),
                                 cut is not None))
        group = {"prompt_ids": ids, "completions": completions, "rewards": rewards, "domain": task.domain}
        (with_signal if len(set(rewards)) > 1 else without).append(group)
        if len(with_signal) >= signal and len(without) >= groups - signal:
            break
    chosen = with_signal[:signal] + without[:groups - signal]
    chosen += with_signal[signal:signal + groups - len(chosen)]  # too few without a signal: more with one
    return chosen, {"signal_groups": sum(len(set(g["rewards"])) > 1 for g in chosen), "groups": len(chosen)}


def _norm(a: dict) -> float:
    """L2 norm of a set of tensors, as one flat vector."""
    return sum(float(t.double().square().sum()) for t in a.values()) ** 0.5


def _cos(a: dict, b: dict) -> float:
    """Cosine of two sets of tensors (same names), as one flat vector each."""
    dot = sum(float((a[n].double() * b[n].double()).sum()) for n in a)
    na, nb = _norm(a), _norm(b)
    return dot / (na * nb) if na and nb else float("nan")


@pytest.mark.bench
@needs_model
@needs_trl
@pytest.mark.timeout(1800)
def test_same_batch_update(tmp_path):
    """One batch, one step, both trainers: do Temper's learner and TRL's GRPOTrainer (configured as the
    comparison configures it: DAPO token-mean loss, group-scaled advantages, the job's lr, clip range and
    grad-norm clip, beta 0, one epoch, fp32) make the same update? Both start from the base weights and take
    the batch on-policy (ratio 1: Temper's behaviour logprobs are its own, as TRL's with one iteration).
    Compared: the grad norm before clipping, the clipped gradients and the AdamW step (cosine over every
    parameter), and what each step did to the batch -- the advantage-weighted change of the token logprobs
    (the surrogate the loss climbs). Known difference: TRL's group std has Bessel's correction (Temper's
    does not), so its advantages are sqrt((k-1)/k) of Temper's (k = group size; 0.935 at 8): a scale, which
    clipping at max_grad_norm removes when both norms exceed it and AdamW's first step nearly ignores."""
    import torch

    from temper.learner.algos import grpo_advantages
    from temper.learner.batching import Batch
    from temper.learner.trainer import Trainer, TrainerConfig

    groups, info = same_batch()
    assert info["signal_groups"] >= 2, info
    spec = _spec(0, 0)
    learner = _job_table()["learner"]
    cfg = TrainerConfig(**{k: v for k, v in learner.items() if k in TrainerConfig.model_fields})
    trainer = Trainer(_model_dir(), cfg)
    base = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    prompts = [g["prompt_ids"] for g in groups for _ in g["completions"]]
    completions = [c for g in groups for c in g["completions"]]
    rewards = [r for g in groups for r in g["rewards"]]
    n = len(completions)
    batch = Batch(prompts, completions, torch.zeros(sum(map(len, completions))), torch.full((n,), spec.temperature),
                  torch.tensor(rewards, dtype=torch.float32),
                  torch.tensor([i for i, g in enumerate(groups) for _ in g["completions"]]),
                  torch.zeros(n, dtype=torch.long),
                  [g["domain"] for g in groups for _ in g["completions"]], "same-batch")
    batch.old_logprobs = trainer.token_logprobs(batch).detach().float().cpu()  # on-policy: ratio 1
    before = batch.old_logprobs.clone()
    metrics = trainer.step(batch)
    temper_grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    temper_delta = {n: p.detach() - base[n] for n, p in trainer.model.named_parameters()}
    temper_after = trainer.token_logprobs(batch).detach().float().cpu()

    peer = {"model_dir": str(_model_dir()), "work_dir": str(tmp_path / "trl-out"), "lr": learner["lr"],
            "clip_low": learner["clip_low"], "clip_high": learner["clip_high"],
            "max_grad_norm": learner["max_grad_norm"], "temperature": spec.temperature, "groups": groups,
            "grads_out": str(tmp_path / "trl-grads.safetensors"), "weights_out": str(tmp_path / "trl-weights.safetensors")}
    (tmp_path / "spec.json").write_text(json.dumps(peer))
    env = {**os.environ, "OMP_NUM_THREADS": TRL_THREADS, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": "", "TRL_EXPERIMENTAL_SILENCE": "1"}
    proc = subprocess.run([str(TRL_PYTHON), str(PEER), "--one-step", str(tmp_path / "spec.json"),
                           str(tmp_path / "out.json")], capture_output=True, text=True, timeout=1200, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    trl = json.loads((tmp_path / "out.json").read_text())
    assert trl["handed"] == n, trl  # TRL trained on exactly the batch's sequences
    trl_grads = load_file(tmp_path / "trl-grads.safetensors")
    trl_weights = load_file(tmp_path / "trl-weights.safetensors")
    trl_delta = {n: trl_weights[n] - base[n] for n in base}
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            p.copy_(trl_weights[name])
    trl_after = trainer.token_logprobs(batch).detach().float().cpu()

    # the surrogate each step climbed: sum over tokens of A * (logp_after - logp_before) / tokens, with
    # Temper's advantages (the same for both: only the direction of the step is compared)
    adv = grpo_advantages(batch.rewards, batch.group_index).repeat_interleave(batch.lengths)
    gain_t = float((adv * (temper_after - before)).mean())
    gain_r = float((adv * (trl_after - before)).mean())
    report = {
        "batch": {**info, "sequences": n, "tokens": int(batch.lengths.sum()), "mean_reward": sum(rewards) / n},
        "grad_norm": {"temper": metrics["grad_norm"], "trl": trl["logs"].get("grad_norm"),
                      "clip_at": learner["max_grad_norm"]},
        "cos_clipped_grads": _cos(temper_grads, {k: trl_grads[k] for k in temper_grads}),
        "cos_update": _cos(temper_delta, trl_delta),
        "update_norm_ratio": _norm(temper_delta) / _norm(trl_delta),
        "surrogate_gain": {"temper": gain_t, "trl": gain_r, "ratio": gain_t / gain_r if gain_r else None},
        "logprob_change_mean_abs": {"temper": float((temper_after - before).abs().mean()),
                                    "trl": float((trl_after - before).abs().mean())},
        "after_vs_after_max_abs": float((temper_after - trl_after).abs().max()),
        "trl_loss": trl["logs"].get("loss"), "trl_adamw": trl["adamw"], "trl_versions": trl["versions"],
        "temper_adamw": {k: trainer.optimizer.param_groups[0][k] for k in ("lr", "betas", "eps", "weight_decay")},
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "same_batch_update.json").write_text(json.dumps(report, indent=2))
    print("\nsame batch, one step:", json.dumps(report, indent=2))
    assert report["cos_clipped_grads"] > 0.99, report
    assert report["cos_update"] > 0.95, report
    assert 0.9 < report["surrogate_gain"]["ratio"] < 1.1, report


@pytest.mark.bench
def test_report():
    """The table of every part present for this budget (or step count), with the gain ratios; the JSON next to it."""
    parts = {p.name.removesuffix(f"-{RUN}.json"): json.loads(p.read_text())
             for p in sorted(OUT.glob(f"*-{RUN}.json")) if p.name.startswith(("trl-seed", "temper-seed"))}
    trl = [r for k, r in parts.items() if k.startswith("trl-")]
    if not trl or len(parts) == len(trl):
        pytest.skip(f"no TRL and Temper parts for {RUN} in {OUT} (run the side tests first)")

    def gain(r, key: str = "eval") -> float:
        return _mean(r[key]["gain"].values())

    # one evaluator: TRL's weights scored by Temper's (as Temper's side is) when every TRL part has that
    one = all("eval_temper_evaluator" in r for r in trl)
    trl_rows = [("TRL GRPOTrainer", "eval_temper_evaluator" if one else "eval", trl)]
    if one:
        trl_rows.append(("TRL, own evaluator", "eval", trl))
    rows = trl_rows + [(f"Temper L={lag}", "eval", [r for k, r in parts.items()
                                                    if k.startswith("temper-") and r["max_policy_lag"] == lag])
                       for lag in sorted({r["max_policy_lag"] for k, r in parts.items() if k.startswith("temper-")})]
    trl_gain = _mean(gain(r, trl_rows[0][1]) for r in trl)
    domains = list(trl[0]["eval"]["before"]["accuracy"])
    per_run = f"{STEPS} steps" if STEPS else f"budget {BUDGET_S:g}s"
    print(f"\nSmolLM2-135M-Instruct, {JOB.name}: {', '.join(domains)}; {per_run} of training per run; "
          f"held-out pass@1 over {trl[0]['eval']['before'].get('samples', 1)} answers (mean over domains, "
          f"{trl[0]['eval_problems_per_domain']} problems each); TRL's weights scored by "
          + ("Temper's evaluator (vLLM + the reward service, as Temper's side), its own HF generate evaluator on the "
             "second row" if one else "its own HF generate evaluator"))
    print(f"  {'':<20}{'seeds':>6}{'before':>8}{'after':>8}{'gain':>8}{'x TRL':>7}{'steps':>7}{'gen tok/s':>10}")
    report = {"budget_s": None if STEPS else BUDGET_S, "steps": STEPS or None, "job": str(JOB), "domains": domains,
              "one_evaluator": one, "rows": {}}
    for name, key, rs in rows:
        if not rs:
            continue
        g = _mean(gain(r, key) for r in rs)
        ratio = g / trl_gain if trl_gain > 0 else None
        row = {"seeds": [r["seed"] for r in rs], "evaluator": "temper" if key != "eval" or name.startswith("Temper")
               else "trl (HF generate)",
               "before": _mean(_mean(r[key]["before"]["accuracy"].values()) for r in rs),
               "after": _mean(_mean(r[key]["after"]["accuracy"].values()) for r in rs),
               "gain": g, "gain_per_seed": [gain(r, key) for r in rs], "ratio_to_trl": ratio,
               "steps": _mean(r["steps"] for r in rs),
               "generated_tokens_per_s": _mean(r["generated_tokens_per_s"] for r in rs),
               "per_domain_gain": {d: _mean(r[key]["gain"][d] for r in rs) for d in domains}}
        report["rows"][name] = row
        print(f"  {name:<20}{len(rs):>6}{row['before']:8.3f}{row['after']:8.3f}{g:+8.3f}"
              f"{(f'{ratio:6.2f}x' if ratio is not None else '    n/a'):>7}{row['steps']:7.1f}"
              f"{row['generated_tokens_per_s']:10.1f}")
    if trl_gain <= 0:
        print(f"  (TRL's mean gain is {trl_gain:+.3f}: no ratio)")
    path = OUT / f"trl_vs_temper-{RUN}.json"
    path.write_text(json.dumps({**report, "parts": parts}, indent=2))
    print(f"  written: {path}")
    assert all(0.0 <= row["before"] <= 1.0 for row in report["rows"].values())
