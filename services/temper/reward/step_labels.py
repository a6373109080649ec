"""Automatic step labels (Math-Shepherd, Wang et al. 2024): process labels from rollouts. No gRPC.

For a sampled trajectory of a task, the text the verifier reads (the job's response prefix +
the completion) is split into steps at the step delimiter (``temper.reward.steps.split_steps``,
the split the reward service's PRM uses). For each step i but the last, ``k`` completions are
rolled out from the prefix ``steps[0] + ... + steps[i] + delimiter`` (the start of step i + 1) and
scored by the domain's verifier (a response prefix that is a step of its own is labelled by fresh
samples; one holding the delimiter within it leaves the trajectory unlabelled); with c_i of them
correct (verifier label >= ``threshold``)

    soft_i = c_i / k          hard_i = 1 if c_i > 0 else 0

The last step's label is the trajectory's own outcome (its completion is its only continuation),
so it costs no rollout. A trajectory of S steps costs k * (S - 1) rollouts; it is labelled whole or
not at all, and never once the rollouts spent would exceed ``budget``: ``rollouts <= budget``
holds for every run. A step whose rollouts could not all be scored (a verifier ERROR) leaves its
trajectory unlabelled (an unknown outcome is not a label).

The records are process records of ``temper.reward.train`` (``prompt``, ``steps``, ``step_labels``:
the soft or the hard labels, ``label_kind`` says which; both are kept) with their provenance: the
trajectory's job, group, task and trajectory ids, the policy version that sampled it and the one
that rolled out, the verifier, k, the delimiter, the threshold and the run's budget and step bounds.

The settings of a run (``resolve_settings``) come, each on its own, from its command-line flag when
given, else the job's ``[job.step_labels]`` table, else ``LABEL_DEFAULTS``: a job budgets its labelling.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from temper.reward.steps import split_steps
from temper.runtime.errors import require
from temper.v1 import common_pb2


@dataclass(frozen=True)
class Sampled:
    """A trajectory to label, as the dataset export writes it (``temper.reward.dataset``)."""

    task: common_pb2.Task
    completion: str  # the trajectory's completion_text (without the response prefix)
    finish_reason: str = "stop"
    job_id: str = ""
    group_id: str = ""
    trajectory_id: str = ""
    policy_version: int = 0

    @classmethod
    def from_record(cls, rec: dict) -> Sampled:
        from temper.reward.dataset import task_from_record

        return cls(task_from_record(rec), rec["completion"], rec.get("finish_reason", "stop") or "stop",
                   rec.get("job_id", ""), rec.get("group_id", ""), rec.get("trajectory_id", ""),
                   int(rec.get("policy_version", 0)))


@dataclass(frozen=True)
class Rollout:
    text: str  # the continuation of the prefix, as generated
    finish_reason: str = "stop"
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Rollouts:
    """``generate``'s answer: ``k`` rollouts per prefix, and the policy version that generated them."""

    per_prefix: list[list[Rollout]]
    policy_version: int = 0


@dataclass(frozen=True)
class Verdict:
    """The verifier's score of one completion (None: not computed) and which verifier gave it."""

    label: float | None
    verifier: str


# generate(task, prefixes, k): k rollouts continuing each prefix (completion-side text: no response prefix)
Generate = Callable[[common_pb2.Task, list[str], int], Rollouts]
# score(task, completions): one Verdict per (completion_text, finish_reason, token_ids)
Score = Callable[[common_pb2.Task, list[Rollout]], list[Verdict]]


STEP_LABELS_TABLE = "job.step_labels"
# the [job.step_labels] keys and their built-in defaults; delimiter None: each domain's own (the reward config's)
LABEL_DEFAULTS: dict = {"k": 4, "budget": 256, "label": "soft", "threshold": 1.0, "min_steps": 2, "max_steps": 64,
                        "delimiter": None}
LABEL_KINDS = ("soft", "hard")
_INTEGERS = ("k", "budget", "min_steps", "max_steps")


def flag_name(key: str) -> str:
    """The command-line flag of a setting: ``min_steps`` -> ``--min-steps``."""
    return "--" + key.replace("_", "-")


def check_table(table) -> dict:
    """The ``[job.step_labels]`` table with its types checked (ranges: ``LabelOptions.check``); a mistake is
    InvalidArgument naming ``job.step_labels.KEY`` and what it allows. ``delimiter``: a string, or a table
    domain -> string (a domain it does not name keeps the reward config's delimiter)."""
    require(isinstance(table, dict), STEP_LABELS_TABLE, "must be a table")
    for key in sorted(table):
        require(key in LABEL_DEFAULTS, f"{STEP_LABELS_TABLE}.{key}", f"unknown key; allowed: {', '.join(LABEL_DEFAULTS)}")
    for key, v in table.items():
        name = f"{STEP_LABELS_TABLE}.{key}"
        if key in _INTEGERS:
            require(isinstance(v, int) and not isinstance(v, bool), name, f"must be an integer, got {v!r}")
        elif key == "threshold":
            require(isinstance(v, int | float) and not isinstance(v, bool), name, f"must be a number, got {v!r}")
        elif key == "label":
            require(v in LABEL_KINDS, name, f"one of {', '.join(LABEL_KINDS)}, got {v!r}")
        elif isinstance(v, dict):  # delimiter per domain
            for domain, d in v.items():
                require(isinstance(d, str) and d != "", f"{name}.{domain}", f"must be a non-empty string, got {d!r}")
        else:
            require(isinstance(v, str) and v != "", name,
                    f"a non-empty string or a table domain -> string, got {v!r}")
    return dict(table)


def resolve_settings(table, flags: dict) -> tuple[dict, dict]:
    """(values, sources) of every ``LABEL_DEFAULTS`` key: its flag when given (``flags[key]`` not None), else the
    ``[job.step_labels]`` ``table``'s value, else the default; sources say which (``flag --k``,
    ``job.step_labels``, ``default``). Checked whole (``LabelOptions.check``): an error names the flag or the
    table key the bad value came from."""
    table = check_table(table if table is not None else {})
    values, sources = {}, {}
    for key, default in LABEL_DEFAULTS.items():
        if flags.get(key) is not None:
            values[key], sources[key] = flags[key], f"flag {flag_name(key)}"
        elif key in table:
            values[key], sources[key] = table[key], STEP_LABELS_TABLE
        else:
            values[key], sources[key] = default, "default"
    LabelOptions(k=values["k"], budget=values["budget"], threshold=values["threshold"], label_kind=values["label"],
                 min_steps=values["min_steps"], max_steps=values["max_steps"]).check(field_of(sources))
    return values, sources


def field_of(sources: dict) -> Callable[[str], str]:
    """setting -> the name an error gives it: its flag when the flag set it, else ``job.step_labels.KEY``."""
    return lambda key: flag_name(key) if sources.get(key, "").startswith("flag") else f"{STEP_LABELS_TABLE}.{key}"


@dataclass(frozen=True)
class LabelOptions:
    k: int = LABEL_DEFAULTS["k"]
    budget: int = LABEL_DEFAULTS["budget"]  # most rollouts of one run
    delimiter: Callable[[str], str] | str = "\n"  # a string, or domain -> its delimiter
    threshold: float = LABEL_DEFAULTS["threshold"]  # a completion is correct when its verifier label is >= this
    label_kind: str = LABEL_DEFAULTS["label"]  # which labels step_labels holds: "soft" | "hard"
    min_steps: int = LABEL_DEFAULTS["min_steps"]  # fewer steps: nothing to label but the outcome
    max_steps: int = LABEL_DEFAULTS["max_steps"]  # more steps: skipped (the reward service's prm_max_steps)

    def delimiter_of(self, domain: str) -> str:
        return self.delimiter(domain) if callable(self.delimiter) else self.delimiter

    def check(self, field: Callable[[str], str] = flag_name) -> None:
        """``field``: a setting's name in the error (default: its flag; ``field_of``: its flag or table key)."""
        require(self.k >= 1, field("k"), f"must be >= 1, got {self.k}")
        require(self.budget >= 1, field("budget"), f"must be >= 1 rollout, got {self.budget}")
        require(0 < self.threshold <= 1, field("threshold"), f"must be in (0, 1], got {self.threshold}")
        require(self.label_kind in LABEL_KINDS, field("label"), f"soft or hard, got {self.label_kind!r}")
        require(self.min_steps >= 1, field("min_steps"), f"must be >= 1, got {self.min_steps}")
        require(self.max_steps >= self.min_steps, field("max_steps"), f"must be >= min_steps ({self.min_steps})")


@dataclass
class LabelRun:
    records: list[dict] = field(default_factory=list)
    rollouts: int = 0
    rollout_tokens: int = 0  # tokens the rollouts generated (what labelling spent of a generation budget)
    skipped: dict[str, int] = field(default_factory=lambda: {"too_few_steps": 0, "too_many_steps": 0,
                                                              "over_budget": 0, "score_error": 0,
                                                              "step_in_prefix": 0})
    seconds: float = 0.0

    def summary(self, budget: int) -> dict:
        return {"labelled": len(self.records), "steps": sum(len(r["steps"]) for r in self.records),
                "rollouts": self.rollouts, "rollout_tokens": self.rollout_tokens, "budget": budget,
                "skipped": dict(self.skipped),
                "seconds": round(self.seconds, 3),
                "rollouts_per_second": round(self.rollouts / self.seconds, 2) if self.seconds else 0.0}


def steps_of(sampled: Sampled, delimiter: str) -> list[str]:
    """The steps of what the verifier reads: the response prefix + the completion (as the reward service splits it)."""
    return split_steps(sampled.task.metadata.get("response_prefix", "") + sampled.completion, delimiter)


def check_delimiters(trajectories: Sequence[Sampled], options: LabelOptions, field: str = "--delimiter") -> None:
    """Refuses (naming ``delimiter``) a delimiter that occurs in none of the completions: nothing could be labelled."""
    by_domain: dict[str, list[Sampled]] = {}
    for s in trajectories:
        by_domain.setdefault(s.task.domain, []).append(s)
    require(bool(by_domain), "--from", "no outcome records with a task to label")
    for domain, items in by_domain.items():
        d = options.delimiter_of(domain)
        require(bool(d), field, f"empty step delimiter for domain {domain!r}")
        require(any(len(steps_of(s, d)) > 1 for s in items), field,
                f"{d!r} splits none of the {len(items)} completions of domain {domain!r} into two steps")


def label(trajectories: Sequence[Sampled], generate: Generate, score: Score, options: LabelOptions,
          seed: int = 0, log: Callable[[str], None] | None = None) -> LabelRun:
    """Labels the steps of ``trajectories`` (in an order drawn with ``seed``) until the budget is spent."""
    options.check()
    check_delimiters(trajectories, options)
    run = LabelRun()
    t0 = time.monotonic()
    order = list(trajectories)
    random.Random(seed).shuffle(order)
    k = options.k
    for sampled in order:
        delimiter = options.delimiter_of(sampled.task.domain)
        steps = steps_of(sampled, delimiter)
        if len(steps) < options.min_steps:
            run.skipped["too_few_steps"] += 1
            continue
        if len(steps) > options.max_steps:
            run.skipped["too_many_steps"] += 1
            continue
        cost = k * (len(steps) - 1)
        if run.rollouts + cost > options.budget:
            run.skipped["over_budget"] += 1
            continue
        response_prefix = sampled.task.metadata.get("response_prefix", "")
        full = "".join(steps)
        starts = [full[: len("".join(steps[: i + 1]))] + delimiter for i in range(len(steps) - 1)]
        if not all(p.startswith(response_prefix) for p in starts):
            # a step ends inside the prefilled response prefix: no rollout can start there
            run.skipped["step_in_prefix"] += 1
            continue
        prefixes = [p[len(response_prefix):] for p in starts]  # completion-side: the engine prefills the prefix
        rolled = generate(sampled.task, prefixes, k)
        run.rollouts += cost
        assert len(rolled.per_prefix) == len(prefixes) and all(len(r) == k for r in rolled.per_prefix), \
            "generate answered a different number of rollouts"
        run.rollout_tokens += sum(len(r.token_ids) for rs in rolled.per_prefix for r in rs)
        completions = [Rollout(p + r.text, r.finish_reason, r.token_ids)
                       for p, rs in zip(prefixes, rolled.per_prefix) for r in rs]
        completions.append(Rollout(sampled.completion, sampled.finish_reason))
        verdicts = score(sampled.task, completions)
        if any(v.label is None for v in verdicts):
            run.skipped["score_error"] += 1
            continue
        correct = [v.label >= options.threshold for v in verdicts]
        soft = [sum(correct[i * k: (i + 1) * k]) / k for i in range(len(prefixes))] + [float(correct[-1])]
        hard = [float(s > 0) for s in soft]
        run.records.append({
            "prompt": sampled.task.prompt, "steps": steps,
            "step_labels": soft if options.label_kind == "soft" else hard,
            "label_kind": options.label_kind, "soft_labels": soft, "hard_labels": hard,
            "job_id": sampled.job_id, "group_id": sampled.group_id, "task_id": sampled.task.task_id,
            "trajectory_id": sampled.trajectory_id, "domain": sampled.task.domain,
            "provenance": {"job_id": sampled.job_id, "policy_version": sampled.policy_version,
                           "rollout_policy_version": rolled.policy_version,
                           "verifier": verdicts[-1].verifier, "k": k, "delimiter": delimiter,
                           "threshold": options.threshold, "rollouts": cost, "method": "math-shepherd",
                           "budget": options.budget, "min_steps": options.min_steps,
                           "max_steps": options.max_steps}})
        if log is not None:
            log(f"{sampled.trajectory_id or sampled.task.task_id}: {len(steps)} steps, soft {soft}")
    run.seconds = time.monotonic() - t0
    return run


def split_heldout(records: Sequence[dict], fraction: float, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train, held out): whole tasks held out (a task's trajectories share their early steps, so a split by
    trajectory would test on steps seen in training); at least one task on each side when there are two."""
    tasks = sorted({r.get("task_id") or r.get("trajectory_id", "") for r in records})
    random.Random(seed).shuffle(tasks)
    n = min(len(tasks) - 1, max(1, round(fraction * len(tasks)))) if len(tasks) > 1 else 0
    held = set(tasks[:n])
    key = [r.get("task_id") or r.get("trajectory_id", "") for r in records]
    return ([r for r, k in zip(records, key) if k not in held], [r for r, k in zip(records, key) if k in held])


def step_auc(scores: Sequence[float], labels: Sequence[float]) -> float | None:
    """ROC AUC of step scores against hard step labels (label > 0.5 positive): the probability that a
    positive step scores above a negative one, ties counting half; None without both kinds."""
    pos = [s for s, y in zip(scores, labels) if y > 0.5]
    neg = [s for s, y in zip(scores, labels) if y <= 0.5]
    if not pos or not neg:
        return None
    wins = sum((p > q) + 0.5 * (p == q) for p in pos for q in neg)
    return wins / (len(pos) * len(neg))


def step_accuracy(scores: Sequence[float], labels: Sequence[float], threshold: float = 0.5) -> float | None:
    """Fraction of steps whose score is on the same side of ``threshold`` as their label."""
    if not scores:
        return None
    return sum((s > threshold) == (y > threshold) for s, y in zip(scores, labels)) / len(scores)
