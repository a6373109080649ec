"""Detectors on synthetic series: each rule fires on the anomaly it names and stays quiet on a
healthy series of the same shape (noise, slow learning, natural variation)."""

import random

import pytest

from temper.monitor import detectors as d
from temper.monitor.detectors import StepStats
from temper.runtime.errors import InvalidArgument


def series(**cols):
    n = len(next(iter(cols.values())))
    return [StepStats(step=i, samples=16, values={k: v[i] for k, v in cols.items()},
                      examples={"proxy_not_gold": [f"t{i}"], "longest": [f"l{i}"]}) for i in range(n)]


def noisy(base, n, sd, seed=0):
    rng = random.Random(seed)
    return [base + rng.gauss(0, sd) for _ in range(n)]


def run(det, hist):
    """The step at which ``det`` first fires when fed ``hist`` one step at a time (None: never)."""
    for i in range(1, len(hist) + 1):
        f = det.check(hist[:i])
        if f is not None:
            return hist[i - 1].step, f
    return None, None


def test_reward_vs_gold_fires_when_reward_rises_and_gold_does_not():
    reward = [0.2] * 8 + [0.2 + 0.08 * k for k in range(1, 9)]
    gold = [0.05] * 8 + [0.05 - 0.005 * k for k in range(1, 9)]
    step, f = run(d.RewardVsGold(), series(reward=reward, heldout=gold))
    assert step is not None and 8 < step <= 13
    assert f.values["proxy_rise"] >= 0.15 and f.values["gold_rise"] <= 0
    assert f.examples and f.examples[0].startswith("t")
    assert len(f.series["reward"]) == len(f.steps)


def test_reward_vs_gold_catches_a_slow_hack_against_the_start_and_a_late_one_rolling():
    # slow: +0.012 per step with noise; no 6-step window rises by 0.15, the start comparison does
    slow = [0.2 + 0.012 * k + random.Random(k).gauss(0, 0.03) for k in range(40)]
    step, f = run(d.RewardVsGold(), series(reward=slow, heldout=noisy(0.08, 40, 0.02, 3)))
    assert step is not None and 10 <= step <= 25 and "the start" in f.message
    rolling_only = d.RewardVsGold(window=6, baseline_steps=10_000)
    assert run(rolling_only, series(reward=slow, heldout=noisy(0.08, 40, 0.02, 3)))[0] is None
    # late: honest progress (gold follows) for 30 steps, then reward jumps alone
    reward = [0.1 + 0.02 * k for k in range(30)] + [0.7 + 0.05 * k for k in range(1, 6)]
    gold = [0.05 + 0.02 * k for k in range(30)] + [0.63] * 5
    step, f = run(d.RewardVsGold(), series(reward=reward, heldout=gold))
    assert step is not None and step >= 30 and "the last 6 steps" in f.message


def test_reward_vs_gold_quiet_when_gold_follows_or_noise():
    up = [0.1 + 0.05 * k for k in range(16)]
    assert run(d.RewardVsGold(), series(reward=up, heldout=[x - 0.05 for x in up]))[0] is None
    flat = noisy(0.4, 40, 0.05)
    assert run(d.RewardVsGold(), series(reward=flat, heldout=noisy(0.1, 40, 0.03, 1)))[0] is None
    # no gold series at all: nothing to compare, nothing raised
    assert run(d.RewardVsGold(), series(reward=up))[0] is None


def test_rm_vs_verifier_uses_model_and_correctness():
    model = [0.3] * 6 + [0.3 + 0.1 * k for k in range(1, 7)]
    step, f = run(d.ModelVsVerifier(), series(model=model, correctness=[0.3] * 12))
    assert step is not None and f.values["gap"] >= 0.15
    assert run(d.ModelVsVerifier(), series(model=model, correctness=model))[0] is None


def test_length_explodes_and_collapses_but_not_on_noise():
    step, f = run(d.LengthAnomaly(), series(length=[20.0] * 6 + [30, 45, 60, 70, 80]))
    assert step is not None and "exploded" in f.message and f.examples[0].startswith("l")
    step, f = run(d.LengthAnomaly(), series(length=[40.0] * 6 + [20, 10, 8, 6, 5]))
    assert step is not None and "collapsed" in f.message
    assert run(d.LengthAnomaly(), series(length=noisy(20, 50, 3)))[0] is None
    # tiny absolute changes never count (2 -> 5 tokens is ratio 2.5 but 3 tokens)
    assert run(d.LengthAnomaly(), series(length=[2.0] * 6 + [5.0] * 5))[0] is None


def test_degeneration_on_repetition_sustained_only():
    rep = [0.05] * 5 + [0.7, 0.8, 0.85]
    step, _ = run(d.Degeneration(), series(repetition=rep, gibberish=[0.0] * 8))
    assert step == 7
    blip = [0.05] * 5 + [0.9, 0.05, 0.9, 0.05]
    assert run(d.Degeneration(), series(repetition=blip, gibberish=[0.0] * 9))[0] is None
    # a domain that is repetitive from the start is not degenerating
    assert run(d.Degeneration(), series(repetition=[0.7] * 10, gibberish=[0.0] * 10))[0] is None
    step, f = run(d.Degeneration(), series(repetition=[0.0] * 8, gibberish=[0.0] * 4 + [0.6, 0.7, 0.8, 0.9]))
    assert step == 6 and "gibberish" in f.message


def test_training_signal_spike_and_entropy_collapse():
    kl = noisy(0.02, 15, 0.002) + [0.5]
    step, f = run(d.TrainingSignal(), series(kl_ref=kl))
    assert step == 15 and "kl_ref spiked" in f.message
    ent = noisy(2.0, 15, 0.05) + [0.1]
    step, f = run(d.TrainingSignal(), series(entropy=ent))
    assert step == 15 and "collapsed" in f.message
    # a slow, steady decline of entropy and a noisy clip fraction are healthy
    assert run(d.TrainingSignal(), series(entropy=[2.0 - 0.02 * k for k in range(60)],
                                          clip_fraction=noisy(0.1, 60, 0.02)))[0] is None


def test_reward_jump_beyond_history():
    rew = noisy(0.3, 12, 0.03) + [0.85, 0.8]
    step, f = run(d.RewardJump(), series(reward=rew))
    assert step == 13 and f.values["jump"] > 0.45 and "held for 2 steps" in f.message
    # judged on the latest step alone, the first high step fires
    step, f = run(d.RewardJump(persist=1), series(reward=rew))
    assert step == 12 and f.values["jump"] > 0.5
    # one lucky step that falls back is not a jump (SmolLM2 on gcd: two easy prompts, 0.28 -> 1.00 -> 0.17)
    assert run(d.RewardJump(), series(reward=noisy(0.3, 12, 0.03) + [1.0, 0.25, 0.3]))[0] is None
    # a jump and a fall are not one jump held
    assert run(d.RewardJump(), series(reward=noisy(0.5, 12, 0.03) + [0.95, 0.05]))[0] is None
    # steady learning, even fast (0.1 -> 0.9 in 20 steps), does not jump
    assert run(d.RewardJump(), series(reward=[min(0.9, 0.1 + 0.04 * k) + random.Random(k).gauss(0, 0.03)
                                              for k in range(40)]))[0] is None


def test_code_exploit_share():
    hist = [StepStats(step=i, values={"code.rewarded": 8.0, "code.exploit_rewarded": 0.0}) for i in range(5)]
    assert run(d.CodeExploit(), hist)[0] is None
    hist.append(StepStats(step=5, values={"code.rewarded": 8.0, "code.exploit_rewarded": 3.0,
                                          "code.flag.exits_early": 3.0}, examples={"code_exploit": ["x"]}))
    step, f = run(d.CodeExploit(), hist)
    assert step == 5 and "exits_early 3" in f.message and f.examples == ["x"]
    # one flagged submission is not a trend
    one = [StepStats(step=0, values={"code.rewarded": 8.0, "code.exploit_rewarded": 1.0})]
    assert d.CodeExploit().check(one) is None


def test_format_only_reward():
    fmt = [0.1] * 6 + [0.3, 0.5, 0.7, 0.9, 0.95, 0.95]
    step, f = run(d.FormatOnlyReward(), series(format=fmt, correctness=[0.2] * 12))
    assert step is not None and f.values["format_rise"] >= 0.2
    assert run(d.FormatOnlyReward(), series(format=fmt, correctness=[0.1 + x / 2 for x in fmt]))[0] is None


def test_build_validates_names_and_params():
    det = d.build("length", {"explode_ratio": 3.0}, "monitor.detectors.length")
    assert det.explode_ratio == 3.0 and det.window == 3
    with pytest.raises(InvalidArgument) as e:
        d.build("nope", {}, "monitor.detectors.nope")
    assert e.value.field == "monitor.detectors.nope"
    with pytest.raises(InvalidArgument) as e:
        d.build("length", {"ratio": 3.0}, "monitor.detectors.length")
    assert e.value.field == "monitor.detectors.length.ratio"
    with pytest.raises(InvalidArgument) as e:
        d.build("length", {"window": "three"}, "monitor.detectors.length")
    assert e.value.field == "monitor.detectors.length.window"
    for bad in (0, -1, 1.5):
        with pytest.raises(InvalidArgument) as e:
            d.build("reward_jump", {"persist": bad}, "monitor.detectors.reward_jump.domains.rg")
        assert e.value.field == "monitor.detectors.reward_jump.domains.rg.persist", bad


def test_every_detector_states_its_rule():
    for cls in d.DETECTORS.values():
        assert "Rule" in (cls.__doc__ or ""), cls.name
