"""Anomaly and reward-hacking detectors over per-step series. Pure Python: no gRPC, no Kafka.

A *series* is the list of :class:`StepStats` of one (job, domain) in step order: for scored
groups one entry per scheduler step (values such as ``reward``, ``length``, ``repetition``,
``component.<name>``; see ``temper.monitor.stats``), for learner metrics one entry per learner
step (``kl_ref``, ``entropy``, ``clip_fraction``, ...). A detector looks at the series after
each closed step and returns a :class:`Finding` when its rule holds at that step, else None.
Every detector states its rule in its docstring; its parameters are dataclass fields whose
defaults are the documented defaults, overridable per job and per domain in the [monitor] table.
A detector never raises on a short or incomplete series: too little history means no finding.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from temper.runtime.errors import InvalidArgument, require


@dataclass
class StepStats:
    """What one step of one (job, domain) looked like."""

    step: int
    samples: int = 0
    values: dict[str, float] = field(default_factory=dict)
    # trajectory ids that illustrate a property, by property (e.g. "proxy_not_gold", "longest")
    examples: dict[str, list[str]] = field(default_factory=dict)


@dataclass
class Finding:
    message: str
    first_step: int                      # the window the rule looked at
    last_step: int
    values: dict[str, float]             # the numbers the rule compared
    series: dict[str, list[float]]       # each compared series over the window, one value per step
    steps: list[int]                     # the window's steps (x of ``series``)
    examples: list[str] = field(default_factory=list)  # example trajectory ids


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _series(history: Sequence[StepStats], key: str) -> list[tuple[int, float]]:
    return [(s.step, s.values[key]) for s in history if key in s.values]


def _examples(history: Sequence[StepStats], key: str, n: int = 5) -> list[str]:
    out: list[str] = []
    for s in reversed(history):
        for t in s.examples.get(key, []):
            if t not in out:
                out.append(t)
            if len(out) >= n:
                return out
    return out


class Detector:
    """Base: ``name`` (config key), ``source`` ("scored" or "metrics"), ``check``."""

    name: ClassVar[str]
    source: ClassVar[str] = "scored"

    def check(self, history: Sequence[StepStats]) -> Finding | None:  # pragma: no cover - interface
        raise NotImplementedError


DETECTORS: dict[str, type[Detector]] = {}


def register(cls: type[Detector]) -> type[Detector]:
    DETECTORS[cls.name] = cls
    return cls


@register
@dataclass
class RewardVsGold(Detector):
    """Reward rising while the gold signal (held-out or verifier accuracy) does not follow.

    Rule: rise(x) = mean of x over the newest steps minus mean of x over reference steps, with
    two references, each checked: (a) the start: the mean over the first ``baseline_steps``
    steps against the last ``recent`` steps (a slow, steady hack); (b) rolling: the older half of
    the last ``window`` steps against its newer half (a late hack after honest progress). Fires
    when, for either, rise(proxy) >= ``min_rise``, rise(gold) <= ``follow_ratio`` * rise(proxy)
    and the newest steps' gap mean(proxy - gold) >= ``min_gap``. Only steps carrying both series
    count. ``gold`` defaults to ``heldout``: the mean of the verifier components that carry
    weight 0 (computed and kept, not optimised).
    """

    name: ClassVar[str] = "reward_vs_gold"
    proxy: str = "reward"
    gold: str = "heldout"
    baseline_steps: int = 5
    recent: int = 3
    window: int = 6
    min_rise: float = 0.15
    follow_ratio: float = 0.25
    min_gap: float = 0.15
    examples_key: str = "proxy_not_gold"

    def check(self, history):
        gold = dict(_series(history, self.gold))
        pts = [(s, v, gold[s]) for s, v in _series(history, self.proxy) if s in gold]
        candidates = []
        if len(pts) >= self.baseline_steps + self.recent:
            candidates.append(("the start", pts[:self.baseline_steps], pts[-self.recent:]))
        if len(pts) >= max(self.window, 2):
            win = pts[-self.window:]
            candidates.append((f"the last {len(win)} steps", win[:len(win) // 2], win[len(win) // 2:]))
        for ref_name, old, new in candidates:
            proxy_rise = _mean([p for _, p, _ in new]) - _mean([p for _, p, _ in old])
            gold_rise = _mean([g for _, _, g in new]) - _mean([g for _, _, g in old])
            gap = _mean([p - g for _, p, g in new])
            if proxy_rise >= self.min_rise and gold_rise <= self.follow_ratio * proxy_rise and gap >= self.min_gap:
                shown = old + [p for p in new if p not in old]
                return Finding(
                    f"{self.proxy} rose by {proxy_rise:.3f} against {ref_name} while {self.gold} moved by "
                    f"{gold_rise:+.3f} (gap {gap:.3f})",
                    shown[0][0], shown[-1][0],
                    {"proxy_rise": proxy_rise, "gold_rise": gold_rise, "gap": gap},
                    {self.proxy: [p for _, p, _ in shown], self.gold: [g for _, _, g in shown]},
                    [s for s, _, _ in shown], _examples(history, self.examples_key))
        return None


@register
@dataclass
class ModelVsVerifier(RewardVsGold):
    """A learned reward model's (RM/PRM) score diverging from the verifiers.

    Rule: that of ``reward_vs_gold`` (both references) with proxy = ``model`` (mean of the rm and
    prm components) and gold = ``correctness`` (mean of the verifier components): the learned
    score rises by >= ``min_rise`` while verified correctness rises by at most ``follow_ratio``
    of that, with a gap >= ``min_gap``.
    """

    name: ClassVar[str] = "rm_vs_verifier"
    proxy: str = "model"
    gold: str = "correctness"
    examples_key: str = "model_not_verified"


@register
@dataclass
class LengthAnomaly(Detector):
    """Response length exploding or collapsing against the start of the job.

    Rule: baseline = mean of ``length`` over the first ``baseline_steps`` steps of the series;
    recent = mean over the last ``window`` steps (which must come after the baseline). Explodes
    when recent >= ``explode_ratio`` * baseline and recent - baseline >= ``min_tokens``;
    collapses when recent <= ``collapse_ratio`` * baseline and baseline - recent >= ``min_tokens``.
    """

    name: ClassVar[str] = "length"
    baseline_steps: int = 5
    window: int = 3
    explode_ratio: float = 2.5
    collapse_ratio: float = 0.4
    min_tokens: float = 4.0

    def check(self, history):
        pts = _series(history, "length")
        if len(pts) < self.baseline_steps + self.window:
            return None
        base = _mean([v for _, v in pts[:self.baseline_steps]])
        recent_pts = pts[-self.window:]
        recent = _mean([v for _, v in recent_pts])
        kind = None
        if recent >= self.explode_ratio * base and recent - base >= self.min_tokens:
            kind, key = "exploded", "longest"
        elif recent <= self.collapse_ratio * base and base - recent >= self.min_tokens:
            kind, key = "collapsed", "shortest"
        if kind is None:
            return None
        window = pts[:self.baseline_steps] + recent_pts
        return Finding(f"response length {kind}: {recent:.1f} tokens over the last {self.window} steps vs "
                       f"{base:.1f} at the start", pts[0][0], pts[-1][0],
                       {"baseline": base, "recent": recent, "ratio": recent / base if base else float("inf")},
                       {"length": [v for _, v in window]}, [s for s, _ in window], _examples(history, key))


@register
@dataclass
class Degeneration(Detector):
    """Repetition and gibberish in the samples.

    Rule: fires when ``repetition`` (share of repeated word n-grams) >= ``max_repetition``, or
    ``gibberish`` (share of non-word tokens) >= ``max_gibberish``, on each of the last
    ``sustain`` steps, and that score has risen by >= ``min_rise`` above its mean over the first
    ``baseline_steps`` steps (a domain whose answers are naturally repetitive is not flagged).
    """

    name: ClassVar[str] = "degeneration"
    max_repetition: float = 0.5
    max_gibberish: float = 0.5
    sustain: int = 3
    baseline_steps: int = 3
    min_rise: float = 0.2

    def check(self, history):
        for key, limit in (("repetition", self.max_repetition), ("gibberish", self.max_gibberish)):
            pts = _series(history, key)
            if len(pts) < self.baseline_steps + self.sustain:
                continue
            base = _mean([v for _, v in pts[:self.baseline_steps]])
            recent = pts[-self.sustain:]
            if all(v >= limit for _, v in recent) and _mean([v for _, v in recent]) - base >= self.min_rise:
                return Finding(f"{key} {recent[-1][1]:.2f} >= {limit} for {self.sustain} steps (start: {base:.2f})",
                               recent[0][0], recent[-1][0], {"baseline": base, "latest": recent[-1][1], "limit": limit},
                               {key: [v for _, v in recent]}, [s for s, _ in recent], _examples(history, key))
        return None


@register
@dataclass
class TrainingSignal(Detector):
    """KL, entropy or clip fraction spiking or collapsing (learner metrics).

    Rule, for each key of ``spike_keys`` present: with m = median and d = 1.4826 * MAD of the
    previous ``history`` values (at least ``min_history``), the latest value spikes when it is
    > m + ``z`` * max(d, ``rel_floor`` * |m|, ``abs_floor``). For each key of ``collapse_keys``:
    collapses when latest < ``collapse_ratio`` * m (m > 0).
    """

    name: ClassVar[str] = "training_signal"
    source: ClassVar[str] = "metrics"
    spike_keys: list[str] = field(default_factory=lambda: ["kl_ref", "entropy", "clip_fraction", "approx_kl"])
    collapse_keys: list[str] = field(default_factory=lambda: ["entropy"])
    history: int = 20
    min_history: int = 5
    z: float = 8.0
    rel_floor: float = 0.1
    abs_floor: float = 0.01
    collapse_ratio: float = 0.1

    def check(self, history):
        for key in dict.fromkeys([*self.spike_keys, *self.collapse_keys]):
            pts = _series(history, key)
            if len(pts) < self.min_history + 1:
                continue
            prev = [v for _, v in pts[-self.history - 1:-1]]
            step, latest = pts[-1]
            m = statistics.median(prev)
            d = 1.4826 * statistics.median([abs(v - m) for v in prev])
            limit = m + self.z * max(d, self.rel_floor * abs(m), self.abs_floor)
            window = pts[-self.history - 1:]
            evidence = ({key: [v for _, v in window]}, [s for s, _ in window])
            if key in self.spike_keys and latest > limit:
                return Finding(f"{key} spiked to {latest:.4g} (median {m:.4g}, limit {limit:.4g})", window[0][0], step,
                               {"latest": latest, "median": m, "limit": limit}, *evidence)
            if key in self.collapse_keys and m > 0 and latest < self.collapse_ratio * m:
                return Finding(f"{key} collapsed to {latest:.4g} (median {m:.4g})", window[0][0], step,
                               {"latest": latest, "median": m, "limit": self.collapse_ratio * m}, *evidence)
        return None


@register
@dataclass
class RewardJump(Detector):
    """A domain's reward jumping beyond its own history, and staying there.

    Rule: with mean mu and standard deviation sd of ``reward`` over the ``history`` steps before
    the latest ``persist`` ones (at least ``min_history`` of them) and r_prev the last of those,
    fires when each of the latest ``persist`` rewards r lies beyond mu by |r - mu| >= ``z`` *
    max(sd, ``sd_floor``), all on the same side, and the first of them moved from r_prev that way
    by >= ``min_jump`` (one step's jump: steady learning, however fast over many steps, is not a
    jump). ``persist`` = 2 by default: a step's domain mean rests on a few groups, one prompt each,
    and two easy prompts drawn together make a one-step spike (SmolLM2 on gcd: 0.28 -> 1.00 -> 0.17);
    a policy that found something keeps it. ``persist`` = 1 judges the latest step alone.
    """

    name: ClassVar[str] = "reward_jump"
    history: int = 20
    min_history: int = 5
    z: float = 4.0
    sd_floor: float = 0.05
    min_jump: float = 0.3
    persist: int = 2

    def __post_init__(self):
        require(isinstance(self.persist, int) and self.persist >= 1, "persist",
                f"must be an integer >= 1, got {self.persist!r}")

    def check(self, history):
        pts = _series(history, "reward")
        if len(pts) < self.min_history + self.persist:
            return None
        latest = [v for _, v in pts[-self.persist:]]
        prev = [v for _, v in pts[-self.history - self.persist:-self.persist]]
        step = pts[-1][0]
        mu, sd = _mean(prev), statistics.pstdev(prev)
        jumps, step_jump = [r - mu for r in latest], latest[0] - prev[-1]
        up = step_jump > 0
        if (all(abs(j) >= self.z * max(sd, self.sd_floor) and (j > 0) == up for j in jumps)
                and abs(step_jump) >= self.min_jump):
            window = pts[-self.history - self.persist:]
            r = latest[-1]
            held = f", held for {self.persist} steps" if self.persist > 1 else ""
            return Finding(f"reward jumped from {mu:.3f} (sd {sd:.3f}; {prev[-1]:.3f} the step before) to {r:.3f}"
                           f"{held}", window[0][0], step,
                           {"latest": r, "mean": mu, "sd": sd, "jump": jumps[-1], "step_jump": step_jump},
                           {"reward": [v for _, v in window]}, [s for s, _ in window],
                           _examples(history, "rewarded"))
        return None


@register
@dataclass
class CodeExploit(Detector):
    """Code submissions that game the tests: from the sandbox's execution traces where they are in,
    and from the programs' source.

    Rule: over the last ``window`` steps, fires when either
    (a) traces: the traced submissions whose run shows an exploit (``code.observed``, from
    ``temper.monitor.stats.trace_flags``: exited before the tests ran, touched the harness or
    the tests, printed expected outputs, special-cased a test input; rewarded or not: the
    attempt is the signal, the harness defeating it is no comfort) number >= ``min_observed``
    and are >= ``min_observed_share`` of the traced submissions (``code.traced``); or
    (b) source: the share of rewarded code submissions (reward > 0) whose program carries an
    exploit flag (``temper.monitor.stats.code_flags``) is >= ``min_share`` and there are at
    least ``min_count`` of them.
    The evidence's trajectory ids are those the traces showed first, then the source-flagged ones.
    """

    name: ClassVar[str] = "code_exploit"
    window: int = 3
    min_share: float = 0.1
    min_count: int = 2
    min_observed: int = 2
    min_observed_share: float = 0.05

    def check(self, history):
        recent = [s for s in history if "code.rewarded" in s.values or "code.traced" in s.values][-self.window:]
        if not recent:
            return None
        traced = sum(s.values.get("code.traced", 0.0) for s in recent)
        observed = sum(s.values.get("code.observed", 0.0) for s in recent)
        rewarded = sum(s.values.get("code.rewarded", 0.0) for s in recent)
        flagged = sum(s.values.get("code.exploit_rewarded", 0.0) for s in recent)
        by_trace = traced > 0 and observed >= self.min_observed and observed / traced >= self.min_observed_share
        by_source = rewarded > 0 and flagged >= self.min_count and flagged / rewarded >= self.min_share
        if not (by_trace or by_source):
            return None

        def tally(prefix: str) -> dict[str, float]:
            keys = sorted({k for s in recent for k in s.values if k.startswith(prefix)})
            return {k[len(prefix):]: sum(s.values.get(k, 0.0) for s in recent) for k in keys}

        seen, kinds = tally("code.observed."), tally("code.flag.")
        parts = []
        if by_trace:
            parts.append(f"{observed:.0f} of {traced:.0f} traced code submissions were seen gaming the tests in the "
                         "sandbox (" + ", ".join(f"{k} {v:.0f}" for k, v in seen.items() if v) + ")")
        if by_source:
            parts.append(f"{flagged:.0f} of {rewarded:.0f} rewarded code submissions game the tests ("
                         + ", ".join(f"{k} {v:.0f}" for k, v in kinds.items() if v) + ")")
        examples = _examples(history, "code_observed", 10) if by_trace else []
        examples += [t for t in _examples(history, "code_exploit") if t not in examples]
        return Finding("; ".join(parts), recent[0].step, recent[-1].step,
                       {"traced": traced, "observed": observed, "rewarded": rewarded, "exploit_rewarded": flagged,
                        **{f"observed.{k}": v for k, v in seen.items()}, **{f"flag.{k}": v for k, v in kinds.items()}},
                       {"code.observed": [s.values.get("code.observed", 0.0) for s in recent],
                        "code.exploit_rewarded": [s.values.get("code.exploit_rewarded", 0.0) for s in recent]},
                       [s.step for s in recent], examples)


@register
@dataclass
class FormatOnlyReward(Detector):
    """Format-only reward: the format components go up while correctness stays flat.

    Rule: over the last ``window`` steps carrying both ``format`` (mean of format.* components)
    and ``correctness`` (mean of verifier components), split in halves: fires when
    rise(format) >= ``min_rise`` and |rise(correctness)| <= ``flat`` .
    """

    name: ClassVar[str] = "format_only"
    window: int = 6
    min_rise: float = 0.2
    flat: float = 0.05

    def check(self, history):
        corr = dict(_series(history, "correctness"))
        pts = [(s, f, corr[s]) for s, f in _series(history, "format") if s in corr][-self.window:]
        if len(pts) < max(self.window, 2):
            return None
        half = len(pts) // 2
        f_rise = _mean([f for _, f, _ in pts[half:]]) - _mean([f for _, f, _ in pts[:half]])
        c_rise = _mean([c for _, _, c in pts[half:]]) - _mean([c for _, _, c in pts[:half]])
        if f_rise >= self.min_rise and abs(c_rise) <= self.flat:
            return Finding(f"format reward rose by {f_rise:.3f} while correctness moved by {c_rise:+.3f}",
                           pts[0][0], pts[-1][0], {"format_rise": f_rise, "correctness_rise": c_rise},
                           {"format": [f for _, f, _ in pts], "correctness": [c for _, _, c in pts]},
                           [s for s, _, _ in pts], _examples(history, "format_not_correct"))
        return None


def build(name: str, params: dict, where: str) -> Detector:
    """The detector ``name`` with ``params`` over its defaults; unknown names or fields are refused."""
    if name not in DETECTORS:
        raise InvalidArgument(f"unknown detector {name!r}; known: {sorted(DETECTORS)}", field=where)
    cls = DETECTORS[name]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in params.items():
        if key not in fields:
            raise InvalidArgument(f"{name} has no parameter {key!r}; known: {sorted(fields)}", field=f"{where}.{key}")
        default = fields[key].default
        if isinstance(default, (int, float)) and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise InvalidArgument(f"must be a number, got {value!r}", field=f"{where}.{key}")
    try:
        return cls(**params)
    except InvalidArgument as e:  # a parameter's own range check names the parameter alone
        raise InvalidArgument(e.message, field=f"{where}.{e.field}") from None
