"""Scoring: a group's trajectories -> composite rewards (verifiers, reward models, penalties). No gRPC.

``Scorer.score_group`` validates the group (a bad request raises InvalidArgument naming the
field: unknown domain or verifier, missing or malformed reference, completion beyond the size
limit, empty or oversized group), then computes each component the domain's spec weighs
(``settings.RewardSettings``) and composes them (``composite.compose``). Reward-model requests
are submitted first, so their batched forward runs while the verifiers work.

``Scorer.score_or_mark`` is the stream path: a group that is a bad request comes back with every
trajectory's Reward carrying an explicit ERROR status (it must go on, marked, rather than vanish
or get a silent 0). ``SandboxUnavailable`` is not a bad request: it propagates so the caller
retries (or, configured so, the code verifier marks its components ERROR itself).

Determinism: the same group scored twice gives the same rewards (verifiers are pure functions of
the completion and the task; the reward models run in eval mode), up to float rounding of a
forward batched with different neighbours.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from temper.reward.composite import aggregate_steps, compose, length_penalty, refusal_matcher, safety_check
from temper.reward.models import MalformedSteps, RewardModelEngine, SequenceTooLong
from temper.reward.settings import MODEL_COMPONENTS, DomainSpec, ModelOptions, RewardSettings
from temper.reward.steps import split_steps, step_end_chars
from temper.reward.verifiers import Check, StepVerifier, Verifier, short
from temper.reward.verifiers.code import RunTests, SandboxUnavailable, sandbox_runner
from temper.reward.verifiers.registry import verifier_of
from temper.runtime.errors import FailedPrecondition, InvalidArgument, require
from temper.runtime.logs import get_logger
from temper.v1 import common_pb2

_log = get_logger(component="reward")
FLAG_VALUES = ("refuse", "true", "1", "yes")
NOT_LOADED = "no {what} is loaded yet ([reward.{slot}] load_later): load one with `temper reward load --{slot} DIR`"


@dataclass(frozen=True)
class LoadedModel:
    """What ``Scorer.load_model`` put in a slot."""

    slot: str
    model_dir: Path
    architecture: str
    per_token: bool
    meta: dict  # the folder's temper_reward.json
    version: int  # models loaded into this slot since the Scorer was made (1 = the first)
    replaced_dir: Path | None


def model_engine(model_dir: str | Path, options: ModelOptions) -> RewardModelEngine:
    return RewardModelEngine(model_dir, options.max_batch_size, options.max_wait_ms, options.max_tokens,
                             options.threads)


class Scorer:
    """Scores groups; thread-safe (the Score RPC and the stream consumer share one)."""

    def __init__(self, settings: RewardSettings | None = None, sandbox: RunTests | None = None,
                 rm: RewardModelEngine | None = None, prm: RewardModelEngine | None = None):
        self.settings = settings or RewardSettings()
        self.sandbox = sandbox
        self.rm = rm
        self.prm = prm
        for name, spec in self.settings.domains.items():
            if "rm" in spec.weights and rm is None and not self.settings.rm.load_later:
                raise FailedPrecondition(f"domains.{name} weighs 'rm' but no reward model is loaded (set [reward.rm] "
                                         "dir, or load_later = true to load one into the running service)")
            if "prm" in spec.weights and prm is None and not self.settings.prm.load_later:
                raise FailedPrecondition(f"domains.{name} weighs 'prm' but no process reward model is loaded "
                                         "(set [reward.prm] dir, or load_later = true to load one into the running "
                                         "service)")
        if prm is not None and not prm.per_token:
            raise FailedPrecondition(f"{prm.model_dir} is a sequence classifier; a process reward model needs per-token "
                                     "scores (*ForTokenClassification)")
        self._refusal = refusal_matcher(self.settings.safety.refusal_patterns)
        self._verifiers: dict[str, Verifier] = {}
        self._lock = threading.Lock()
        # the model slots (see ``load_model``): swapped under _models_lock; an engine replaced while score
        # calls still use it is closed by the last of them
        self._models_lock = threading.Lock()
        self._load_lock = threading.Lock()  # one load at a time (each holds a whole model in memory)
        self._users: dict[int, int] = {}
        self._retired: list[RewardModelEngine] = []
        self.versions = {slot: int(engine is not None) for slot, engine in (("rm", rm), ("prm", prm))}

    @classmethod
    def from_settings(cls, settings: RewardSettings) -> Scorer:
        """Loads the configured reward models and connects to the configured sandbox."""
        def engine(options):
            return model_engine(options.dir, options) if options.dir else None

        sandbox = sandbox_runner(settings.sandbox_address) if settings.sandbox_address else None
        return cls(settings, sandbox=sandbox, rm=engine(settings.rm), prm=engine(settings.prm))

    # -- model slots ----------------------------------------------------------------------------
    def load_model(self, slot: str, model_dir: str) -> LoadedModel:
        """Load ``model_dir`` into ``slot`` ("rm" | "prm") and swap it in; what was loaded.

        Invariant: a score call reads both slots once, at its start (``_using``), so it runs on the old
        model or on the new one, never a mix; the new engine is complete before the swap, and if it does
        not load (FailedPrecondition naming ``model_dir``) the old one keeps serving. The replaced
        engine is closed once no score call uses it any more.
        """
        require(slot in ("rm", "prm"), "slot", f"one of rm, prm; got {slot!r}")
        require(bool(model_dir.strip()), "model_dir", "required")
        path = Path(model_dir)
        try:
            is_dir = path.is_dir()
        except (OSError, ValueError) as e:  # a name too long, a NUL byte: not a path this host can open
            raise InvalidArgument(f"not a usable path: {e}", field="model_dir") from None
        require(is_dir, "model_dir", f"no such folder {model_dir}")
        options = self.settings.rm if slot == "rm" else self.settings.prm
        with self._load_lock:
            try:
                engine = model_engine(path.resolve(), options)
            except FailedPrecondition as e:
                raise FailedPrecondition(e.message, field="model_dir") from None
            except Exception as e:  # noqa: BLE001 - a folder that does not load is the caller's folder, not a crash
                raise FailedPrecondition(f"{path} does not load as a reward model: {type(e).__name__}: {e}",
                                         field="model_dir") from None
            if slot == "prm" and not engine.per_token:
                engine.close()
                raise FailedPrecondition(f"{path} is a sequence classifier; the prm slot needs per-token scores "
                                         "(*ForTokenClassification)", field="model_dir")
            with self._models_lock:
                old = getattr(self, slot)
                setattr(self, slot, engine)
                self.versions[slot] += 1
                version = self.versions[slot]
                idle = old is not None and not self._users.get(id(old))
                if old is not None and not idle:
                    self._retired.append(old)
        if idle:
            old.close()
        _log.info("model loaded", slot=slot, model_dir=str(engine.model_dir), version=version,
                  replaced=str(old.model_dir) if old is not None else "")
        return LoadedModel(slot, engine.model_dir, engine.architecture, engine.per_token, engine.meta, version,
                           old.model_dir if old is not None else None)

    @contextmanager
    def _using(self) -> Iterator[tuple[RewardModelEngine | None, RewardModelEngine | None]]:
        """The (rm, prm) engines as they are now, kept open until the caller is done with them."""
        with self._models_lock:
            engines = (self.rm, self.prm)
            for e in engines:
                if e is not None:
                    self._users[id(e)] = self._users.get(id(e), 0) + 1
        try:
            yield engines
        finally:
            done = []
            with self._models_lock:
                for e in engines:
                    if e is None:
                        continue
                    self._users[id(e)] -= 1
                    if not self._users[id(e)]:
                        del self._users[id(e)]
                        if any(e is r for r in self._retired):
                            self._retired = [r for r in self._retired if r is not e]
                            done.append(e)
            for e in done:
                e.close()

    def verifier(self, name: str) -> Verifier:
        with self._lock:
            if name not in self._verifiers:
                cls = verifier_of(name)
                assert cls is not None, name
                self._verifiers[cls.name] = cls(self.settings, sandbox=self.sandbox)
                for component in cls.components:
                    self._verifiers[component] = self._verifiers[cls.name]
            return self._verifiers[name]

    def close(self) -> None:
        with self._lock:
            for v in {id(v): v for v in self._verifiers.values()}.values():
                v.close()
            self._verifiers.clear()
        with self._models_lock:
            engines, self._retired = [self.rm, self.prm, *self._retired], []
        for engine in engines:
            if engine is not None:
                engine.close()

    # -- validation -----------------------------------------------------------------------------
    def domain_spec(self, domain: str) -> DomainSpec:
        found = self.settings.domain_spec(domain)
        require(found is not None, "group.task.domain",
                f"unknown domain {domain!r}; known: {sorted(self.settings.domains)} (and their sub-domains)")
        return found[1]

    def _weights(self, task: common_pb2.Task, spec: DomainSpec) -> dict[str, float]:
        weights = dict(spec.weights)
        override = task.metadata.get("verifier")
        if override is not None:
            require(verifier_of(override) is not None, "group.task.metadata[verifier]",
                    f"unknown verifier component {override!r}")
            weights = {k: v for k, v in weights.items() if k in MODEL_COMPONENTS} | {override: 1.0}
        return weights

    # -- scoring --------------------------------------------------------------------------------
    def score_group(self, group: common_pb2.RolloutGroup) -> common_pb2.RolloutGroup:
        """A copy of ``group`` with ``reward`` set on every trajectory."""
        with self._using() as (rm, prm):
            return self._score_group(group, rm, prm)

    def _score_group(self, group: common_pb2.RolloutGroup, rm: RewardModelEngine | None,
                     prm: RewardModelEngine | None) -> common_pb2.RolloutGroup:
        s = self.settings
        task = group.task
        require(bool(group.group_id), "group.group_id", "required")
        spec = self.domain_spec(task.domain)
        require(len(group.trajectories) > 0, "group.trajectories", "empty group")
        require(len(group.trajectories) <= s.max_group_size, "group.trajectories",
                f"{len(group.trajectories)} trajectories > max_group_size {s.max_group_size}")
        for i, traj in enumerate(group.trajectories):
            require(len(traj.completion_text) <= s.max_completion_chars, f"group.trajectories[{i}].completion_text",
                    f"{len(traj.completion_text)} characters > max_completion_chars {s.max_completion_chars}")
        weights = self._weights(task, spec)
        flagged = task.metadata.get(s.safety.flag_key, "").strip().lower() in FLAG_VALUES
        if flagged:
            # a flagged prompt is scored by its safety term (weight 1 unless the domain names one), not
            # by verifiers that check an answer
            weights.setdefault("safety", 1.0)

        # which verifiers run, and what each needs from the task (bad tasks are refused here, before any work)
        verifiers: dict[str, Verifier] = {}
        for component in weights:
            if component in MODEL_COMPONENTS:
                continue
            v = self.verifier(component)
            if flagged and v.needs_reference:
                continue  # a flagged prompt's target is the refusal, not an answer
            verifiers[v.name] = v
        prepared = {}
        for name, v in verifiers.items():
            if v.needs_reference:
                require(bool(task.reference_answer.strip()), "group.task.reference_answer",
                        f"domain {task.domain!r} ({name}) needs a reference answer")
            prepared[name] = v.prepare_group(group, "group")

        # a prefilled start of the answer (the job's response_prefix) is part of what the verifier reads
        prefix = task.metadata.get("response_prefix", "")
        completions = [with_prefix(prefix, t) for t in group.trajectories]
        # the steps of each completion, shared by every step source (PRM, step verifiers), and where each
        # ends within the trajectory's own completion_text (temper.reward.steps)
        delimiter = s.step_delimiter(spec)
        steps_of = [split_steps(c, delimiter) for c in completions]
        ends_of = [[min(e, len(t.completion_text)) for e in step_end_chars(steps, len(prefix))]
                   for steps, t in zip(steps_of, group.trajectories)]
        rm_futures = self._submit_rm(rm, task.prompt, completions) if "rm" in weights else None
        prm_futures = self._submit_prm(prm, task.prompt, completions, steps_of) if "prm" in weights else None

        checks: list[list[Check]] = [[] for _ in completions]
        for name, v in verifiers.items():
            for mine, theirs in zip(checks, self._verify(v, completions, prepared[name], steps_of, delimiter)):
                mine.extend(theirs)
        if rm_futures is not None:
            for mine, check in zip(checks, self._collect_rm(rm_futures)):
                mine.append(check)
        if prm_futures is not None:
            for mine, check in zip(checks, self._collect_prm(prm_futures, spec.prm_aggregation)):
                mine.append(check)
        if "length_penalty" in weights:
            for mine, traj in zip(checks, group.trajectories):
                n = len(traj.completion_token_ids)
                mine.append(Check("length_penalty", length_penalty(n, spec.length_penalty), detail=f"{n} tokens")
                            if n else Check("length_penalty", error="trajectory has no completion_token_ids"))
        if "safety" in weights:
            for mine, text in zip(checks, completions):
                mine.append(safety_check(text, flagged, self._refusal))

        scored = common_pb2.RolloutGroup()
        scored.CopyFrom(group)
        for traj, mine, ends in zip(scored.trajectories, checks, ends_of):
            traj.reward.CopyFrom(compose(mine, weights, ends))
        return scored

    def _verify(self, v: Verifier, completions: Sequence[str], prepared, steps_of: Sequence[Sequence[str]],
                delimiter: str) -> list[list[Check]]:
        try:
            if isinstance(v, StepVerifier):
                return v.verify_steps(steps_of, prepared, delimiter)
            return v.verify(completions, prepared)
        except (InvalidArgument, SandboxUnavailable):
            raise
        except Exception as e:  # noqa: BLE001 - a verifier bug must not block the stream: explicit ERROR
            _log.exception("verifier failed", verifier=v.name)
            return [[Check(c, error=short(f"{v.name} failed: {type(e).__name__}: {e}")) for c in v.components]
                    for _ in completions]

    def _submit_rm(self, rm: RewardModelEngine | None, prompt: str, completions: Sequence[str]
                   ) -> list[Future | Check]:
        if rm is None:  # [reward.rm] load_later, and nothing loaded yet
            return [Check("rm", error=NOT_LOADED.format(what="reward model", slot="rm"))] * len(completions)
        out: list[Future | Check] = []
        encoded, slots = [], []
        for i, c in enumerate(completions):
            try:
                encoded.append(rm.encode(prompt, [c], allow_empty=True))
                slots.append(i)
                out.append(None)  # type: ignore[arg-type]
            except (SequenceTooLong, MalformedSteps) as e:
                out.append(Check("rm", error=short(str(e))))
        for i, f in zip(slots, rm.submit(encoded) if encoded else []):
            out[i] = f
        return out

    def _submit_prm(self, prm: RewardModelEngine | None, prompt: str, completions: Sequence[str],
                    steps_of: Sequence[Sequence[str]]) -> list[Future | Check]:
        if prm is None:  # [reward.prm] load_later, and nothing loaded yet
            return [Check("prm", error=NOT_LOADED.format(what="process reward model", slot="prm"))] * len(completions)
        out: list = []
        encoded, slots = [], []
        for i, (c, steps) in enumerate(zip(completions, steps_of)):
            if not steps or not c.strip():  # the policy wrote nothing: no step to score, and nothing right
                out.append(Check("prm", 0.0, detail="no steps (empty completion): 0"))
                continue
            try:
                if len(steps) > self.settings.prm_max_steps:
                    raise MalformedSteps(f"{len(steps)} steps > prm_max_steps {self.settings.prm_max_steps}")
                encoded.append(prm.encode(prompt, steps))
                slots.append(i)
                out.append(None)
            except (SequenceTooLong, MalformedSteps) as e:
                out.append(Check("prm", error=short(f"malformed steps: {e}" if isinstance(e, MalformedSteps) else str(e))))
        for i, f in zip(slots, prm.submit(encoded) if encoded else []):
            out[i] = f
        return out

    @staticmethod
    def _collect_rm(pending: list) -> list[Check]:
        out = []
        for p in pending:
            if isinstance(p, Check):
                out.append(p)
                continue
            try:
                out.append(Check("rm", p.result()[-1]))
            except Exception as e:  # noqa: BLE001 - the forward failed: explicit ERROR, never a 0
                out.append(Check("rm", error=short(f"reward model failed: {type(e).__name__}: {e}")))
        return out

    @staticmethod
    def _collect_prm(pending: list, how: str) -> list[Check]:
        out = []
        for p in pending:
            if isinstance(p, Check):
                out.append(p)
                continue
            try:
                steps = p.result()
            except Exception as e:  # noqa: BLE001
                out.append(Check("prm", error=short(f"process reward model failed: {type(e).__name__}: {e}")))
                continue
            out.append(Check("prm", aggregate_steps(steps, how), detail=f"{len(steps)} steps, {how}",
                             steps=tuple(steps)))
        return out

    def score_or_mark(self, group: common_pb2.RolloutGroup) -> common_pb2.RolloutGroup:
        """``score_group``, or the group with an ERROR reward on every trajectory saying why."""
        try:
            return self.score_group(group)
        except InvalidArgument as e:
            return mark(group, str(e))


def mark(group: common_pb2.RolloutGroup, error: str) -> common_pb2.RolloutGroup:
    marked = common_pb2.RolloutGroup()
    marked.CopyFrom(group)
    for traj in marked.trajectories:
        traj.reward.CopyFrom(common_pb2.Reward(status=common_pb2.REWARD_STATUS_ERROR, components=[
            common_pb2.RewardComponent(name="request", status=common_pb2.REWARD_STATUS_ERROR, error=error)]))
    return marked


_default: Scorer | None = None
_default_lock = threading.Lock()


def default_scorer() -> Scorer:
    """A Scorer with the default settings (no reward models, no sandbox), built once."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Scorer()
        return _default


def with_prefix(prefix: str, traj: common_pb2.Trajectory) -> str:
    """What the verifier reads of a completion that continues a prefilled ``prefix``: prefix + completion.
    A prefix that opens a tag (``<answer>``) the completion never closes is closed where the
    completion stopped (EOS or a stop string: the answer ended there); a cut-off one is left open."""
    text = prefix + traj.completion_text
    m = re.fullmatch(r"(?s).*<([A-Za-z_][\w-]*)>\s*", prefix) if prefix else None
    if m and traj.finish_reason == "stop" and f"</{m.group(1)}>" not in traj.completion_text:
        text += f"</{m.group(1)}>"
    return text


def score_group(group: common_pb2.RolloutGroup) -> common_pb2.RolloutGroup:
    return default_scorer().score_group(group)


def score_or_mark(group: common_pb2.RolloutGroup) -> common_pb2.RolloutGroup:
    return default_scorer().score_or_mark(group)
