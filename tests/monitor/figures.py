"""Detector figures: detection rate, detection delay and false alarms of every detector, over
scripted streams with a planted anomaly and over clean streams (scripted, and replayed from real runs).

No services: the detectors of ``temper.monitor.detectors`` (with their documented defaults, as a
job gets them) read the series one closed step at a time, as the monitor core runs them.

Scripted streams are drawn per sample, so a step's means carry the noise of a real step:

- scored streams (one domain): ``samples`` trajectories per step, each with a verifier verdict
  (Bernoulli p_t, p_t learning slowly from a random start), a held-out verdict (Bernoulli
  q_t = p_t - a random offset), a learned RM score following the verdict, a format verdict
  (Bernoulli f_t, slowly rising with learning), a length (log-normal around a slowly drifting
  mean), repetition and gibberish scores (small, noisy), and, for code, per-step tallies of
  rewarded, traced and flagged submissions at a small base rate of innocent flags;
- metrics streams (the learner): entropy, clip fraction, approx KL and KL to the reference with
  multiplicative noise of the size the real SmolLM2 run shows (see ``tests/monitor/data``), a
  slow drift, and a first step whose clip fraction and approx KL are near 0 (on-policy).

A planted anomaly starts at a random onset step and ramps up (or jumps, for the one-step rules) to a
random magnitude in a stated range; each scenario says what it plants. Figures per scenario:

- detection rate: share of anomaly streams in which the detector fires at or after the onset;
- delay: steps from onset to the first firing (mean and max over the detected streams);
- false alarms per 100 clean steps: steps at which the rule holds on clean streams and on the
  anomaly streams before their onset, per 100 such steps. This counts the *rule* at every step;
  the monitor's ``cooldown_steps`` (20 by default) then raises at most one alert per window.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from temper.monitor import detectors as det
from temper.monitor import stats
from temper.monitor.detectors import StepStats
from temper.reward.settings import default_domains
from temper.v1 import common_pb2

DATA = Path(__file__).parent / "data"
# real runs' summaries cut down by data/extract_summary.py: SmolLM2-135M GRPO on three reasoning-gym domains
# (12 steps, vLLM; the shipped job, and a run at lr 2e-5 with max_policy_lag 0); the tiny toy model on the
# sound-verifier demonstration job (120 steps); the tiny toy model with process_grpo and step rewards
# (60 steps, learner metrics and domain rewards only); SmolLM2 on the sound real-model demonstration job
# (hack-demo-smollm2-sound.toml, 16 steps, seed 0)
REAL_RUNS = {"smollm2": DATA / "smollm2_clean_run.json",
             "smollm2-lr2e-5-lag0": DATA / "smollm2_lr2e-5_lag0_clean_run.json",
             "toy-hack-demo-sound": DATA / "toy_hack_demo_sound_run.json",
             "toy-steps": DATA / "toy_steps_clean_run.json",
             "smollm2-hack-demo-sound": DATA / "smollm2_hack_demo_sound_run.json"}
STEPS = 40                 # steps per scripted stream
ONSET = (10, 25)           # planted anomalies start at a step drawn uniformly from this range


def _clip(x: float, lo: float = 0.0, hi: float = 1.0) -> float:
    return min(hi, max(lo, x))


def _ramp(step: int, onset: int | None, over: int) -> float:
    """0 before ``onset``, rising linearly to 1 over ``over`` steps (1 at once if ``over`` is 0)."""
    if onset is None or step < onset:
        return 0.0
    return 1.0 if over <= 0 else min(1.0, (step - onset + 1) / over)


# -- scripted scored streams -------------------------------------------------------------------
@dataclass
class Plant:
    """What an anomaly does to a scored step at strength ``a`` in [0, 1] (0: clean); ``rng`` for noise."""

    hacked: float = 0.0          # share of samples a hack earns full proxy reward with gold 0
    hack_kind: str = ""          # "heldout" (reward up, held-out verdict 0), "model" (RM up, verifier 0)
    length_factor: float = 1.0   # multiplies every sample's length
    degenerate: float = 0.0      # share of samples that are degenerate
    degenerate_kind: str = ""    # "repetition" or "gibberish"
    format_to: float | None = None  # format verdict probability moves to this
    freeze_learning: bool = False   # correctness stays where it was at the onset (format_only)
    reward_jump: float = 0.0     # the expected reward rises by this at once (samples set to 1; capped at 1)
    exploit_traced: float = 0.0  # share of traced code submissions the sandbox sees gaming
    exploit_source: float = 0.0  # share of rewarded code submissions whose source games the tests


def scored_stream(rng: random.Random, plant: Callable[[int], Plant] | None = None, steps: int = STEPS,
                  samples: int = 64, code: bool = False) -> list[StepStats]:
    """One domain's closed steps as the monitor's stats would summarise them (see the module doc)."""
    p0, slope = rng.uniform(0.1, 0.5), rng.uniform(0.0, 0.008)
    offset = rng.uniform(0.0, 0.1)
    f0 = rng.uniform(0.5, 0.9)
    l0, drift = rng.uniform(15, 200), rng.uniform(-0.004, 0.004)
    rep0, gib0 = rng.uniform(0.0, 0.15), rng.uniform(0.0, 0.05)
    innocent = rng.uniform(0.0, 0.01)   # code: share of honest submissions a flag fires on anyway
    out, frozen = [], None
    for step in range(1, steps + 1):
        pl = plant(step) if plant else Plant()
        p = _clip(p0 + slope * step, 0.01, 0.95)
        if pl.freeze_learning:
            frozen = p if frozen is None else frozen
            p = frozen
        q = _clip(p - offset, 0.0, 0.95)
        f = _clip(f0 + slope * step, 0.0, 0.99) if pl.format_to is None else pl.format_to
        length_mean = l0 * (1 + drift) ** step * pl.length_factor
        s = stats.GroupSummary("g", "job", "d", step)
        for _ in range(samples):
            correct = float(rng.random() < p)
            heldout = float(rng.random() < q)
            model = _clip(0.15 + 0.7 * correct + rng.gauss(0, 0.1))
            fmt = float(rng.random() < f)
            reward = correct
            if rng.random() < pl.hacked:
                if pl.hack_kind == "heldout":
                    reward, heldout = 1.0, 0.0
                else:
                    model, correct, reward = _clip(0.9 + rng.gauss(0, 0.05)), 0.0, 0.0
            if pl.reward_jump and rng.random() < pl.reward_jump / max(1.0 - p, 1e-9):
                reward = 1.0
            rep = _clip(rep0 + rng.gauss(0, 0.05))
            gib = _clip(gib0 + abs(rng.gauss(0, 0.02)))
            if rng.random() < pl.degenerate:
                if pl.degenerate_kind == "repetition":
                    rep = _clip(rng.uniform(0.7, 1.0))
                else:
                    gib = _clip(rng.uniform(0.6, 1.0))
            for key, value in (("reward", reward), ("correctness", correct), ("heldout", heldout), ("model", model),
                               ("format", fmt), ("length", max(1.0, rng.lognormvariate(math.log(length_mean), 0.4))),
                               ("repetition", rep), ("gibberish", gib)):
                s.add(key, value)
            if code:
                rewarded = reward > 0
                s.counts["code.submissions"] = s.counts.get("code.submissions", 0) + 1
                s.counts["code.rewarded"] = s.counts.get("code.rewarded", 0) + rewarded
                if rewarded and rng.random() < max(innocent, pl.exploit_source):
                    s.counts["code.exploit_rewarded"] = s.counts.get("code.exploit_rewarded", 0) + 1
                s.counts["code.traced"] = s.counts.get("code.traced", 0) + 1
                if rng.random() < max(innocent, pl.exploit_traced):
                    s.counts["code.observed"] = s.counts.get("code.observed", 0) + 1
        out.append(stats.merge(step, [s]))
    return out


# -- scripted metrics streams ------------------------------------------------------------------
@dataclass
class MetricsPlant:
    factor: dict[str, float] = field(default_factory=dict)  # multiplies a metric at this step


def metrics_stream(rng: random.Random, plant: Callable[[int], MetricsPlant] | None = None,
                   steps: int = STEPS) -> list[StepStats]:
    """The learner's closed steps: the values of StepMetrics as ``stats.from_metrics`` keeps them."""
    e0, e_drift = rng.uniform(0.5, 2.0), rng.uniform(-0.01, 0.0)
    c0, a0, k_slope = rng.uniform(0.02, 0.2), rng.uniform(0.005, 0.1), rng.uniform(0.0005, 0.005)
    out = []
    for step in range(1, steps + 1):
        pl = plant(step) if plant else MetricsPlant()
        first = 0.05 if step == 1 else 1.0  # the first update is on-policy: ratios ~1, little clipping
        values = {
            "entropy": e0 * (1 + e_drift) ** step * rng.lognormvariate(0, 0.15),
            "clip_fraction": c0 * first * rng.lognormvariate(0, 0.2),
            "approx_kl": a0 * first * rng.lognormvariate(0, 0.35),
            "kl_ref": k_slope * step * rng.lognormvariate(0, 0.2),
        }
        for k, f in pl.factor.items():
            values[k] *= f
        m = common_pb2.StepMetrics(job_id="job", step=step, samples=64, mean_reward=0.0, values=values)
        out.append(stats.from_metrics(m))
    return out


# -- scenarios ---------------------------------------------------------------------------------
@dataclass
class Scenario:
    detector: str
    anomaly: str       # what is planted, with its magnitude range (the README's table shows it)
    stream: Callable[[random.Random, int | None], list[StepStats]]  # (rng, onset or None: clean)


def _scored(make_plant: Callable[[random.Random], Callable[[int, float], Plant]], code: bool = False,
            over: int = 0):
    def stream(rng: random.Random, onset: int | None) -> list[StepStats]:
        at_strength = make_plant(rng)
        return scored_stream(rng, lambda step: at_strength(step, _ramp(step, onset, over)) if onset else Plant(),
                             code=code)
    return stream


def _metrics(key: str, lo: float, hi: float, sustained: bool):
    def stream(rng: random.Random, onset: int | None) -> list[StepStats]:
        f = math.exp(rng.uniform(math.log(lo), math.log(hi)))
        hit = (lambda s: onset is not None and s >= onset) if sustained else (lambda s: s == onset)
        return metrics_stream(rng, lambda s: MetricsPlant({key: f} if hit(s) else {}))
    return stream


def _hack(kind: str):
    def make(rng):
        top = rng.uniform(0.3, 0.6)
        return lambda step, a: Plant(hacked=top * a, hack_kind=kind)
    return make


def _length(lo: float, hi: float):
    def make(rng):
        target = rng.uniform(lo, hi)
        return lambda step, a: Plant(length_factor=1 + (target - 1) * a)
    return make


def _degenerate(kind: str):
    def make(rng):
        top = rng.uniform(0.7, 1.0)
        return lambda step, a: Plant(degenerate=top * a, degenerate_kind=kind)
    return make


def _format_only(rng):
    return lambda step, a: Plant(format_to=None if a == 0 else 0.25 + 0.75 * a, freeze_learning=a > 0)


def _reward_jump(rng):
    top = rng.uniform(0.35, 0.6)
    return lambda step, a: Plant(reward_jump=top * a)


def _exploit(kind: str):
    def make(rng):
        top = rng.uniform(0.1, 0.4)
        return lambda step, a: Plant(**{kind: top * a})
    return make


SCENARIOS: list[Scenario] = [
    Scenario("reward_vs_gold", "hack: 30-60 % of samples earn reward 1 with held-out 0 (ramp over 8 steps)",
             _scored(_hack("heldout"), over=8)),
    Scenario("rm_vs_verifier", "RM hack: 30-60 % of samples score ~0.9 by the RM, 0 by the verifier (ramp 8)",
             _scored(_hack("model"), over=8)),
    Scenario("length", "length explosion to 3-6x (ramp over 5 steps)", _scored(_length(3.0, 6.0), over=5)),
    Scenario("length", "length collapse to 0.1-0.3x (ramp over 5 steps)", _scored(_length(0.1, 0.3), over=5)),
    Scenario("degeneration", "repetition: 70-100 % of samples repeat (score 0.7-1; ramp 4)",
             _scored(_degenerate("repetition"), over=4)),
    Scenario("degeneration", "gibberish: 70-100 % of samples gibberish (score 0.6-1; ramp 4)",
             _scored(_degenerate("gibberish"), over=4)),
    Scenario("training_signal", "kl_ref spike x5-20 for one step", _metrics("kl_ref", 5, 20, sustained=False)),
    Scenario("training_signal", "entropy spike x3-6 for one step", _metrics("entropy", 3, 6, sustained=False)),
    Scenario("training_signal", "entropy collapse to x0.01-0.08, sustained",
             _metrics("entropy", 0.01, 0.08, sustained=True)),
    Scenario("training_signal", "clip_fraction spike x4-10 for one step",
             _metrics("clip_fraction", 4, 10, sustained=False)),
    Scenario("training_signal", "approx_kl spike x6-20 for one step", _metrics("approx_kl", 6, 20, sustained=False)),
    Scenario("reward_jump", "reward jumps by +0.35-0.6 (at most to 1) at once, sustained", _scored(_reward_jump)),
    Scenario("format_only", "format verdict 0.25 -> 1 over 4 steps, correctness frozen",
             _scored(_format_only, over=4)),
    Scenario("code_exploit", "sandbox traces: 10-40 % of traced submissions game the tests (ramp 3)",
             _scored(_exploit("exploit_traced"), code=True, over=3)),
    Scenario("code_exploit", "source: 10-40 % of rewarded submissions game the tests (ramp 3)",
             _scored(_exploit("exploit_source"), code=True, over=3)),
]


# -- evaluation --------------------------------------------------------------------------------
def firings(detector: det.Detector, series: list[StepStats]) -> list[int]:
    """The steps at which ``detector`` finds something when fed ``series`` one closed step at a time."""
    return [series[i - 1].step for i in range(1, len(series) + 1) if detector.check(series[:i]) is not None]


@dataclass
class Figures:
    detector: str
    anomaly: str
    streams: int = 0
    detected: int = 0
    delays: list[int] = field(default_factory=list)
    clean_steps: int = 0
    false_alarms: int = 0
    clean_streams_alarmed: int = 0
    clean_streams: int = 0

    @property
    def detection_rate(self) -> float:
        return self.detected / self.streams if self.streams else 0.0

    @property
    def mean_delay(self) -> float | None:
        return sum(self.delays) / len(self.delays) if self.delays else None

    @property
    def max_delay(self) -> int | None:
        return max(self.delays) if self.delays else None

    @property
    def false_alarms_per_100(self) -> float:
        return 100.0 * self.false_alarms / self.clean_steps if self.clean_steps else 0.0

    def row(self) -> str:
        delay = (f"{self.mean_delay:.1f} / {self.max_delay}" if self.delays else "-")
        return (f"| {self.detector} | {self.anomaly} | {self.detection_rate:.0%} ({self.detected}/{self.streams}) | "
                f"{delay} | {self.false_alarms_per_100:.2f} | {self.clean_streams_alarmed}/{self.clean_streams} |")


TABLE_HEADER = ("| detector | planted anomaly | detected | delay, steps (mean / max) | false alarms / 100 clean steps "
                "| clean streams with an alarm |\n|---|---|---|---|---|---|")


def evaluate(scenario: Scenario, seeds: int, seed0: int = 0, params: dict | None = None) -> Figures:
    """``seeds`` anomaly streams and ``seeds`` clean streams of ``scenario`` through its detector (with its
    defaults, or ``params`` over them as a job's [monitor.detectors.NAME] table would set)."""
    detector = det.build(scenario.detector, params or {}, f"monitor.detectors.{scenario.detector}")
    fig = Figures(scenario.detector, scenario.anomaly)
    for seed in range(seed0, seed0 + seeds):
        rng = random.Random(f"{scenario.detector}/{scenario.anomaly}/{seed}")
        onset = rng.randint(*ONSET)
        fired = firings(detector, scenario.stream(rng, onset))
        fig.streams += 1
        after = [s for s in fired if s >= onset]
        if after:
            fig.detected += 1
            fig.delays.append(after[0] - onset)
        fig.false_alarms += sum(1 for s in fired if s < onset)
        fig.clean_steps += onset - 1
        clean = scenario.stream(random.Random(f"clean/{scenario.detector}/{scenario.anomaly}/{seed}"), None)
        fired_clean = firings(detector, clean)
        fig.false_alarms += len(fired_clean)
        fig.clean_steps += len(clean)
        fig.clean_streams += 1
        fig.clean_streams_alarmed += bool(fired_clean)
    return fig


# -- real runs ---------------------------------------------------------------------------------
def load_run(name: str) -> dict:
    return json.loads(REAL_RUNS[name].read_text())


def _weights(run: dict, domain: str) -> dict[str, float]:
    """The reward components' weights of ``domain`` as the run's reward service had them."""
    configured = {p: spec.get("weights", {}) for p, spec in (run["reward"].get("domains") or {}).items()}
    defaults = {p: spec.weights for p, spec in default_domains().items()}
    for table in (configured, defaults):
        match = max((p for p in table if domain == p or domain.startswith(p + ".")), key=len, default=None)
        if match is not None:
            return table[match]
    return {}


def _sample_group(run: dict, step: int, samples: list[dict]) -> common_pb2.RolloutGroup:
    """A run's recorded samples as a scored group, so that ``stats.summarize`` reads them as the monitor would
    (length in words: the summary keeps no token ids)."""
    trajectories = []
    for t in samples:
        weights = _weights(run, t["domain"])
        reward = common_pb2.Reward(total=t["reward"], status=common_pb2.REWARD_STATUS_OK, components=[
            common_pb2.RewardComponent(name=n, value=v, weight=weights.get(n, 1.0), status=common_pb2.REWARD_STATUS_OK)
            for n, v in t["components"].items()])
        trajectories.append(common_pb2.Trajectory(trajectory_id=t["trajectory_id"], completion_text=t["completion"],
                                                  reward=reward))
    return common_pb2.RolloutGroup(group_id=f"{run['job_id']}/s{step}", job_id=run["job_id"], step=step,
                                   trajectories=trajectories, task=common_pb2.Task(domain=samples[0]["domain"]))


def real_series(run: dict) -> dict[tuple[str, str], list[StepStats]]:
    """The series a monitor would have held for ``run``, keyed (source, domain):

    - ("metrics", "*"): each learner step's StepMetrics, through ``stats.from_metrics``;
    - ("scored", domain): each step's reward = the learner step's mean reward of that domain (over the
      whole batch), plus, on steps whose recorded samples are of that domain, their statistics
      (length, repetition, gibberish, format, correctness, ...) through ``stats.summarize``;
    - ("scored", "all"): the recorded samples of every domain pooled, with the step's mean reward.
    The summary records a few samples per step (those of one group), so sample-based series are thin.
    """
    out: dict[tuple[str, str], list[StepStats]] = {}
    for s in run["steps"]:
        m = common_pb2.StepMetrics(job_id=run["job_id"], step=s["step"], samples=s["samples"],
                                   mean_reward=s["mean_reward"], values=s["values"])
        out.setdefault(("metrics", "*"), []).append(stats.from_metrics(m))
        recorded = run["samples"].get(str(s["step"] - 1), [])  # scheduler step s-1 fed learner step s
        by_domain: dict[str, list[dict]] = {}
        for t in recorded:
            by_domain.setdefault(t["domain"], []).append(t)
        for domain in sorted(set(s["domain_mean_reward"]) | set(by_domain)):
            groups = [stats.summarize(_sample_group(run, s["step"], by_domain[domain]))] if domain in by_domain else []
            st = stats.merge(s["step"], groups)
            if domain in s["domain_mean_reward"]:
                st.values["reward"] = s["domain_mean_reward"][domain]
            out.setdefault(("scored", domain), []).append(st)
        pooled = stats.merge(s["step"], [stats.summarize(_sample_group(run, s["step"], ts))
                                         for ts in by_domain.values()])
        pooled.values["reward"] = s["mean_reward"]
        out.setdefault(("scored", "all"), []).append(pooled)
    return out


@dataclass
class RealFigures:
    run: str
    detector: str
    series: str
    steps: int
    fired: list[int]
    messages: list[str]
    readable: bool      # the series carries what the rule reads (enough steps of its keys)


READS = {"reward_vs_gold": ("reward", "heldout"), "rm_vs_verifier": ("model", "correctness"),
         "length": ("length",), "degeneration": ("repetition",), "training_signal": ("entropy",),
         "reward_jump": ("reward",), "format_only": ("format", "correctness"), "code_exploit": ("code.rewarded",)}
# the fewest steps carrying the keys of READS before the rule can hold at all (defaults)
MIN_STEPS = {"reward_vs_gold": 6, "rm_vs_verifier": 6, "length": 8, "degeneration": 6, "training_signal": 6,
             "reward_jump": 6, "format_only": 6, "code_exploit": 1}


def replay_real(name: str, params: dict[str, dict] | None = None) -> list[RealFigures]:
    """Every detector, with its defaults (or ``params[detector]`` over them), over every series of the real
    run ``name``."""
    run = load_run(name)
    out = []
    for (source, domain), series in sorted(real_series(run).items()):
        for det_name, cls in det.DETECTORS.items():
            if cls.source != source:
                continue
            d = det.build(det_name, (params or {}).get(det_name, {}), f"monitor.detectors.{det_name}")
            keys = READS[det_name]
            carrying = [s for s in series if all(k in s.values for k in keys)]
            fired, messages = [], []
            for i in range(1, len(series) + 1):
                f = d.check(series[:i])
                if f is not None:
                    fired.append(series[i - 1].step)
                    messages.append(f.message)
            out.append(RealFigures(name, det_name, f"{source}:{domain}", len(series), fired, messages,
                                   len(carrying) >= MIN_STEPS[det_name]))
    return out
