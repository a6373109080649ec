"""Which domain the next prompt comes from, and at what difficulty, learned from scored groups. No gRPC.

The ``[job.sampling]`` table turns policies on; they combine into one draw probability per domain:

    p_d = floor + (1 - n * floor) * q_d / sum_e q_e,    q_d = w_d * f_d * a_d

- ``weights``: fixed relative weights w_d (default 1 per domain; > 0 and finite, so p always normalises);
- ``difficulty_filter``: f_d = 1 while the domain's recent pass rate lies in [low, high], else
  ``outside_weight`` (never 0 for every domain at once: then f = 1); a prompt seen before whose own pass
  rate left the band is redrawn (procedural domains rarely repeat a prompt; small ones do);
- ``adaptive``: a_d = the domain's adaptive signal over its last ``window`` groups. ``signal =
  "progress"`` (default): learning progress, |mean reward of the newer half of those groups - the older
  half| (forgetting draws attention as much as learning). ``signal = "learnability"``: the mean
  within-group standard deviation of reward, i.e. how much GRPO signal the domain's groups carry (0 for a
  domain always failed or always solved, largest where about half the answers pass: p(1 - p) for 0/1
  rewards, as in learnability-prioritised curricula). A domain with too few groups yet gets the largest
  signal of the others (explored first); no signal anywhere: a = 1; ``floor`` is the smallest draw
  probability of any domain (no domain starves; n * floor <= 1);
- ``curriculum``: per domain a level on a ladder of option sets (reasoning-gym's own curriculum, or a
  ``ladders`` entry); after ``window`` groups drawn at the current level, the level rises when their pass
  rate is > ``raise_above`` and falls when it is < ``lower_below``; groups drawn at another level
  (still in flight when it moved) count toward the totals, never toward the level's window;
- ``loss_weighting``: each group carries a loss weight (``RolloutGroup.loss_weight``, multiplied into the
  learner's policy loss): fixed per-domain ``weights`` times ``1 + lagging * (mean pass rate - the
  domain's)``, clipped to [min_weight, max_weight], so lagging domains get more gradient;
- ``rm_confidence``: where a domain's reward comes from a learned reward model (its groups carry an ``rm``
  component), its draw weight and its groups' loss weight are multiplied by
  ``min_factor + (1 - min_factor) * c_d``, c_d the RM's mean confidence over the domain's last ``window``
  groups (``group_rm_confidence``; ``rm`` or ``prm`` scores in [0, 1]): per trajectory, its agreement with
  the verifiers where the trajectory has both, ``1 - |rm - mean verifier value|``, else its score margin,
  ``|2 * rm - 1|`` (how far from undecided). A domain without RM scores (or none measured yet) keeps
  factor 1, so an RM that disagrees with its verifier moves weight and gradient to where the reward can
  be trusted;
- ``dynamic_sampling`` (DAPO): a group whose rewards are all equal carries no GRPO signal; it is counted
  (``zero_variance_groups``) and not published, and the step draws another prompt instead, up to
  ``max_refill_ratio * prompts_per_step`` extra draws per step (then the step is filled with what it has:
  ``unfilled_groups``, so a job never stalls on a domain it cannot yet solve).

A trajectory passes when its reward is >= ``pass_threshold``. Every training draw is also checked against
the prompts the job drew before (``note_drawn``; the last ``DRAWN_MEMORY`` distinct ones): a domain's
``repeated_prompts`` counts the draws that repeat one, so a domain whose few distinct problems the job is
memorising shows it. ``SamplingPolicy.state()`` is the whole learned state as plain data and
``SamplingPolicy.load_state`` restores it.
"""

from __future__ import annotations

import base64
import functools
import json
import math
import random
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field, fields

from temper import tasks
from temper.reward.settings import MODEL_COMPONENTS
from temper.reward.verifiers import passes
from temper.reward.verifiers.suites import CASE_PREFIX
from temper.runtime.errors import InvalidArgument, require
from temper.scheduler.evaluation import prompt_key
from temper.v1 import common_pb2

MAX_WINDOW = 100_000
PROMPT_MEMORY = 100_000  # prompts whose pass rate the difficulty filter remembers (least recently seen forgotten)
DRAWN_MEMORY = 100_000  # distinct training prompts remembered for ``repeated_prompts`` (least recently drawn forgotten)
DRAWN_KEY_BYTES = 8  # of each prompt's digest: a false repeat among 100,000 prompts has odds ~3e-10
ADAPTIVE_SIGNALS = ("progress", "learnability")


@dataclass
class CurriculumConfig:
    domains: list[str] = field(default_factory=list)  # empty: every domain with a ladder
    window: int = 16  # groups at the current level before it may move
    raise_above: float = 0.8
    lower_below: float = 0.2
    start_level: int = 0
    ladders: dict[str, list[dict]] = field(default_factory=dict)  # domain -> level -> the family's options


@dataclass
class FilterConfig:
    low: float = 0.1
    high: float = 0.9
    window: int = 16  # a domain's recent groups behind its pass rate
    outside_weight: float = 0.1  # weight factor of a domain outside the band (> 0: it is still measured)
    prompt_min_groups: int = 1  # groups of one prompt before its own pass rate can refuse it
    max_redraws: int = 8  # refused prompts in a row before one is taken anyway


@dataclass
class AdaptiveConfig:
    window: int = 16  # a domain's recent groups behind its signal (progress: halves compared)
    signal: str = "progress"  # "progress" (change of recent mean reward) or "learnability" (within-group spread)
    floor: float = 0.02  # smallest draw probability of any domain


@dataclass
class DynamicSamplingConfig:
    max_refill_ratio: float = 2.0  # extra draws per step, as a multiple of prompts_per_step


@dataclass
class LossWeightingConfig:
    weights: dict[str, float] = field(default_factory=dict)  # fixed per-domain loss multipliers (default 1)
    lagging: float = 0.0  # strength: a domain below the mean recent pass rate gets more gradient
    min_weight: float = 0.25
    max_weight: float = 4.0


@dataclass
class RMConfidenceConfig:
    window: int = 16  # a domain's recent groups behind its RM confidence
    min_factor: float = 0.1  # the factor of a domain whose RM is never right (confidence 0); in (0, 1]


@dataclass
class SamplingConfig:
    weights: dict[str, float] = field(default_factory=dict)
    pass_threshold: float = 1.0
    curriculum: CurriculumConfig | None = None
    difficulty_filter: FilterConfig | None = None
    adaptive: AdaptiveConfig | None = None
    dynamic_sampling: DynamicSamplingConfig | None = None
    loss_weighting: LossWeightingConfig | None = None
    rm_confidence: RMConfidenceConfig | None = None

    @property
    def needs_outcomes(self) -> bool:
        return any(p is not None for p in (self.curriculum, self.difficulty_filter, self.adaptive,
                                            self.dynamic_sampling, self.rm_confidence))

    @classmethod
    def from_dict(cls, table: dict | None, prefix: str = "sampling") -> SamplingConfig:
        """From the ``[job.sampling]`` table; an unknown key or a wrong type is refused, naming it."""
        table = _check_keys(table or {}, cls, prefix)
        out = cls()
        for key, value in table.items():
            f = f"{prefix}.{key}"
            if key == "weights":
                require(isinstance(value, dict), f, "must be a table of domain = weight")
                out.weights = {}
                for d, w in value.items():
                    require(_is_number(w), f"{f}[{d}]", f"must be a number, got {w!r}")
                    out.weights[d] = float(w)
            elif key == "pass_threshold":
                require(_is_number(value), f, f"must be a number, got {value!r}")
                out.pass_threshold = float(value)
            else:
                sub = {"curriculum": CurriculumConfig, "difficulty_filter": FilterConfig, "adaptive": AdaptiveConfig,
                       "dynamic_sampling": DynamicSamplingConfig, "loss_weighting": LossWeightingConfig,
                       "rm_confidence": RMConfidenceConfig}[key]
                setattr(out, key, _sub_table(sub, value, f))
        return out

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None and v != {}}

    def validate(self, domains: list[str], domain_config: dict[str, dict], prefix: str = "sampling") -> None:
        """InvalidArgument naming the field unless the policies fit the job's ``domains``."""
        known = set(domains)
        for d, w in self.weights.items():
            require(d in known, f"{prefix}.weights[{d}]", f"not a domain of the job (job.domains: {domains})")
            require(math.isfinite(w) and w > 0, f"{prefix}.weights[{d}]",
                    f"must be finite and > 0 (a domain not to train on is left out of job.domains), got {w}")
        require(math.isfinite(self.pass_threshold), f"{prefix}.pass_threshold", "must be finite")
        if (c := self.curriculum) is not None:
            p = f"{prefix}.curriculum"
            _window(c.window, f"{p}.window")
            require(0 <= c.lower_below < c.raise_above <= 1, f"{p}.raise_above",
                    f"need 0 <= lower_below < raise_above <= 1, got lower_below {c.lower_below}, "
                    f"raise_above {c.raise_above}")
            require(c.start_level >= 0, f"{p}.start_level", f"must be >= 0, got {c.start_level}")
            for d in c.domains:
                require(d in known, f"{p}.domains", f"{d!r} is not a domain of the job (job.domains: {domains})")
            for d, ladder in c.ladders.items():
                require(d in known, f"{p}.ladders[{d}]", f"not a domain of the job (job.domains: {domains})")
                require(isinstance(ladder, list) and len(ladder) >= 2 and all(isinstance(r, dict) for r in ladder),
                        f"{p}.ladders[{d}]", "must be a list of at least two option tables (easiest first)")
                for i, rung in enumerate(ladder):
                    tasks.check_config(d, {**domain_config.get(d, {}), **rung}, field=f"{p}.ladders[{d}][{i}]")
            for d, ladder in self.ladders(domains, {}).items():
                for key in sorted(set(domain_config.get(d, {})) & {k for rung in ladder for k in rung}):
                    raise InvalidArgument(f"{d}'s curriculum sets {key!r} at every level; leave it out of "
                                          f"domain_config or out of the ladder", field=f"domain_config[{d}].{key}")
            if c.domains:
                resolved = self.ladders(domains, domain_config)
                for d in c.domains:
                    require(d in resolved, f"{p}.domains", f"{d!r} has no usable difficulty ladder: its family has "
                                                           f"no curriculum of its own (or refuses its starting "
                                                           f"level); give one in {p}.ladders")
        if (fc := self.difficulty_filter) is not None:
            p = f"{prefix}.difficulty_filter"
            _window(fc.window, f"{p}.window")
            require(0 <= fc.low < fc.high <= 1, f"{p}.low", f"need 0 <= low < high <= 1, got low {fc.low}, "
                                                             f"high {fc.high}")
            require(0 <= fc.outside_weight <= 1, f"{p}.outside_weight", f"must be in [0, 1], got {fc.outside_weight}")
            require(fc.prompt_min_groups >= 1, f"{p}.prompt_min_groups", "must be >= 1")
            require(0 <= fc.max_redraws <= 1000, f"{p}.max_redraws", "must be in [0, 1000]")
        if (a := self.adaptive) is not None:
            p = f"{prefix}.adaptive"
            _window(a.window, f"{p}.window")
            require(a.signal in ADAPTIVE_SIGNALS, f"{p}.signal", f"must be one of {ADAPTIVE_SIGNALS}, got {a.signal!r}")
            require(a.window >= 2 or a.signal != "progress", f"{p}.window", "must be >= 2 (its halves are compared)")
            require(a.floor >= 0 and a.floor * len(domains) <= 1, f"{p}.floor",
                    f"must be >= 0 with floor * {len(domains)} domains <= 1, got {a.floor}")
        if (lw := self.loss_weighting) is not None:
            p = f"{prefix}.loss_weighting"
            for d, w in lw.weights.items():
                require(d in known, f"{p}.weights[{d}]", f"not a domain of the job (job.domains: {domains})")
                require(_is_number(w) and math.isfinite(w) and w > 0, f"{p}.weights[{d}]",
                        f"must be a finite number > 0, got {w!r}")
            require(math.isfinite(lw.lagging) and lw.lagging >= 0, f"{p}.lagging", f"must be >= 0, got {lw.lagging}")
            require(0 < lw.min_weight <= 1 <= lw.max_weight and math.isfinite(lw.max_weight), f"{p}.min_weight",
                    f"need 0 < min_weight <= 1 <= max_weight, got {lw.min_weight}, {lw.max_weight}")
        if (rc := self.rm_confidence) is not None:
            _window(rc.window, f"{prefix}.rm_confidence.window")
            require(0 < rc.min_factor <= 1, f"{prefix}.rm_confidence.min_factor",
                    f"must be in (0, 1] (a factor 0 would starve a domain), got {rc.min_factor}")
        if (ds := self.dynamic_sampling) is not None:
            require(math.isfinite(ds.max_refill_ratio) and 0 <= ds.max_refill_ratio <= 100,
                    f"{prefix}.dynamic_sampling.max_refill_ratio", f"must be in [0, 100], got {ds.max_refill_ratio}")

    def ladders(self, domains: list[str], domain_config: dict[str, dict]) -> dict[str, list[dict]]:
        """domain -> its difficulty ladder (each rung merged over the domain's own options), for every
        domain under curriculum. A family's own ladder whose starting rung the family itself refuses (a few
        reasoning-gym curricula start outside their own config's bounds) is left out: that domain is
        trained at its domain_config."""
        c = self.curriculum
        if c is None:
            return {}
        out = {}
        for d in (c.domains or domains):
            if d in c.ladders:
                out[d] = [{**domain_config.get(d, {}), **rung} for rung in c.ladders[d]]
                continue
            ladder = tasks.difficulty_ladder(d) if tasks.configurable(d) else None
            if not ladder:
                continue
            ladder = [{**domain_config.get(d, {}), **rung} for rung in ladder]
            if usable(d, ladder[min(c.start_level, len(ladder) - 1)]):
                out[d] = ladder
        return out


def usable(domain: str, options: dict) -> bool:
    """Whether the domain's family accepts ``options`` (and builds a task with them); remembered, since a
    family may take seconds to build one task."""
    return _usable(domain, json.dumps(options, sort_keys=True))


@functools.lru_cache(maxsize=4096)
def _usable(domain: str, options_json: str) -> bool:
    try:
        tasks.check_config(domain, json.loads(options_json))
    except InvalidArgument:
        return False
    return True


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _window(n: int, f: str) -> None:
    require(1 <= n <= MAX_WINDOW, f, f"must be in [1, {MAX_WINDOW}], got {n}")


def _check_keys(table, cls, prefix: str) -> dict:
    require(isinstance(table, dict), prefix, "must be a table")
    known = [f.name for f in fields(cls)]
    for key in sorted(table):
        require(key in known, f"{prefix}.{key}", f"unknown field; known: {known}")
    return table


def _sub_table(cls, value, prefix: str):
    """A policy's table (``true`` or ``{}``: its defaults) as ``cls``, each value type-checked against the default."""
    if value is True:
        value = {}
    table = _check_keys(value, cls, prefix)
    out = cls()
    for key, v in table.items():
        default = getattr(out, key)
        f = f"{prefix}.{key}"
        if isinstance(default, int):
            require(isinstance(v, int) and not isinstance(v, bool), f, f"must be an integer, got {v!r}")
        elif isinstance(default, float):
            require(_is_number(v), f, f"must be a number, got {v!r}")
            v = float(v)
        elif isinstance(default, list):
            require(isinstance(v, list) and all(isinstance(x, str) for x in v), f, "must be a list of domain names")
        elif isinstance(default, dict):
            require(isinstance(v, dict), f, "must be a table")
        elif isinstance(default, str):
            require(isinstance(v, str), f, f"must be a string, got {v!r}")
        setattr(out, key, v)
    return out


@dataclass
class DomainStats:
    """What the scheduler has learned of one domain. Rates are over the recent windows."""

    drawn: int = 0  # prompts drawn
    groups: int = 0  # scored groups seen
    trajectories: int = 0
    passes: int = 0
    reward_sum: float = 0.0
    zero_variance_groups: int = 0
    filtered_prompts: int = 0  # draws the difficulty filter refused (redrawn)
    repeated_prompts: int = 0  # training draws whose prompt the job had drawn before
    level: int = 0
    level_changes: int = 0
    recent_pass: deque = field(default_factory=deque)  # per group: fraction passed
    recent_reward: deque = field(default_factory=deque)  # per group: mean reward
    recent_spread: deque = field(default_factory=deque)  # per group: standard deviation of its rewards
    recent_rm_confidence: deque = field(default_factory=deque)  # per group with RM scores: their confidence
    level_passes: int = 0  # over the groups drawn at the current level since it was set
    level_trajectories: int = 0
    level_groups: int = 0


class SamplingPolicy:
    """The learned state of one job's sampling: per-domain counts, pass rates, difficulty, weights."""

    def __init__(self, config: SamplingConfig, domains: list[str], domain_config: dict[str, dict] | None = None):
        self.config = config
        self.domains = list(domains)
        self.domain_config = dict(domain_config or {})
        self.ladders = config.ladders(self.domains, self.domain_config)
        keep = max([16] + [p.window for p in (config.difficulty_filter, config.adaptive, config.curriculum) if p])
        rm_keep = config.rm_confidence.window if config.rm_confidence else 16
        self.stats = {d: DomainStats(recent_pass=deque(maxlen=keep), recent_reward=deque(maxlen=keep),
                                     recent_spread=deque(maxlen=keep), recent_rm_confidence=deque(maxlen=rm_keep))
                      for d in self.domains}
        if config.curriculum is not None:
            for d, ladder in self.ladders.items():
                self.stats[d].level = min(config.curriculum.start_level, len(ladder) - 1)
        self._prompts: OrderedDict[str, list[int]] = OrderedDict()  # prompt key -> [groups, passes, trajectories]
        self._drawn: OrderedDict[bytes, None] = OrderedDict()  # the distinct training prompts drawn, least recent first
        self._probabilities: list[float] | None = None

    # --- drawing -------------------------------------------------------------------------------------

    def probabilities(self) -> dict[str, float]:
        return dict(zip(self.domains, self._probs()))

    def _probs(self) -> list[float]:
        if self._probabilities is None:
            self._probabilities = self._compute()
        return self._probabilities

    def _compute(self) -> list[float]:
        c = self.config
        q = [c.weights.get(d, 1.0) for d in self.domains]
        if (fc := c.difficulty_filter) is not None:
            factors = [1.0 if self._in_band(d) else fc.outside_weight for d in self.domains]
            if sum(w * f for w, f in zip(q, factors)) > 0:
                q = [w * f for w, f in zip(q, factors)]
        floor = 0.0
        if (a := c.adaptive) is not None:
            floor = a.floor
            progress = [self.learning_progress(d) for d in self.domains]
            known = [p for p in progress if p is not None]
            if known and max(known) > 0:
                top = max(known)
                q = [w * (top if p is None else p) for w, p in zip(q, progress)]
        if c.rm_confidence is not None:
            q = [w * self.rm_factor(d) for w, d in zip(q, self.domains)]
        total = sum(q)
        if total <= 0:  # every factor zero (e.g. progress zero where weight is): uniform over the base weights
            q = [c.weights.get(d, 1.0) for d in self.domains]
            total = sum(q)
        n = len(self.domains)
        return [floor + (1 - n * floor) * w / total for w in q]

    def draw(self, rng: random.Random) -> tuple[str, int, dict | None]:
        """(domain, difficulty level, the family's options at that level or None) of the next prompt."""
        probs = self._probs()
        if max(probs) - min(probs) <= 1e-12:
            # uniform: the very draw a job without [job.sampling] always made, so its prompts stay the same
            domain = rng.choice(self.domains)
        else:
            domain = rng.choices(self.domains, weights=probs)[0]
        self.stats[domain].drawn += 1
        return domain, self.stats[domain].level, self.options(domain)

    def options(self, domain: str) -> dict | None:
        ladder = self.ladders.get(domain)
        if ladder:
            return ladder[self.stats[domain].level]
        return self.domain_config.get(domain)

    def keep_prompt(self, domain: str, prompt: str) -> bool:
        """False (and counted) for a prompt the difficulty filter refuses: seen in enough groups, and its own
        pass rate outside the band."""
        fc = self.config.difficulty_filter
        if fc is None:
            return True
        seen = self._prompts.get(prompt_key(prompt).hex())
        if seen is None or seen[0] < fc.prompt_min_groups or seen[2] == 0:
            return True
        if fc.low <= seen[1] / seen[2] <= fc.high:
            return True
        self.stats[domain].filtered_prompts += 1
        return False

    def note_drawn(self, domain: str, prompt: str) -> bool:
        """Record a training draw of ``prompt`` (after any redraws); True, and counted in the domain's
        ``repeated_prompts``, when the job had drawn it before."""
        key = prompt_key(prompt)[:DRAWN_KEY_BYTES]
        repeated = key in self._drawn
        if repeated:
            self._drawn.move_to_end(key)
            self.stats[domain].repeated_prompts += 1
        else:
            self._drawn[key] = None
            while len(self._drawn) > DRAWN_MEMORY:
                self._drawn.popitem(last=False)
        return repeated

    def loss_weight(self, domain: str) -> float:
        """The multi-task loss weight of a group of ``domain``: its fixed weight times
        1 + lagging * (mean recent pass rate of the measured domains - its own), clipped to
        [min_weight, max_weight]; 1 without ``loss_weighting`` (and for a domain not measured yet)."""
        lw = self.config.loss_weighting
        if lw is None:
            return self.rm_factor(domain)
        w = lw.weights.get(domain, 1.0)
        measured = [self.pass_rate(d) for d in self.domains if self.stats[d].recent_pass]
        if lw.lagging > 0 and measured and self.stats[domain].recent_pass:
            w *= 1 + lw.lagging * (sum(measured) / len(measured) - self.pass_rate(domain))
        return min(lw.max_weight, max(lw.min_weight, w)) * self.rm_factor(domain)

    def rm_confidence(self, domain: str) -> float | None:
        """The reward model's mean confidence over the domain's recent groups with RM scores; None: none yet."""
        recent = self.stats[domain].recent_rm_confidence
        return sum(recent) / len(recent) if recent else None

    def rm_factor(self, domain: str) -> float:
        """``min_factor + (1 - min_factor) * rm_confidence``; 1 without ``rm_confidence`` or RM scores."""
        rc, c = self.config.rm_confidence, self.rm_confidence(domain)
        return 1.0 if rc is None or c is None else rc.min_factor + (1 - rc.min_factor) * c

    # --- learning ------------------------------------------------------------------------------------

    def is_informative(self, rewards: list[float]) -> bool:
        """Whether a group carries a GRPO signal (its rewards differ); dynamic sampling drops the rest."""
        return len(rewards) > 1 and max(rewards) - min(rewards) > 1e-9

    def observe(self, domain: str, level: int, prompt: str, rewards: list[float],
                rm_confidence: float | None = None) -> None:
        """One scored group of ``domain``, drawn at difficulty ``level``, with its trajectories' rewards and,
        where its reward came from a reward model, that model's confidence in it (``group_rm_confidence``)."""
        s = self.stats.get(domain)
        if s is None or not rewards:
            return
        if rm_confidence is not None:
            s.recent_rm_confidence.append(min(1.0, max(0.0, float(rm_confidence))))
        passed = sum(1 for r in rewards if passes(r, self.config.pass_threshold))
        s.groups += 1
        s.trajectories += len(rewards)
        s.passes += passed
        s.reward_sum += sum(rewards)
        s.recent_pass.append(passed / len(rewards))
        mean = sum(rewards) / len(rewards)
        s.recent_reward.append(mean)
        s.recent_spread.append(math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)))
        if not self.is_informative(rewards):
            s.zero_variance_groups += 1
        if self.config.difficulty_filter is not None:
            key = prompt_key(prompt).hex()
            seen = self._prompts.pop(key, [0, 0, 0])
            seen[0] += 1
            seen[1] += passed
            seen[2] += len(rewards)
            self._prompts[key] = seen
            while len(self._prompts) > PROMPT_MEMORY:
                self._prompts.popitem(last=False)
        if (c := self.config.curriculum) is not None and domain in self.ladders and level == s.level:
            s.level_groups += 1
            s.level_passes += passed
            s.level_trajectories += len(rewards)
            if s.level_groups >= c.window:
                rate = s.level_passes / s.level_trajectories
                top = len(self.ladders[domain]) - 1
                if rate > c.raise_above and s.level < top and not usable(domain, self.ladders[domain][s.level + 1]):
                    del self.ladders[domain][s.level + 1:]  # the family refuses the next rung: this is its top
                    top = s.level
                if rate > c.raise_above and s.level < top:
                    self._set_level(s, s.level + 1)
                elif rate < c.lower_below and s.level > 0:
                    self._set_level(s, s.level - 1)
                else:  # a fresh window at the same level: the decision follows the recent rate, not all of it
                    s.level_groups = s.level_passes = s.level_trajectories = 0
        self._probabilities = None

    @staticmethod
    def _set_level(s: DomainStats, level: int) -> None:
        s.level = level
        s.level_changes += 1
        s.level_groups = s.level_passes = s.level_trajectories = 0
        s.recent_pass.clear()  # the old level's pass rate says nothing of the new one's
        s.recent_reward.clear()
        s.recent_spread.clear()

    def _in_band(self, domain: str) -> bool:
        fc = self.config.difficulty_filter
        recent = list(self.stats[domain].recent_pass)[-fc.window:]
        if len(recent) < fc.window:
            return True  # not measured yet
        return fc.low <= sum(recent) / len(recent) <= fc.high

    def pass_rate(self, domain: str) -> float:
        recent = self.stats[domain].recent_pass
        return sum(recent) / len(recent) if recent else 0.0

    def mean_reward(self, domain: str) -> float:
        recent = self.stats[domain].recent_reward
        return sum(recent) / len(recent) if recent else 0.0

    def learning_progress(self, domain: str) -> float | None:
        """The domain's adaptive signal over its last ``adaptive.window`` groups (module doc): progress,
        |newer half - older half| of their mean rewards, or learnability, the mean of their within-group
        reward standard deviations; None until that many groups are in (or without adaptive weights)."""
        a = self.config.adaptive
        if a is None:
            return None
        if a.signal == "learnability":
            spread = list(self.stats[domain].recent_spread)[-a.window:]
            return sum(spread) / len(spread) if len(spread) >= a.window else None
        recent = list(self.stats[domain].recent_reward)[-a.window:]
        if len(recent) < a.window:
            return None
        half = len(recent) // 2
        old, new = recent[:half], recent[half:]
        return abs(sum(new) / len(new) - sum(old) / len(old))

    # --- views and persistence -----------------------------------------------------------------------

    def domain_view(self) -> list[dict]:
        """Per domain, as JobStatus shows it."""
        probs = self.probabilities()
        out = []
        for d in self.domains:
            s = self.stats[d]
            lp = self.learning_progress(d)
            out.append({"domain": d, "drawn": s.drawn, "groups": s.groups, "trajectories": s.trajectories,
                        "pass_rate": self.pass_rate(d), "mean_reward": self.mean_reward(d),
                        "total_pass_rate": s.passes / s.trajectories if s.trajectories else 0.0,
                        "weight": probs[d], "difficulty": s.level,
                        "max_difficulty": len(self.ladders[d]) - 1 if d in self.ladders else 0,
                        "difficulty_options": self.options(d) or {}, "level_changes": s.level_changes,
                        "zero_variance_groups": s.zero_variance_groups, "filtered_prompts": s.filtered_prompts,
                        "repeated_prompts": s.repeated_prompts,
                        "learning_progress": -1.0 if lp is None else lp, "loss_weight": self.loss_weight(d),
                        "rm_confidence": -1.0 if self.rm_confidence(d) is None else self.rm_confidence(d)})
        return out

    def state(self) -> dict:
        """The whole learned state, JSON-ready (what a checkpoint of the job holds)."""
        return {"domains": {d: {**{k: v for k, v in asdict(s).items() if not isinstance(v, deque)},
                                "recent_pass": list(s.recent_pass), "recent_reward": list(s.recent_reward),
                                "recent_spread": list(s.recent_spread),
                                "recent_rm_confidence": list(s.recent_rm_confidence)}
                            for d, s in self.stats.items()},
                "prompts": [[k, *v] for k, v in self._prompts.items()],
                # the drawn prompts' digests, least recently drawn first, as one base64 string (compact: a checkpoint
                # is written every step)
                "drawn": base64.b64encode(b"".join(self._drawn)).decode()}

    def load_state(self, state: dict) -> None:
        for d, saved in state.get("domains", {}).items():
            s = self.stats.get(d)
            if s is None:
                raise InvalidArgument(f"saved state names domain {d!r}, not one of the job's", field="state.domains")
            for k, v in saved.items():
                if k in ("recent_pass", "recent_reward", "recent_spread", "recent_rm_confidence"):
                    getattr(s, k).clear()
                    getattr(s, k).extend(v)
                else:
                    setattr(s, k, v)
            if d in self.ladders:
                s.level = min(max(s.level, 0), len(self.ladders[d]) - 1)
        self._prompts = OrderedDict((k, [g, p, t]) for k, g, p, t in state.get("prompts", []))
        try:
            drawn = base64.b64decode(state.get("drawn", ""), validate=True)
        except (ValueError, TypeError) as e:  # binascii.Error is a ValueError
            raise InvalidArgument(f"saved drawn prompts are not base64: {e}", field="state.drawn") from None
        if len(drawn) % DRAWN_KEY_BYTES:
            raise InvalidArgument(f"saved drawn prompts are {len(drawn)} bytes, not a multiple of {DRAWN_KEY_BYTES}",
                                  field="state.drawn")
        self._drawn = OrderedDict((drawn[i:i + DRAWN_KEY_BYTES], None) for i in range(0, len(drawn), DRAWN_KEY_BYTES))
        self._probabilities = None


def resolved_plan(config: SamplingConfig, domains: list[str], domain_config: dict[str, dict]) -> dict:
    """The sampling plan as plain data (for a dry run): the policies on, and per domain its starting draw
    probability, difficulty ladder and starting options."""
    policy = SamplingPolicy(config, domains, domain_config)
    probs = policy.probabilities()
    return {"policies": config.to_dict(),
            "domains": [{"domain": d, "weight": probs[d], "base_weight": config.weights.get(d, 1.0),
                         "difficulty": policy.stats[d].level, "levels": len(policy.ladders.get(d, [])),
                         "options": policy.options(d) or {}, "ladder": policy.ladders.get(d, [])}
                        for d in domains]}


def group_rm_confidence(trajectories) -> float | None:
    """A learned reward model's confidence in one scored group (see the module doc): over the trajectories
    with an OK model score (``rm``, or ``prm``; both: their mean), the mean of ``1 - |score - mean verifier
    value|`` where the trajectory has verifier components (format checks and per-test records are not
    verifiers), else of ``|2 * score - 1|``; None when no trajectory has a model score. ``trajectories``:
    protobuf Trajectories, their reward components read."""
    out = []
    for t in trajectories:
        ok = [c for c in t.reward.components if c.status == common_pb2.REWARD_STATUS_OK]
        model = [min(1.0, max(0.0, c.value)) for c in ok if c.name in ("rm", "prm")]
        if not model:
            continue
        score = sum(model) / len(model)
        verifiers = [min(1.0, max(0.0, c.value)) for c in ok if c.name not in MODEL_COMPONENTS
                     and not c.name.startswith(("format.", CASE_PREFIX))]
        out.append(1 - abs(score - sum(verifiers) / len(verifiers)) if verifiers else abs(2 * score - 1))
    return sum(out) / len(out) if out else None
