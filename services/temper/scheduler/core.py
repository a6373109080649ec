"""The scheduler's core: a job's rollout loop with bounded off-policy lag. No gRPC server code.

Step s (0-based) is generated only once the serving policy version is >= s - max_policy_lag,
so generation never runs more than ``max_policy_lag`` learner updates ahead. Every group gets
a stable id ``<job>/s<step>/p<prompt>`` and each trajectory ``<group>/<k>``, so a redelivery
downstream is recognised.

Evaluation (``JobSpec.eval``): held-out sets per domain (``evaluation.EvalSets``), disjoint from the
training draws by prompt, answered greedily before the first step, whenever the serving version
reaches a multiple of ``eval.every``, and once the job's last version is served; the results are
in the job's status. The job is DONE after the final evaluation.

Durable job state (``Job(journal=...)``; the scheduler's sqlite file is ``temper.scheduler.store``):
the journal gets the job's checkpoint (``Job.checkpoint()``: state, steps done, the policy version the
job started from, counters, the draw RNG, the sampling policy's learned state, evaluations) when the job
is accepted, after every step it published, and at every change of state; and every outcome from the
`scored` stream is recorded there, once per group id, before the sampling policy learns it. A
scheduler that starts again restores the job from its last checkpoint plus the outcomes recorded after
it (``Job.restore``) and continues with the first step it had not finished publishing:

- a step finished before the crash is never generated again; when the serving policy version shows
  that the learner already trained on more steps than the checkpoint says (killed between the last
  publish and the checkpoint), those are taken as done too, and their draws are made again without
  generating, so the draw RNG and the per-domain draw counts continue from where the killed scheduler was;
- the step that was being published when the scheduler died is generated again from its start. Its
  groups keep their ids (``<job>/s<step>/p<i>``, drawn afresh, so their content may differ): where an
  earlier copy of an id was already published, replay stores the first copy only (it keys groups by
  id) and the outcome journal learns it once, so the learner trains on exactly ``prompts_per_step``
  groups of that step and nothing is counted twice. With dynamic sampling the regenerated step may
  keep other prompts than the first attempt did, so that one step can carry more than
  ``prompts_per_step`` distinct ids;
- counters come back as they were at the checkpoint, so the regenerated step counts once.

A dependency down (inference or reward killed, restarting, or dying mid-call: ``Job(transient=...)`` says
which errors are that) does not fail the job: each call to it is tried again, after 0.5 s doubling up to
10 s, for at most ``dependency_wait_seconds`` in a row; the job fails with the error after that. A stop or
a shutdown ends the wait.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import random
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from google.protobuf import json_format

from temper import tasks
from temper.models.adapters import NAME as ADAPTER_NAME
from temper.runtime.errors import FailedPrecondition, InvalidArgument, require
from temper.runtime.logs import get_logger
from temper.runtime.tracing import current_context_carrier, tracer
from temper.scheduler.evaluation import (
    MAX_EVAL_SAMPLES,
    MAX_EVAL_SIZE,
    EvalConfig,
    EvalSets,
    check_disjoint,
    draw_training_task,
    evaluate,
)
from temper.scheduler.sampling import SamplingConfig, SamplingPolicy, group_rm_confidence, resolved_plan
from temper.v1 import common_pb2, inference_pb2, scheduler_pb2

_log = get_logger(component="scheduler")


@functools.cache
def known_domains() -> frozenset[str]:
    return frozenset(tasks.domains())


def domain_known(domain: str) -> bool:
    """A built-in domain, or a dataset domain ``data.<name>`` (its domain_config table says which file)."""
    return domain in known_domains() or tasks.declared(domain)


MAX_STEPS = 1_000_000
DIFFICULTY_KEY = "temper.difficulty"  # task metadata: the curriculum level the task was drawn at
MAX_GROUPS_PER_STEP = 4096
MAX_GROUP_SIZE = 1024
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256


@dataclass
class JobSpec:
    job_id: str = ""
    steps: int = 150
    prompts_per_step: int = 16
    group_size: int = 8
    domains: list[str] = field(default_factory=lambda: ["toy.copy", "toy.next"])
    max_policy_lag: int = 0
    temperature: float = 1.0
    max_tokens: int = 2
    seed: int = 0
    domain_config: dict[str, dict] = field(default_factory=dict)  # domain -> the family's own options
    chat_template: bool = False  # prompts as a user turn of the model's chat template
    eval: EvalConfig = field(default_factory=EvalConfig)
    response_prefix: str = ""  # with chat_template: the prefilled start of every answer (scored with it)
    sampling: dict = field(default_factory=dict)  # the [job.sampling] table (temper.scheduler.sampling)
    stop: list[str] = field(default_factory=list)  # an answer ends after the first of these (training and eval)
    # per-domain-group LoRA adapters: name -> its domains (the [job.adapters] table); {}: one policy
    adapters: dict[str, list[str]] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, job: dict) -> JobSpec:
        """From a TOML ``[job]`` table; an unknown key is refused, naming it."""
        job = dict(job)
        known = {f for f in cls.__dataclass_fields__}
        for key in sorted(job):
            require(key in known, f"job.{key}", f"unknown field; known: {sorted(known)}")
        ev = job.pop("eval", {}) or {}
        require(isinstance(ev, dict), "job.eval", "must be a table")
        eval_known = set(EvalConfig.__dataclass_fields__)
        for key in sorted(ev):
            require(key in eval_known, f"job.eval.{key}", f"unknown field; known: {sorted(eval_known)}")
        return cls(**job, eval=EvalConfig(**ev))

    @classmethod
    def from_proto(cls, p: scheduler_pb2.JobSpec) -> JobSpec:
        config = {}
        for domain, text in p.domain_config.items():
            try:
                config[domain] = json.loads(text)
            except ValueError as e:
                raise InvalidArgument(f"not JSON: {e}", field=f"domain_config[{domain}]") from None
        spec = cls(job_id=p.job_id or f"job-{uuid.uuid4().hex[:8]}", steps=p.steps, prompts_per_step=p.prompts_per_step,
                   group_size=p.group_size, domains=list(p.domains) or ["toy.copy", "toy.next"],
                   max_policy_lag=p.max_policy_lag, temperature=p.temperature, max_tokens=p.max_tokens, seed=p.seed,
                   domain_config=config, chat_template=p.chat_template, eval=EvalConfig.from_proto(p.eval),
                   response_prefix=p.response_prefix, sampling=_json_table(p.sampling, "sampling"), stop=list(p.stop),
                   adapters={name: list(a.domains) for name, a in sorted(p.adapters.items())})
        spec.validate()
        return spec

    @functools.cached_property
    def sampling_config(self) -> SamplingConfig:
        return SamplingConfig.from_dict(self.sampling)

    def sampling_plan(self) -> dict:
        """The resolved sampling plan as plain data (what a dry run prints); validates the job first."""
        self.validate()
        return resolved_plan(self.sampling_config, self.domains, self.domain_config)

    @property
    def eval_domains(self) -> list[str]:
        """Every evaluated domain: the trained ones, then the eval-only ones (empty without evaluation)."""
        if self.eval.size <= 0:
            return []
        return [*self.domains, *(d for d in self.eval.extra_domains if d not in self.domains)]

    def validate(self) -> None:
        require(1 <= self.steps <= MAX_STEPS, "steps", f"must be in [1, {MAX_STEPS}], got {self.steps}")
        require(1 <= self.prompts_per_step <= MAX_GROUPS_PER_STEP, "prompts_per_step",
                f"must be in [1, {MAX_GROUPS_PER_STEP}], got {self.prompts_per_step}")
        require(1 <= self.group_size <= MAX_GROUP_SIZE, "group_size",
                f"must be in [1, {MAX_GROUP_SIZE}], got {self.group_size}")
        require(self.max_policy_lag >= 0, "max_policy_lag", f"must be >= 0, got {self.max_policy_lag}")
        require(self.temperature > 0, "temperature", f"must be > 0, got {self.temperature}")
        require(self.max_tokens >= 1, "max_tokens", f"must be >= 1, got {self.max_tokens}")
        require(len(self.domains) > 0, "domains", "at least one domain")
        require(not self.response_prefix or self.chat_template, "response_prefix", "needs chat_template = true")
        require(isinstance(self.stop, list) and all(isinstance(s, str) for s in self.stop), "stop",
                "must be a list of strings")
        require(len(self.stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        for s in self.stop:
            require(0 < len(s) <= MAX_STOP_CHARS, "stop", f"each string 1 to {MAX_STOP_CHARS} characters, got {s!r:.80}")
        for d in self.domains:
            require(domain_known(d), "domains",
                    f"unknown domain {d!r}; families: toy.*, math.*, code.*, chain.*, rg.<reasoning-gym family>, "
                    f"data.<name> (a dataset file declared in domain_config)")
        ev = self.eval
        require(0 <= ev.size <= MAX_EVAL_SIZE, "eval.size", f"must be in [0, {MAX_EVAL_SIZE}], got {ev.size}")
        require(ev.every >= 0, "eval.every", f"must be >= 0, got {ev.every}")
        require(ev.max_tokens >= 0, "eval.max_tokens", f"must be >= 0, got {ev.max_tokens}")
        require(0 <= ev.samples <= MAX_EVAL_SAMPLES, "eval.samples", f"must be in [0, {MAX_EVAL_SAMPLES}], got {ev.samples}")
        require(math.isfinite(ev.temperature) and ev.temperature >= 0, "eval.temperature",
                f"must be >= 0 (0: greedy), got {ev.temperature}")
        require(ev.temperature > 0 or ev.samples <= 1, "eval.samples",
                f"{ev.samples} greedy answers per problem would be identical: set eval.temperature > 0")
        require(ev.size > 0 or not ev.extra_domains, "eval.extra_domains", "needs eval.size >= 1")
        require(ev.size == 0 or ev.seed != self.seed, "eval.seed",
                f"must differ from the job's seed {self.seed} (held-out problems come from a seed of their own)")
        for d in ev.extra_domains:
            require(domain_known(d), "eval.extra_domains", f"unknown domain {d!r}")
        used = set(self.domains) | set(ev.extra_domains)
        for d in sorted(used):
            require(not tasks.declared(d) or d in self.domain_config, f"domain_config[{d}]",
                    f"{d} is a dataset domain: declare it with [job.domain_config.\"{d}\"] (path, prompt_field, "
                    "answer_field, verifier)")
        for d, options in self.domain_config.items():
            require(d in used, f"domain_config[{d}]", "configures a domain the job neither trains nor evaluates")
            tasks.check_config(d, options, field=f"domain_config[{d}]")
        self.sampling_config.validate(self.domains, self.domain_config)
        self._validate_adapters(used)

    def _validate_adapters(self, used: set[str]) -> None:
        require(isinstance(self.adapters, dict), "adapters", "must be a table: adapter name -> list of domains")
        owner: dict[str, str] = {}
        for name, domains in self.adapters.items():
            field_name = f"adapters.{name}"
            require(bool(ADAPTER_NAME.fullmatch(str(name))), field_name, f"adapter name must match {ADAPTER_NAME.pattern}")
            require(isinstance(domains, list) and len(domains) > 0 and all(isinstance(d, str) for d in domains),
                    field_name, "must be a non-empty list of domains")
            for d in domains:
                require(d in used, field_name, f"{d!r} is a domain the job neither trains nor evaluates")
                require(d not in owner, field_name, f"{d!r} is in adapter {owner.get(d)!r} already: one adapter per domain")
                owner[d] = name
        if self.adapters:
            for d in self.domains:
                require(d in owner, "adapters", f"trained domain {d!r} is in no adapter: with adapters, every "
                                                "trained domain trains exactly one")

    def adapter_of(self, domain: str) -> str:
        """The LoRA adapter ``domain`` generates with and trains ("": none, the base policy)."""
        for name, domains in self.adapters.items():
            if domain in domains:
                return name
        return ""

    def eval_sets(self) -> EvalSets | None:
        """The held-out sets (None without evaluation), checked disjoint enough from training."""
        if self.eval.size <= 0:
            return None
        sets = EvalSets(self.eval_domains, self.eval.size, self.eval.seed, self.domain_config)
        check_disjoint(sets, self.domains, self.domain_config)
        return sets

    def to_proto(self) -> scheduler_pb2.JobSpec:
        return scheduler_pb2.JobSpec(job_id=self.job_id, steps=self.steps, prompts_per_step=self.prompts_per_step,
                                     group_size=self.group_size, domains=self.domains,
                                     max_policy_lag=self.max_policy_lag, temperature=self.temperature,
                                     max_tokens=self.max_tokens, seed=self.seed,
                                     domain_config={d: json.dumps(c, sort_keys=True)
                                                    for d, c in self.domain_config.items()},
                                     chat_template=self.chat_template, eval=self.eval.to_proto(),
                                     response_prefix=self.response_prefix,
                                     sampling=json.dumps(self.sampling, sort_keys=True) if self.sampling else "",
                                     stop=self.stop,
                                     adapters={name: scheduler_pb2.AdapterDomains(domains=domains)
                                               for name, domains in self.adapters.items()})


def _json_table(text: str, field_name: str) -> dict:
    if not text:
        return {}
    try:
        table = json.loads(text)
    except ValueError as e:
        raise InvalidArgument(f"not JSON: {e}", field=field_name) from None
    require(isinstance(table, dict), field_name, "must be a JSON object")
    return table


class JobJournal(Protocol):
    """Where a job's durable state goes (``temper.scheduler.store.JobStore``)."""

    def save(self, spec: JobSpec, checkpoint: dict) -> None:
        """Replace the job's checkpoint, atomically; durable when it returns."""

    def record_outcome(self, job_id: str, group_id: str, outcome: dict) -> int | None:
        """Record one scored group's outcome, durably; its sequence number, or None if that group id was
        recorded before (a redelivery, or a regenerated copy of a group: it is not learned again)."""


ACTIVE = (scheduler_pb2.JOB_STATE_RUNNING, scheduler_pb2.JOB_STATE_PAUSED)  # the states a restarted scheduler resumes
COUNTERS = ("steps_done", "groups_published", "draws_skipped", "groups_scored", "zero_variance_dropped",
            "refill_groups", "unfilled_groups")
# a domain is warned of once at least this share of its (at least this many) training draws repeat earlier prompts
REPEAT_WARN_SHARE = 0.5
REPEAT_WARN_MIN_DRAWS = 32


def repeats_warned(drawn: int, repeated: int) -> bool:
    """Whether a domain's training draws repeat earlier prompts as often as the scheduler warns of."""
    return drawn >= REPEAT_WARN_MIN_DRAWS and repeated >= REPEAT_WARN_SHARE * drawn


class _Stopped(Exception):
    """The job was stopped (or its process is shutting down) while it waited for a dependency."""


class Job:
    """Runs one job on a thread of its own.

    ``generate(prompts, spec, seed)`` calls inference: a GenerateResponse, or a list of them covering the
    prompts in order (a step split over replicas, each part with its own policy version); ``publish(group)`` returns once
    the group is durably in the `rollouts` topic; ``policy_version()`` reads the serving version.
    With evaluation, ``answer(prompts, max_tokens, n, temperature, seed)`` answers held-out prompts and
    ``score(group)`` scores a group synchronously (the reward service). The held-out sets are built
    (and checked) here, so a bad one refuses the job before any work. ``journal`` keeps the job's state
    durable (module docstring); without one the job lives in memory only.
    """

    def __init__(self, spec: JobSpec, generate: Callable[[list[str], JobSpec, int], inference_pb2.GenerateResponse
                                                          | list[inference_pb2.GenerateResponse]],
                 publish: Callable[[common_pb2.RolloutGroup], None], policy_version: Callable[[], int],
                 answer: Callable[[list[str], int, int, float, int], inference_pb2.GenerateResponse] | None = None,
                 score: Callable[[common_pb2.RolloutGroup], common_pb2.RolloutGroup] | None = None,
                 final_eval_wait_seconds: float = 3600.0, journal: JobJournal | None = None,
                 transient: Callable[[BaseException], bool] | None = None, dependency_wait_seconds: float = 600.0):
        self.spec = spec
        self._journal = journal
        self._transient = transient or (lambda e: False)
        self._dependency_wait = dependency_wait_seconds
        self._generate = self._retrying(generate, "generate")
        self._publish = publish
        self._policy_version = self._retrying(policy_version, "policy version")
        self._answer = self._retrying(answer, "answer") if answer is not None else None
        self._score = self._retrying(score, "score") if score is not None else None
        self.eval_sets = spec.eval_sets()
        require(self.eval_sets is None or (answer is not None and score is not None), "eval",
                "this scheduler cannot evaluate (no inference/reward clients)")
        require(spec.sampling_config.dynamic_sampling is None or score is not None, "sampling.dynamic_sampling",
                "this scheduler cannot score groups (no reward service address)")
        self._final_eval_wait = final_eval_wait_seconds
        self.sampling = SamplingPolicy(spec.sampling_config, spec.domains, spec.domain_config)
        self._lock = threading.Lock()  # the sampling state: drawn on the job's thread, learned on the consumer's
        self._save_lock = threading.Lock()
        self.groups_scored = 0
        self.zero_variance_dropped = 0
        self.refill_groups = 0
        self.unfilled_groups = 0
        self.state = scheduler_pb2.JOB_STATE_RUNNING
        self.steps_done = 0
        self.groups_published = 0
        self.draws_skipped = 0
        self.evals: list[scheduler_pb2.EvalResult] = []
        self.error = ""
        self.pause_reason = ""
        self._next_eval: int | None = None  # the serving version at which the next periodic evaluation is due
        self._final_version = 0
        self.start_version: int | None = None  # the serving policy version when the job started (None: not yet)
        self._outcomes_seq = 0  # the last journal outcome the sampling policy learned
        self._stop = threading.Event()
        self._halting = False  # the process is going away: the job's state stays as it is, to be resumed
        self._resume = threading.Event()  # clear while paused: the loop holds before its next step
        self._resume.set()
        self._rng = random.Random(spec.seed)
        self._repeat_warned: set[str] = set()  # domains warned of repeating prompts
        self._thread = threading.Thread(target=self._run, name=f"job-{spec.job_id}", daemon=True)
        self._tracer = tracer("temper.scheduler")

    def start(self) -> Job:
        self._thread.start()
        return self

    def _retrying(self, call: Callable, what: str) -> Callable:
        """``call``, tried again while it fails with a transient error (module docstring)."""
        @functools.wraps(call)
        def retried(*args, **kwargs):
            delay, deadline = 0.5, None
            while True:
                try:
                    return call(*args, **kwargs)
                except Exception as e:
                    if not self._transient(e):
                        raise
                    now = time.monotonic()
                    deadline = deadline or now + self._dependency_wait
                    if now >= deadline:
                        raise
                    _log.warning("dependency unavailable: trying again", job_id=self.spec.job_id, call=what,
                                 error=f"{type(e).__name__}: {str(e)[:200]}", retry_in=delay)
                    if self._stop.wait(delay):
                        raise _Stopped() from e
                    delay = min(2 * delay, 10.0)
        return retried

    def stop(self) -> None:
        """End the job for good (StopJob): it is STOPPED, and a restarted scheduler does not resume it."""
        self._end_thread()
        if self.state in ACTIVE:
            self.state = scheduler_pb2.JOB_STATE_STOPPED
            self.save()

    def abandon(self, reason: str) -> None:
        """A restored job that cannot continue (its thread never started): STOPPED with ``reason``, saved."""
        self.state = scheduler_pb2.JOB_STATE_STOPPED
        self.error = reason
        _log.warning("saved job not resumed", job_id=self.spec.job_id, reason=reason)
        self.save()

    def halt(self) -> None:
        """End the job's thread because this process is shutting down; its saved state stays RUNNING (or
        PAUSED), so the next scheduler on the same data dir resumes it."""
        self._halting = True
        self._end_thread()

    def _end_thread(self) -> None:
        self._stop.set()
        self._resume.set()
        if self._thread.is_alive():
            self._thread.join(30)

    def pause(self, reason: str = "") -> None:
        """Hold the job before its next step; the step in flight (if any) finishes and is published."""
        if self.state not in (scheduler_pb2.JOB_STATE_RUNNING, scheduler_pb2.JOB_STATE_PAUSED):
            raise FailedPrecondition(f"job {self.spec.job_id} is {scheduler_pb2.JobState.Name(self.state)}",
                                     field="job_id")
        self._resume.clear()
        self.state = scheduler_pb2.JOB_STATE_PAUSED
        self.pause_reason = reason
        self.save()
        _log.warning("job paused", job_id=self.spec.job_id, reason=reason)

    def resume(self) -> None:
        if self.state not in (scheduler_pb2.JOB_STATE_RUNNING, scheduler_pb2.JOB_STATE_PAUSED):
            raise FailedPrecondition(f"job {self.spec.job_id} is {scheduler_pb2.JobState.Name(self.state)}",
                                     field="job_id")
        self.state = scheduler_pb2.JOB_STATE_RUNNING
        self.pause_reason = ""
        self.save()
        self._resume.set()
        _log.info("job resumed", job_id=self.spec.job_id)

    def status(self) -> scheduler_pb2.JobStatus:
        return scheduler_pb2.JobStatus(job_id=self.spec.job_id, state=self.state, steps_done=self.steps_done,
                                       steps=self.spec.steps, groups_published=self.groups_published, error=self.error,
                                       spec=self.spec.to_proto(), pause_reason=self.pause_reason,
                                       evals=list(self.evals), eval_draws_skipped=self.draws_skipped,
                                       domains=self._domain_status(), groups_scored=self.groups_scored,
                                       zero_variance_groups_dropped=self.zero_variance_dropped,
                                       refill_groups=self.refill_groups, unfilled_groups=self.unfilled_groups)

    def _run(self) -> None:
        try:
            if self.start_version is None:  # a new job (or one that crashed before its first evaluation ended)
                start_version = self._policy_version()
                if self.eval_sets is not None:
                    self._evaluate("before")
                    every = self.spec.eval.every
                    self._next_eval = start_version + every if every > 0 else None
                    self._final_version = start_version + self.spec.steps
                self.start_version = start_version
                self.save()
            else:
                self._catch_up()
            start_version = self.start_version
            for step in range(self.steps_done, self.spec.steps):
                self._resume.wait()
                if self._stop.is_set():
                    return
                if not self._wait_for_policy(start_version + step - self.spec.max_policy_lag):
                    return
                self.run_step(step)
                self.steps_done = step + 1
                self.save()
            if self.eval_sets is not None:
                # the learner's last update: one version per step after the job's first
                last = start_version + self.spec.steps
                if not self._wait_for_policy(last, timeout=self._final_eval_wait):
                    if self._stop.is_set():
                        return
                    _log.warning("final evaluation before the last version", job_id=self.spec.job_id,
                                 expected=last, serving=self._policy_version())
                self._evaluate("final")
            self.state = scheduler_pb2.JOB_STATE_DONE
            self.save()
        except _Stopped:  # stopped or halted while a dependency was down: stop() / halt() set the state
            return
        except Exception as e:  # noqa: BLE001 - the job fails, the service keeps serving
            if self._halting:  # a client closed under it at shutdown: not the job's failure; it resumes
                _log.warning("job halted mid-step", job_id=self.spec.job_id, error=f"{type(e).__name__}: {e}")
                return
            _log.exception("job failed", job_id=self.spec.job_id)
            self.error = f"{type(e).__name__}: {e}"
            self.state = scheduler_pb2.JOB_STATE_FAILED
            try:
                self.save()
            except Exception:  # noqa: BLE001 - the failure is what matters; a resumed copy would fail again
                _log.exception("saving the failed job's state failed", job_id=self.spec.job_id)

    def _catch_up(self) -> None:
        """A resumed job: steps the learner has already trained on count as done (see the module docstring)."""
        trained = min(self._policy_version() - self.start_version, self.spec.steps)
        if trained > self.steps_done:
            _log.warning("resumed behind the learner: counting its trained steps as done", job_id=self.spec.job_id,
                         checkpoint_steps=self.steps_done, trained_steps=trained)
            # they were published whole (the learner trains a step's groups only once all are in). Their draws
            # are made again, without generating: the draw RNG and the per-domain draw counts then stand where
            # the killed scheduler left them (exact without dynamic sampling; with it a step's refill draws
            # depended on scores that are gone, so such a step counts its prompts_per_step draws only)
            for step in range(self.steps_done, trained):
                for i in range(self.spec.prompts_per_step):
                    self._draw_task(step, i)
            self.groups_published += (trained - self.steps_done) * self.spec.prompts_per_step
            self.steps_done = trained
            self.save()
        _log.info("job resumed from its saved state", job_id=self.spec.job_id, steps_done=self.steps_done,
                  steps=self.spec.steps, start_version=self.start_version,
                  state=scheduler_pb2.JobState.Name(self.state))

    def _wait_for_policy(self, version: int, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._stop.is_set():
            serving = self._policy_version()
            self._maybe_evaluate(serving)
            if version <= 0 or serving >= version:
                return True
            if deadline is not None and time.monotonic() > deadline:
                return False
            self._stop.wait(0.02)
        return False

    def _maybe_evaluate(self, serving: int) -> None:
        if self._next_eval is not None and self.eval_sets is not None and serving >= self._next_eval:
            if serving < self._final_version:  # the last version gets the final evaluation instead
                self._evaluate("during")
            while self._next_eval <= serving:
                self._next_eval += self.spec.eval.every

    def _evaluate(self, phase: str) -> None:
        spec = self.spec
        with self._tracer.start_as_current_span("scheduler.eval", attributes={"temper.job_id": spec.job_id,
                                                                               "temper.eval.phase": phase}):
            result = evaluate(self.eval_sets, self._answer, self._score, spec.eval.max_tokens or spec.max_tokens, phase,
                              job_id=spec.job_id, response_prefix=spec.response_prefix, samples=spec.eval.samples,
                              temperature=spec.eval.temperature, seed=spec.eval.seed,
                              adapters={d: spec.adapter_of(d) for d in spec.eval_domains} if spec.adapters else None)
        self.evals.append(result)
        _log.info("eval", job_id=spec.job_id, phase=phase, policy_version=result.policy_version,
                  accuracy={d: round(a, 3) for d, a in result.accuracy.items()}, seconds=round(result.seconds, 2))

    def _draw_task(self, step: int, i: int) -> common_pb2.Task:
        """The sampling policy's next domain and difficulty; a prompt the difficulty filter refuses is redrawn."""
        spec = self.spec
        fc = self.sampling.config.difficulty_filter
        with self._lock:
            for _ in range((fc.max_redraws if fc else 0) + 1):
                domain, level, options = self.sampling.draw(self._rng)
                task, skipped = draw_training_task(domain, self._rng, f"{spec.job_id}/s{step}/p{i}", options,
                                                   self.eval_sets)
                self.draws_skipped += skipped
                if self.sampling.keep_prompt(domain, task.prompt):
                    break
            if self.sampling.note_drawn(domain, task.prompt):
                self._warn_repeats(domain)
        task.metadata[DIFFICULTY_KEY] = str(level)
        if spec.response_prefix:
            task.metadata["response_prefix"] = spec.response_prefix
        return task

    def _warn_repeats(self, domain: str) -> None:
        """Warn once per domain (per process) when most of its training draws repeat earlier prompts."""
        s = self.sampling.stats[domain]
        if domain not in self._repeat_warned and repeats_warned(s.drawn, s.repeated_prompts):
            self._repeat_warned.add(domain)
            _log.warning("training prompts repeat", job_id=self.spec.job_id, domain=domain, drawn=s.drawn,
                         repeated=s.repeated_prompts,
                         hint="the domain has few distinct problems for this job: training memorises them and its "
                              "held-out accuracy stops following its reward (widen it in domain_config)")

    def _groups(self, step: int, first: int, step_tasks: list[common_pb2.Task], seed: int
                ) -> list[common_pb2.RolloutGroup]:
        spec = self.spec
        # with per-domain-group adapters, each prompt is generated with its domain's adapter (``adapters=``)
        names = {"adapters": [spec.adapter_of(t.domain) for t in step_tasks]} if spec.adapters else {}
        response = self._generate([t.prompt for t in step_tasks], spec, seed, **names)
        # one response, or one per replica's chunk in prompt order (temper.scheduler.replicas): each its version
        responses = [response] if isinstance(response, inference_pb2.GenerateResponse) else list(response)
        answered = [(result, r.policy_version) for r in responses for result in r.results]
        if len(answered) != len(step_tasks):  # never a group lost or answered twice
            raise FailedPrecondition(f"inference answered {len(answered)} results for {len(step_tasks)} prompts",
                                     field="results")
        trace_context = current_context_carrier()  # the learner step that trains on these groups links here
        with self._lock:
            loss_weights = {d: self.sampling.loss_weight(d) for d in {t.domain for t in step_tasks}}
        groups = []
        for i, (task, (result, version)) in enumerate(zip(step_tasks, answered), start=first):
            group_id = f"{spec.job_id}/s{step}/p{i}"
            groups.append(common_pb2.RolloutGroup(
                group_id=group_id, job_id=spec.job_id, step=step, task=task, created_unix_ms=int(time.time() * 1000),
                trace_context=trace_context, step_groups=spec.prompts_per_step, loss_weight=loss_weights[task.domain],
                adapter=spec.adapter_of(task.domain),
                trajectories=[common_pb2.Trajectory(
                    trajectory_id=f"{group_id}/{k}", group_id=group_id,
                    prompt_token_ids=result.prompt_token_ids, completion_token_ids=c.token_ids,
                    completion_logprobs=c.logprobs, policy_version=version,
                    completion_text=c.text, finish_reason=c.finish_reason,
                    sampling_temperature=spec.temperature) for k, c in enumerate(result.completions)]))
        return groups

    def run_step(self, step: int) -> None:
        """Draw, generate and publish one step's ``prompts_per_step`` groups. With dynamic sampling each group
        is scored first (the reward service's Score) and one whose rewards are all equal is left out and
        replaced by a fresh draw, within the refill budget; what is published then goes to `rollouts` as
        always (the stream scores it again)."""
        spec = self.spec
        n = spec.prompts_per_step
        ds = self.sampling.config.dynamic_sampling
        budget = n + (int(ds.max_refill_ratio * n) if ds else 0)
        with self._tracer.start_as_current_span("scheduler.step", attributes={"temper.job_id": spec.job_id,
                                                                               "temper.step": step}):
            kept: list[common_pb2.RolloutGroup] = []
            uniform: list[common_pb2.RolloutGroup] = []
            drawn = 0
            for round_ in itertools.count():
                want = min(n - len(kept), budget - drawn)
                if want <= 0:
                    break
                step_tasks = [self._draw_task(step, drawn + j) for j in range(want)]
                # a seed per step (and refill round): a job's sampling is reproducible given its outcomes
                seed = spec.seed * 1_000_003 + step if round_ == 0 else (spec.seed * 1_000_003 + step) * 1_000 + round_
                groups = self._groups(step, drawn, step_tasks, seed)
                drawn += want
                if ds is None:
                    kept = groups
                    break
                with ThreadPoolExecutor(min(8, len(groups))) as pool:
                    scored = list(pool.map(self._score, groups))
                for group, result in zip(groups, scored):
                    rewards = self._observe(result)
                    informative = rewards is None or self.sampling.is_informative(rewards)
                    (kept if informative else uniform).append(group)
            if ds is not None:
                self.refill_groups += drawn - min(drawn, n)
                short = n - len(kept)
                kept += uniform[:short]  # the budget ran out: the step is filled with what it has
                self.unfilled_groups += min(short, len(uniform))
                self.zero_variance_dropped += len(uniform) - min(short, len(uniform))
            for group in kept:
                group.step_groups = len(kept)
                self._publish(group)
                self.groups_published += 1

    @staticmethod
    def _outcome(group: common_pb2.RolloutGroup) -> dict | None:
        """What the sampling policy learns from a scored group, as plain data (None when no reward is OK:
        the learner drops such a group)."""
        rewards = [t.reward.total for t in group.trajectories if t.reward.status == common_pb2.REWARD_STATUS_OK]
        if not rewards:
            return None
        try:
            level = int(group.task.metadata.get(DIFFICULTY_KEY, "0"))
        except ValueError:
            level = -1  # never counts toward a level's window
        return {"domain": group.task.domain, "level": level, "prompt": group.task.prompt, "rewards": rewards,
                "rm_confidence": group_rm_confidence(group.trajectories)}

    def _learn(self, outcome: dict) -> None:
        """(Under ``self._lock``.)"""
        self.sampling.observe(outcome["domain"], outcome["level"], outcome["prompt"], outcome["rewards"],
                              outcome.get("rm_confidence"))  # absent from outcomes journaled before it was kept
        self.groups_scored += 1

    def _observe(self, group: common_pb2.RolloutGroup) -> list[float] | None:
        """Learn one group the job scored itself (dynamic sampling); its OK rewards (None when none is OK)."""
        outcome = self._outcome(group)
        if outcome is None:
            return None
        with self._lock:
            self._learn(outcome)
        return outcome["rewards"]

    def observe_scored(self, group: common_pb2.RolloutGroup) -> None:
        """A group of this job from the `scored` stream. With dynamic sampling the job scored (and learned)
        its groups itself before publishing them, so the stream's copy is not counted twice. With a journal
        a group id is learned once: a redelivery, or a regenerated copy of a group, is not learned again."""
        if group.job_id != self.spec.job_id or self.sampling.config.dynamic_sampling is not None:
            return
        outcome = self._outcome(group)
        if outcome is None:
            return
        with self._lock:
            if self._journal is not None:
                seq = self._journal.record_outcome(self.spec.job_id, group.group_id, outcome)
                if seq is None:
                    return
                self._outcomes_seq = seq
            self._learn(outcome)

    # --- durable state --------------------------------------------------------------------------

    def checkpoint(self) -> dict:
        """Everything a restarted scheduler needs to continue the job, as JSON-ready plain data."""
        with self._lock:
            version, internal, gauss = self._rng.getstate()
            return {"state": int(self.state), "error": self.error, "pause_reason": self.pause_reason,
                    "start_version": self.start_version, "next_eval": self._next_eval,
                    "final_version": self._final_version, **{k: getattr(self, k) for k in COUNTERS},
                    "rng": [version, list(internal), gauss], "sampling": self.sampling.state(),
                    "outcomes_seq": self._outcomes_seq,
                    "evals": [json_format.MessageToDict(e) for e in self.evals]}

    def restore(self, checkpoint: dict, outcomes: list[tuple[int, dict]] = ()) -> Job:
        """The job as ``checkpoint`` left it, then the journal's ``(seq, outcome)`` recorded after it learned
        (the thread is not started)."""
        with self._lock:
            self.state = int(checkpoint["state"])
            self.error = checkpoint.get("error", "")
            self.pause_reason = checkpoint.get("pause_reason", "")
            self.start_version = checkpoint.get("start_version")
            self._next_eval = checkpoint.get("next_eval")
            self._final_version = int(checkpoint.get("final_version", 0))
            for key in COUNTERS:
                setattr(self, key, int(checkpoint.get(key, 0)))
            version, internal, gauss = checkpoint["rng"]
            self._rng.setstate((version, tuple(internal), gauss))
            self.sampling.load_state(checkpoint.get("sampling", {}))
            self.evals = [json_format.ParseDict(e, scheduler_pb2.EvalResult()) for e in checkpoint.get("evals", [])]
            self._outcomes_seq = int(checkpoint.get("outcomes_seq", 0))
            for seq, outcome in outcomes:
                if seq > self._outcomes_seq:
                    self._learn(outcome)
                    self._outcomes_seq = seq
        if self.state == scheduler_pb2.JOB_STATE_PAUSED:
            self._resume.clear()
        return self

    def save(self) -> None:
        """Write the job's checkpoint to its journal (if it has one)."""
        if self._journal is not None:
            with self._save_lock:  # checkpoint and write as one: a pause never overtakes a step's save
                self._journal.save(self.spec, self.checkpoint())

    def sampling_state(self) -> dict:
        """The job's learned sampling state and counters as plain data (what a checkpoint of the job holds)."""
        with self._lock:
            return {"policy": self.sampling.state(), "groups_scored": self.groups_scored,
                    "zero_variance_dropped": self.zero_variance_dropped, "refill_groups": self.refill_groups,
                    "unfilled_groups": self.unfilled_groups}

    def load_sampling_state(self, state: dict) -> None:
        with self._lock:
            self.sampling.load_state(state.get("policy", {}))
            for key in ("groups_scored", "zero_variance_dropped", "refill_groups", "unfilled_groups"):
                setattr(self, key, int(state.get(key, 0)))

    def _domain_status(self) -> list[scheduler_pb2.DomainStatus]:
        with self._lock:
            view = self.sampling.domain_view()
        return [scheduler_pb2.DomainStatus(**{**d, "difficulty_options": json.dumps(d["difficulty_options"],
                                                                                      sort_keys=True)},
                                           adapter=self.spec.adapter_of(d["domain"]))
                for d in view]
