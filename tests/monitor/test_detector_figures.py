"""Every detector fires on its planted anomalies and stays quiet on clean streams: the scripted streams of
``tests.monitor.figures`` at a few seeds (``make bench`` runs many: tests/bench/test_detector_figures.py),
and real runs' recorded steps (tests/monitor/data) replayed through every detector with its defaults."""

import copy
import random

import pytest

from temper.monitor import detectors as det
from tests.monitor import figures as F

SEEDS = 6


@pytest.mark.parametrize("scenario", F.SCENARIOS, ids=lambda s: f"{s.detector}:{s.anomaly.split(':')[0][:24]}")
def test_detector_fires_on_its_planted_anomaly_and_not_on_clean_streams(scenario):
    fig = F.evaluate(scenario, SEEDS)
    assert fig.detection_rate >= 5 / 6, fig.row()
    assert fig.max_delay is not None and fig.max_delay <= 8, fig.row()
    # the scripted clean streams: at most one step in a hundred where the rule holds
    assert fig.false_alarms_per_100 <= 1.0, fig.row()


def test_every_detector_has_a_scenario():
    assert {s.detector for s in F.SCENARIOS} == set(det.DETECTORS)


def test_a_clean_scripted_stream_has_the_noise_of_a_real_step():
    series = F.scored_stream(random.Random(0), samples=64)
    rewards = [s.values["reward"] for s in series]
    diffs = [b - a for a, b in zip(rewards, rewards[1:])]
    assert 0.02 < (sum(d * d for d in diffs) / len(diffs)) ** 0.5 < 0.15  # binomial noise of 64 samples
    assert all(s.samples == 64 for s in series)


# What the real runs' replay shows, with the defaults: (run, detector, series) -> steps at which the rule held.
# The README's monitor section reports these; a change here is a change of that table.
KNOWN_REAL_ALARMS = {
    # the tiny model on the sound demonstration job pads its answers with repeated digits ("5 5 5 5 5 5");
    # both demonstration jobs turn degeneration off for toy.* for that reason
    ("toy-hack-demo-sound", "degeneration", "scored:all"): [64, 85, 86, 87, 96, 100, 101, 102, 119, 120],
    ("toy-hack-demo-sound", "degeneration", "scored:toy.copy"): list(range(100, 121)),
    ("toy-hack-demo-sound", "degeneration", "scored:toy.next"): list(range(83, 97)),
    # a healthy run whose clip fraction rose from ~0.01 to 0.1: the one false alarm on a real run
    ("toy-steps", "training_signal", "metrics:*"): [34],
}


@pytest.mark.parametrize("run", sorted(F.REAL_RUNS))
def test_real_clean_runs_raise_only_the_known_alarms(run):
    found = {(r.run, r.detector, r.series): r.fired for r in F.replay_real(run) if r.fired}
    assert found == {k: v for k, v in KNOWN_REAL_ALARMS.items() if k[0] == run}


def test_the_smollm2_run_is_read_by_the_metric_and_reward_detectors():
    figs = {(r.detector, r.series): r for r in F.replay_real("smollm2")}
    assert figs[("training_signal", "metrics:*")].readable and figs[("training_signal", "metrics:*")].steps == 12
    for domain in ("rg.basic_arithmetic", "rg.letter_counting", "rg.products"):
        assert figs[("reward_jump", f"scored:{domain}")].readable
    for name in ("length", "degeneration", "format_only", "reward_jump"):
        assert figs[(name, "scored:all")].readable
    # no held-out verifier, no RM, no code domain in this job: those rules have nothing to read
    assert not figs[("reward_vs_gold", "scored:all")].readable
    assert not figs[("code_exploit", "scored:all")].readable


@pytest.mark.parametrize("key,factor", [("clip_fraction", 4.0), ("approx_kl", 8.0), ("entropy", 3.0),
                                        ("entropy", 0.05)])
def test_training_signal_fires_on_an_anomaly_planted_in_the_real_smollm2_steps(key, factor):
    series = copy.deepcopy(F.real_series(F.load_run("smollm2"))[("metrics", "*")])
    series[9].values[key] *= factor  # learner step 10
    fired = F.firings(det.TrainingSignal(), series)
    assert fired and fired[0] == 10


def test_reward_jump_fires_on_a_jump_planted_in_a_real_domain():
    series = copy.deepcopy(F.real_series(F.load_run("smollm2"))[("scored", "rg.letter_counting")])
    for s in series[8:]:
        s.values["reward"] += 0.4  # from learner step 9 on
    assert F.firings(det.RewardJump(), series)[:1] == [10]  # held for persist = 2 steps: the second high one


def test_length_fires_on_an_explosion_planted_in_the_real_samples():
    series = copy.deepcopy(F.real_series(F.load_run("smollm2"))[("scored", "all")])
    for s in series[8:]:
        s.values["length"] *= 4
    fired = F.firings(det.LengthAnomaly(), series)
    assert fired and 9 <= fired[0] <= 11


def test_a_higher_abs_floor_silences_the_toy_steps_clip_alarm():
    """The README's trade-off: abs_floor 0.015 (a job's [monitor.detectors.training_signal] table) quiets it."""
    figs = F.replay_real("toy-steps", {"training_signal": {"abs_floor": 0.015}})
    assert not [r for r in figs if r.fired]


def test_reward_jump_judged_on_one_step_alarms_on_a_lucky_draw_of_the_sound_smollm2_job():
    """Why reward_jump waits for persist = 2 steps: on the sound real-model demonstration job, two easy gcd
    prompts drawn into one step took that domain's mean from 0.28 to 1.00, and it fell back to 0.17 the
    step after. Judged on one step (persist = 1) that is the run's one alarm; held for two, it is none."""
    fired = {(r.detector, r.series): r.fired for r in F.replay_real("smollm2-hack-demo-sound",
                                                                   {"reward_jump": {"persist": 1}}) if r.fired}
    assert fired == {("reward_jump", "scored:rg.gcd"): [15]}
