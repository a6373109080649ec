"""Inference engines behind one interface; this module holds the interface and the HF engine.

An ``Engine`` owns the policy weights and a ``policy_version``. Callers on any thread call
``generate`` and ``apply_weights``; both only enqueue work for the engine's own thread, which
is the one thread that touches the model. That thread batches whatever generations are
waiting into the backend together (continuous batching in vLLM, one padded ``generate`` per
compatible group in HF), so concurrent callers share forward passes instead of queueing on a
lock.

Invariants (the learner's importance ratios depend on them):

* Every completion is produced by exactly one policy version, the one reported with it. A
  weight update waits at the head of the queue: generations admitted before it finish on the
  old weights, generations submitted after it start on the new ones, and none straddles it.
* ``apply_weights`` checks every tensor (names, shapes, finiteness) before touching the model,
  and an update whose installation fails part-way is rolled back to the previous weights, so
  a bad or partial update leaves the old version serving.
* A generation whose caller has gone (``cancelled()`` true: its gRPC deadline passed or it hung up)
  is not started, and one in flight is dropped from the batch before the next step (vLLM: aborted;
  HF: its rows stop at the next token): the engine never spends forward passes on an answer nobody
  will read. The caller gets ``DeadlineExceeded``; ``cancelled_jobs`` counts them.
* Logprobs are log p of each sampled token under the distribution it was drawn from:
  softmax(logits / temperature) after top-k / top-p filtering (temperature 0: softmax(logits)),
  in nats. With top_k = 0 and top_p = 1 (no filtering) this is exactly what the learner's
  teacher-forced pass computes.
"""

from __future__ import annotations

import itertools
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from temper.models import adapters
from temper.runtime.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, TemperError, require


def encode_prompt(tokenizer, text: str, apply_chat_template: bool = False, field_name: str = "prompt",
                  assistant_prefix: str = "") -> list[int]:
    """The token ids of a text prompt (``Prompt.text``), as every engine reads it; also for callers that
    extend a prompt with token ids of their own (the step labeller continues a completion's prefix)."""
    if assistant_prefix and not apply_chat_template:
        raise InvalidArgument("needs apply_chat_template", field=f"{field_name}.assistant_prefix")
    if apply_chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidArgument("this model's tokenizer has no chat template",
                                  field=f"{field_name}.apply_chat_template")
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             add_generation_prompt=True, tokenize=False)
        return list(tokenizer(text + assistant_prefix, add_special_tokens=False).input_ids)
    return list(tokenizer(text, add_special_tokens=True).input_ids)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: disabled
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    seed: int | None = None


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # log p of each sampled token under its sampling distribution, nats
    text: str
    finish_reason: str  # "stop" (EOS or a stop string) | "length"


@dataclass
class PromptResult:
    prompt_token_ids: list[int]
    completions: list[Completion]


@dataclass
class GenerateJob:
    """One ``generate`` call: all its prompts run on the same policy version."""

    id: int
    prompts: list[list[int]]
    params: SamplingParams
    future: Future = field(default_factory=Future)
    version: int = -1  # set when the engine thread admits it
    results: list[PromptResult | None] = field(default_factory=list)
    cancelled: Callable[[], bool] = lambda: False  # true once nobody waits for the result (the call's deadline)
    adapters: list[str] = field(default_factory=list)  # per prompt: the LoRA adapter to generate with ([]/"": none)

    def adapter(self, i: int) -> str:
        return self.adapters[i] if self.adapters else ""


@dataclass
class UpdateJob:
    tensors: dict[str, torch.Tensor]
    new_version: int
    lineage: str = ""
    future: Future = field(default_factory=Future)


class Engine(ABC):
    """The policy behind ``generate`` / ``apply_weights``; a backend implements the abstract hooks.

    Hooks run on the engine thread only: ``_admit`` hands new jobs to the backend, ``_step``
    advances them and returns the jobs that finished, ``_abort`` drops in-flight jobs after a
    backend error, ``_load_weights`` installs tensors (``None``: the weights in ``model_dir``).

    Per-domain-group LoRA adapters (``lora_adapters``; temper.models.adapters): a prompt may name one of the
    adapters the engine was started with and is generated with it (unnamed, or one not yet pushed: the base).
    An update carries either base weights or adapters (``adapters/<name>/<PEFT key>``, any of the served
    ones); ``_load_adapters`` installs them (None for a name: back to the base).
    """

    name: str
    tokenizer: Any
    context_length: int
    vocab_size: int

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self.policy_version = 0
        self.lineage = ""  # the learner run the serving version comes from ("": the base model)
        self.last_apply_seconds = 0.0
        self._ids = itertools.count()
        self._cond = threading.Condition()
        self._pending: deque[GenerateJob | UpdateJob] = deque()
        self._running: list[GenerateJob] = []  # admitted, not finished (engine thread only)
        self._closed = False
        self.max_jobs_in_flight = 0  # most generate calls ever batched together (observability, tests)
        self.cancelled_jobs = 0  # generate calls dropped because their caller had gone (before or mid-generation)
        # What a failed installation rolls back to: the last applied tensors (a host copy of the
        # weights is kept for this), or None for the weights in model_dir.
        self._installed: dict[str, torch.Tensor] | None = None
        self.adapter_names: tuple[str, ...] = ()  # per-domain-group LoRA adapters served (set by the backend)
        self.max_lora_rank = 0
        self._installed_adapters: dict[str, dict[str, torch.Tensor]] = {}
        self._thread = threading.Thread(target=self._serve, name=f"{self.name}-engine", daemon=True)

    def _start_thread(self) -> None:
        """Subclasses call this last in ``__init__``, once the backend is ready."""
        self._thread.start()

    # -- prompts ---------------------------------------------------------------------------
    def encode(self, text: str, apply_chat_template: bool = False, field_name: str = "prompt",
               assistant_prefix: str = "") -> list[int]:
        return encode_prompt(self.tokenizer, text, apply_chat_template, field_name, assistant_prefix)

    def validate(self, prompts: list[list[int]], params: SamplingParams, adapters: list[str] | None = None) -> None:
        require(len(prompts) > 0, "prompts", "at least one prompt is required")
        if adapters:
            require(len(adapters) == len(prompts), "adapters", f"{len(adapters)} adapters for {len(prompts)} prompts")
            for i, name in enumerate(adapters):
                require(not name or name in self.adapter_names, f"prompts[{i}].adapter",
                        f"{name!r} is not an adapter this server serves ({list(self.adapter_names)})")
        require(params.n >= 1, "sampling.n", f"must be >= 1, got {params.n}")
        require(params.max_tokens >= 1, "sampling.max_tokens", f"must be >= 1, got {params.max_tokens}")
        require(params.max_tokens < self.context_length, "sampling.max_tokens",
                f"{params.max_tokens} exceeds the model's context of {self.context_length} tokens")
        require(params.temperature >= 0, "sampling.temperature", f"must be >= 0, got {params.temperature}")
        require(0 < params.top_p <= 1, "sampling.top_p", f"must be in (0, 1], got {params.top_p}")
        require(params.top_k >= 0, "sampling.top_k", f"must be >= 0, got {params.top_k}")
        for i, s in enumerate(params.stop):
            require(bool(s), f"sampling.stop[{i}]", "empty stop string")
        for i, ids in enumerate(prompts):
            require(len(ids) > 0, f"prompts[{i}]", "empty prompt")
            require(len(ids) + params.max_tokens <= self.context_length, f"prompts[{i}]",
                    f"{len(ids)} prompt tokens + max_tokens {params.max_tokens} exceed the context of "
                    f"{self.context_length}")
            require(all(0 <= t < self.vocab_size for t in ids), f"prompts[{i}].token_ids",
                    f"token ids must be in [0, {self.vocab_size})")

    # -- callers (any thread) --------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 cancelled: Callable[[], bool] | None = None,
                 adapters: list[str] | None = None) -> tuple[list[PromptResult], int]:
        """Sample ``params.n`` completions per prompt; returns them and the version that made them.

        ``cancelled``: polled by the engine thread (before admission and between steps); once it is true the
        work is dropped and this raises ``DeadlineExceeded`` (the servicer passes "the call is no longer active").
        ``adapters``: per prompt, the LoRA adapter to generate with ("": the base; None: all the base)."""
        self.validate(prompts, params, adapters)
        job = GenerateJob(next(self._ids), [list(p) for p in prompts], params,
                          adapters=list(adapters) if adapters and any(adapters) else [])
        if cancelled is not None:
            job.cancelled = cancelled
        self._submit(job)
        return job.future.result()

    @abstractmethod
    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Name -> (shape, dtype) of every tensor an update must carry (HF checkpoint names)."""

    def validate_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        specs = self.weight_specs()
        base, groups = adapters.split(tensors)
        if groups:  # an update of adapters: every one served, each fitting the model (temper.models.adapters)
            first = next(n for n in tensors if n.startswith(adapters.PREFIX))
            require(bool(self.adapter_names), f"tensor {first}",
                    "this server serves no LoRA adapters ([inference] lora_adapters)")
            require(not base, f"tensor {next(iter(base), '')}", "an update carries adapters or base weights, not both")
            shapes = {n: shape for n, (shape, _) in specs.items()}
            for name, own in groups.items():
                field_name = f"tensor {adapters.PREFIX}{name}"
                require(name in self.adapter_names, field_name,
                        f"{name!r} is not an adapter this server serves ({list(self.adapter_names)})")
                adapters.check(name, own, shapes, self.max_lora_rank, field=field_name)
            return
        missing = sorted(set(specs) - set(tensors))
        extra = sorted(set(tensors) - set(specs))
        if missing:
            raise InvalidArgument(f"update lacks {len(missing)} tensor(s), first: {missing[0]}",
                                  field=f"tensor {missing[0]}")
        if extra:
            raise InvalidArgument(f"unknown tensor {extra[0]!r}", field=f"tensor {extra[0]}")
        for name, t in tensors.items():
            shape, _ = specs[name]
            require(tuple(t.shape) == shape, f"tensor {name}", f"shape {tuple(t.shape)} != expected {shape}")
            require(t.is_floating_point(), f"tensor {name}", f"dtype {t.dtype} is not floating point")
            # a NaN or inf element makes the sum non-finite, so a finite sum clears the tensor in one
            # fast pass; only a non-finite sum (possibly an overflow) needs the exact check
            require(bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all()), f"tensor {name}",
                    "contains NaN or inf")

    def apply_weights(self, tensors: dict[str, torch.Tensor], new_version: int = 0, lineage: str = "") -> int:
        """Install ``tensors`` as one new policy version (0: current + 1) of ``lineage`` (the learner run;
        "": unnamed); returns the version. Versions of two lineages never mix on one engine: once it
        serves a named lineage's version, an update of another is refused."""
        self.validate_weights(tensors)
        job = UpdateJob(tensors, new_version, lineage)
        self._submit(job)
        return job.future.result()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=60)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _submit(self, job: GenerateJob | UpdateJob) -> None:
        with self._cond:
            if self._closed:
                raise FailedPrecondition(f"the {self.name} engine is closed")
            self._pending.append(job)
            self._cond.notify_all()

    # -- the engine thread -----------------------------------------------------------------
    def _serve(self) -> None:
        while True:
            with self._cond:
                while not (self._pending or self._running or self._closed):
                    self._cond.wait()
                if self._closed:
                    break
                admitted: list[GenerateJob] = []
                while self._pending and isinstance(self._pending[0], GenerateJob):
                    admitted.append(self._pending.popleft())
                # An update at the head waits until nothing is in flight, so no generation straddles it.
                update = self._pending.popleft() if (self._pending and not admitted and not self._running) else None
            if update is not None:
                self._install(update)
                continue
            for job in admitted:
                if self._drop_if_cancelled(job):
                    continue
                job.version = self.policy_version
                job.results = [None] * len(job.prompts)
                try:
                    self._admit(job)
                except Exception as e:  # noqa: BLE001 - reported to the caller, the engine keeps serving
                    job.future.set_exception(e if isinstance(e, TemperError) else
                                             InvalidArgument(f"rejected by the {self.name} backend: {e}",
                                                             field="prompts"))
                    continue
                self._running.append(job)
            self.max_jobs_in_flight = max(self.max_jobs_in_flight, len(self._running))
            if self._running:
                self._advance()
        error = FailedPrecondition(f"the {self.name} engine is closed")
        with self._cond:
            left = [*self._pending, *self._running]
            self._pending.clear()
            self._running.clear()
        for job in left:
            if not job.future.done():
                job.future.set_exception(error)
        self._shutdown()

    def _drop_if_cancelled(self, job: GenerateJob) -> bool:
        if not job.cancelled():
            return False
        self.cancelled_jobs += 1
        job.future.set_exception(DeadlineExceeded("the caller's deadline passed (or it cancelled) before the "
                                                  "generation finished; nothing more was generated for it"))
        return True

    def _advance(self) -> None:
        gone = [job for job in self._running if job.cancelled()]
        if gone:  # callers that left since the last step: their sequences leave the batch now
            self._running = [job for job in self._running if job not in gone]
            try:
                self._abort(gone)
            finally:
                for job in gone:
                    self._drop_if_cancelled(job)
            if not self._running:
                return
        try:
            finished = self._step()
        except Exception as e:  # noqa: BLE001 - fail what was in flight, keep serving
            failed, self._running = self._running, []
            try:
                self._abort(failed)
            finally:
                for job in failed:
                    job.future.set_exception(e)
            return
        for job in finished:
            self._running.remove(job)
            if not self._drop_if_cancelled(job):  # (HF: its rows stopped early, the results are partial)
                job.future.set_result((job.results, job.version))

    def _install(self, job: UpdateJob) -> None:
        try:
            if job.lineage and self.lineage and job.lineage != self.lineage:
                raise FailedPrecondition(f"this server serves version {self.policy_version} of lineage {self.lineage}, "
                                         f"not {job.lineage}: another training run's weights", field="lineage")
            require(job.new_version == 0 or job.new_version > self.policy_version, "new_version",
                    f"{job.new_version} is not newer than the serving version {self.policy_version}")
            t0 = time.perf_counter()
            _, groups = adapters.split(job.tensors)
            try:
                if groups:
                    self._load_adapters(groups)
                else:
                    self._load_weights(job.tensors)
            except Exception as e:
                if groups:  # roll back: the old version keeps serving
                    self._load_adapters({name: self._installed_adapters.get(name) for name in groups})
                else:
                    self._load_weights(self._installed)
                raise FailedPrecondition(f"installing the update failed ({type(e).__name__}: {e}); rolled back to "
                                         f"version {self.policy_version}", field="chunks") from e
            if groups:
                self._installed_adapters.update(groups)
            else:
                self._installed = job.tensors
            self.policy_version = job.new_version or self.policy_version + 1
            self.lineage = job.lineage or self.lineage
            self.last_apply_seconds = time.perf_counter() - t0
            job.future.set_result(self.policy_version)
        except Exception as e:  # noqa: BLE001 - reported to the caller
            job.future.set_exception(e)

    @abstractmethod
    def _admit(self, job: GenerateJob) -> None: ...

    @abstractmethod
    def _step(self) -> list[GenerateJob]: ...

    def _abort(self, jobs: list[GenerateJob]) -> None:  # noqa: B027 - optional hook
        pass

    @abstractmethod
    def _load_weights(self, tensors: dict[str, torch.Tensor] | None) -> None: ...

    def _load_adapters(self, groups: dict[str, dict[str, torch.Tensor] | None]) -> None:
        """Install each adapter's PEFT tensors (scaling folded in); None: serve the base for that name."""
        raise FailedPrecondition(f"the {self.name} engine serves no LoRA adapters", field="lora_adapters")

    def _shutdown(self) -> None:  # noqa: B027 - optional hook: release the backend
        pass


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class HFEngine(Engine):
    """HF transformers generation with a KV cache; for tiny models and as a fallback.

    Waiting jobs are grouped by sampling settings (temperature, top-p, top-k, stop strings);
    each group runs as one left-padded ``generate`` of up to ``max_batch_rows`` sequences. A job
    with a seed runs alone, after ``torch.manual_seed(seed)``, so its samples do not depend on
    what else was waiting. LoRA adapters: the rows of each adapter run as their own ``generate``
    with the adapter's B @ A added to its weights (restored after).
    """

    name = "hf"

    def __init__(self, model_dir: str | Path, dtype: torch.dtype | str = torch.float32, device: str = "cpu",
                 max_batch_rows: int = 256, seed: int | None = None, lora_adapters: list[str] | None = None,
                 max_lora_rank: int = 16):
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        super().__init__(model_dir)
        self.adapter_names, self.max_lora_rank = tuple(lora_adapters or ()), max_lora_rank
        # per adapter: weight name -> (A, B), added to the weight while that adapter's rows generate
        self._deltas: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.device = _resolve_device(device)
        self.max_batch_rows = max_batch_rows
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.padding_side = "left"
        if seed is not None:
            torch.manual_seed(seed)
        if isinstance(dtype, str) and self.device.type == "cpu":
            from temper.models.dtypes import resolve_cpu_dtype

            dtype = resolve_cpu_dtype(dtype)
        dtype = getattr(torch, dtype) if isinstance(dtype, str) and dtype != "auto" else dtype
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=dtype).to(self.device).eval()
        eos = self.model.generation_config.eos_token_id
        eos = self.tokenizer.eos_token_id if eos is None else eos
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])
        # Only what this engine passes shapes sampling: no defaults (top_k=50, repetition penalty, ...)
        # from the checkpoint's generation_config leak in.
        self.model.generation_config = GenerationConfig(
            bos_token_id=self.model.config.bos_token_id, eos_token_id=sorted(self.eos_ids),
            pad_token_id=self.tokenizer.pad_token_id)
        self.context_length = int(getattr(self.model.config, "max_position_embeddings", 2048))
        self.vocab_size = min(len(self.tokenizer), int(self.model.config.vocab_size))
        self._specs = {n: (tuple(p.shape), p.dtype) for n, p in self.model.named_parameters()}
        self._start_thread()

    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return self._specs

    # -- engine thread ---------------------------------------------------------------------
    def _admit(self, job: GenerateJob) -> None:
        pass  # the jobs in self._running are the batch; _step runs them all

    def _step(self) -> list[GenerateJob]:
        groups: dict[tuple, list[GenerateJob]] = {}
        for job in self._running:
            p = job.params
            key = (p.temperature, p.top_p, p.top_k, tuple(p.stop), job.id if p.seed is not None else None)
            groups.setdefault(key, []).append(job)
        for jobs in groups.values():
            for adapter in sorted({job.adapter(i) for job in jobs for i in range(len(job.prompts))}):
                with self._adapter_applied(adapter):
                    batch: list[GenerateJob] = []
                    for job in jobs:  # calls of at most max_batch_rows sequences (a bigger job runs alone)
                        if batch and sum(len(j.prompts) * j.params.n for j in batch) + \
                                len(job.prompts) * job.params.n > self.max_batch_rows:
                            self._generate(batch, adapter)
                            batch = []
                        batch.append(job)
                    self._generate(batch, adapter)
        return list(self._running)

    @contextmanager
    def _adapter_applied(self, name: str):
        """The model's weights with adapter ``name`` added for the duration (none for "" or one not pushed yet)."""
        delta = self._deltas.get(name)
        if not delta:
            yield
            return
        params = dict(self.model.named_parameters())
        saved = {}
        with torch.no_grad():
            try:
                for weight, (a, b) in delta.items():
                    saved[weight] = params[weight].detach().clone()
                    params[weight].add_(b @ a)
                yield
            finally:
                for weight, t in saved.items():
                    params[weight].copy_(t)

    def _load_adapters(self, groups: dict[str, dict[str, torch.Tensor] | None]) -> None:
        dtype = next(self.model.parameters()).dtype
        for name, tensors in groups.items():
            if tensors is None:
                self._deltas.pop(name, None)
            else:
                self._deltas[name] = {w: (a.to(self.device, dtype), b.to(self.device, dtype))
                                      for w, (a, b) in adapters.pairs(tensors).items()}

    @torch.no_grad()
    def _generate(self, jobs: list[GenerateJob], adapter: str = "") -> None:
        tok, params = self.tokenizer, jobs[0].params
        rows = [(job, i) for job in jobs for i in range(len(job.prompts)) if job.adapter(i) == adapter
                for _ in range(job.params.n)]
        if not rows:
            return
        width = max(len(job.prompts[i]) for job, i in rows)
        input_ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
        attention = torch.zeros_like(input_ids)
        for r, (job, i) in enumerate(rows):  # left padding
            ids = job.prompts[i]
            input_ids[r, width - len(ids):] = torch.tensor(ids)
            attention[r, width - len(ids):] = 1
        greedy = params.temperature == 0
        kwargs: dict[str, Any] = dict(do_sample=not greedy, max_new_tokens=max(j.params.max_tokens for j in jobs),
                                      output_scores=True, return_dict_in_generate=True)
        if not greedy:
            kwargs.update(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
        # rows of a caller that has gone stop at the next token; the job is dropped when the call returns
        criteria = [_CallerGone([job for job, _ in rows])]
        if params.stop:
            criteria.append(_StopStrings(tok, params.stop, width))
        kwargs.update(stopping_criteria=StoppingCriteriaList(criteria))
        if params.seed is not None:
            torch.manual_seed(params.seed)
        out = self.model.generate(input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device),
                                  **kwargs)
        new_tokens = out.sequences[:, width:].cpu()
        # scores are the logits after temperature / top-k / top-p: the distribution each token was drawn from
        logprobs = torch.stack(out.scores, dim=1).float().log_softmax(-1).cpu()
        token_logprobs = logprobs.gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        for r, (job, i) in enumerate(rows):
            ids = new_tokens[r].tolist()
            length, finish = self._completion_length(ids, job.params)
            if job.results[i] is None:
                job.results[i] = PromptResult(prompt_token_ids=job.prompts[i], completions=[])
            job.results[i].completions.append(Completion(
                token_ids=ids[:length], logprobs=token_logprobs[r, :length].tolist(),
                text=tok.decode(ids[:length], skip_special_tokens=True), finish_reason=finish))

    def _completion_length(self, ids: list[int], params: SamplingParams) -> tuple[int, str]:
        ids = ids[:params.max_tokens]
        for end, t in enumerate(ids, start=1):
            if t in self.eos_ids:
                return end, "stop"
            if params.stop and any(s in self.tokenizer.decode(ids[:end], skip_special_tokens=True)
                                   for s in params.stop):
                return end, "stop"
        return len(ids), "length"

    @torch.no_grad()
    def _load_weights(self, tensors: dict[str, torch.Tensor] | None) -> None:
        if tensors is None:
            from transformers import AutoModelForCausalLM

            tensors = dict(AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
                           .named_parameters())
        params = dict(self.model.named_parameters())
        for name, t in tensors.items():
            params[name].copy_(t)


class _CallerGone(StoppingCriteria):
    """Each row of a job whose caller has gone (``GenerateJob.cancelled``) is done."""

    def __init__(self, row_jobs: list[GenerateJob]):
        self.row_jobs = row_jobs
        self.jobs = list({id(job): job for job in row_jobs}.values())

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        gone = {id(job) for job in self.jobs if job.cancelled()}
        return torch.tensor([id(job) in gone for job in self.row_jobs], dtype=torch.bool, device=input_ids.device)


class _StopStrings(StoppingCriteria):
    """Ends a row once its decoded completion contains a stop string.

    Decodes the text (as the completion's ``text`` is made) rather than matching token pieces, so
    it works for any tokenizer (transformers' own ``stop_strings`` needs a BPE-like vocabulary).
    """

    def __init__(self, tokenizer, stop: list[str], prompt_width: int):
        self.tokenizer, self.stop, self.prompt_width = tokenizer, list(stop), prompt_width

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        texts = self.tokenizer.batch_decode(input_ids[:, self.prompt_width:], skip_special_tokens=True)
        return torch.tensor([any(s in t for s in self.stop) for t in texts], device=input_ids.device)


ENGINES = ("hf", "vllm")


def build_engine(kind: str, model_dir: str | Path, **options) -> Engine:
    """The engine named by config: "hf" or "vllm"; ``options`` go to its constructor."""
    if kind == "hf":
        return HFEngine(model_dir, **options)
    if kind == "vllm":
        from temper.inference.vllm_engine import VLLMEngine

        return VLLMEngine(model_dir, **options)
    raise InvalidArgument(f"unknown engine {kind!r}; known: {list(ENGINES)}", field="engine")
