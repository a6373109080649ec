"""Inference engines behind one interface; this module holds the HF transformers engine.

An engine owns the policy weights and a ``policy_version``. ``generate`` and ``apply_weights``
never interleave: a generation in flight finishes on the weights it started with, and every
completion is reported with the version that produced it. ``apply_weights`` validates every
tensor before touching the model, so a bad update leaves the old version serving.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from temper.runtime.errors import InvalidArgument, require


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
    logprobs: list[float]  # log p of each sampled token under softmax(logits / temperature), nats
    text: str
    finish_reason: str  # "stop" | "length"


@dataclass
class PromptResult:
    prompt_token_ids: list[int]
    completions: list[Completion]


class HFEngine:
    """HF transformers generation with a KV cache; for tiny models and as a fallback."""

    name = "hf"

    def __init__(self, model_dir: str | Path, dtype: torch.dtype = torch.float32):
        self.model_dir = Path(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=dtype).eval()
        self.context_length = int(getattr(self.model.config, "max_position_embeddings", 2048))
        self.policy_version = 0
        self._lock = threading.Lock()

    # -- prompts ---------------------------------------------------------------------------
    def encode(self, text: str, apply_chat_template: bool = False) -> list[int]:
        if apply_chat_template:
            return list(self.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                           add_generation_prompt=True, tokenize=True))
        return self.tokenizer(text, add_special_tokens=True).input_ids

    def validate(self, prompts: list[list[int]], params: SamplingParams) -> None:
        require(len(prompts) > 0, "prompts", "at least one prompt is required")
        require(params.n >= 1, "sampling.n", f"must be >= 1, got {params.n}")
        require(params.max_tokens >= 1, "sampling.max_tokens", f"must be >= 1, got {params.max_tokens}")
        require(params.max_tokens < self.context_length, "sampling.max_tokens",
                f"{params.max_tokens} exceeds the model's context of {self.context_length} tokens")
        require(params.temperature >= 0, "sampling.temperature", f"must be >= 0, got {params.temperature}")
        require(0 <= params.top_p <= 1, "sampling.top_p", f"must be in [0, 1], got {params.top_p}")
        require(params.top_k >= 0, "sampling.top_k", f"must be >= 0, got {params.top_k}")
        vocab = len(self.tokenizer)
        for i, ids in enumerate(prompts):
            require(len(ids) > 0, f"prompts[{i}]", "empty prompt")
            require(len(ids) + params.max_tokens <= self.context_length, f"prompts[{i}]",
                    f"{len(ids)} prompt tokens + max_tokens {params.max_tokens} exceed the context of "
                    f"{self.context_length}")
            require(all(0 <= t < vocab for t in ids), f"prompts[{i}].token_ids",
                    f"token ids must be in [0, {vocab})")

    # -- generation ------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> tuple[list[PromptResult], int]:
        self.validate(prompts, params)
        with self._lock:
            version = self.policy_version
            if params.seed is not None:
                torch.manual_seed(params.seed)
            results = self._generate_batch(prompts, params)
        return results, version

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams) -> list[PromptResult]:
        tok = self.tokenizer
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), tok.pad_token_id, dtype=torch.long)
        attention = torch.zeros_like(input_ids)
        for i, ids in enumerate(prompts):  # left padding
            input_ids[i, width - len(ids):] = torch.tensor(ids)
            attention[i, width - len(ids):] = 1
        greedy = params.temperature == 0
        kwargs = dict(do_sample=not greedy, num_return_sequences=params.n, max_new_tokens=params.max_tokens,
                      output_logits=True, return_dict_in_generate=True, pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id)
        if not greedy:
            kwargs.update(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p or 1.0)
        if params.stop:
            kwargs.update(stop_strings=list(params.stop), tokenizer=tok)
        out = self.model.generate(input_ids=input_ids, attention_mask=attention, **kwargs)
        new_tokens = out.sequences[:, width:]
        scale = params.temperature if not greedy else 1.0
        logprobs = (torch.stack(out.logits, dim=1).float() / scale).log_softmax(-1)
        token_logprobs = logprobs.gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        results = [PromptResult(prompt_token_ids=list(ids), completions=[]) for ids in prompts]
        for row in range(new_tokens.shape[0]):
            ids = new_tokens[row].tolist()
            length, finish = self._completion_length(ids, params.stop)
            results[row // params.n].completions.append(Completion(
                token_ids=ids[:length], logprobs=token_logprobs[row, :length].tolist(),
                text=tok.decode(ids[:length], skip_special_tokens=True), finish_reason=finish))
        return results

    def _completion_length(self, ids: list[int], stop: list[str]) -> tuple[int, str]:
        eos = self.tokenizer.eos_token_id
        if eos in ids:
            return ids.index(eos) + 1, "stop"
        if stop:
            for end in range(1, len(ids) + 1):
                text = self.tokenizer.decode(ids[:end], skip_special_tokens=True)
                if any(s in text for s in stop):
                    return end, "stop"
        return len(ids), "length"

    # -- weights ---------------------------------------------------------------------------
    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Name -> (shape, dtype) of every tensor an update must carry."""
        return {n: (tuple(p.shape), p.dtype) for n, p in self.model.named_parameters()}

    def apply_weights(self, tensors: dict[str, torch.Tensor], new_version: int = 0) -> int:
        """Install ``tensors`` as one new policy version; all validated before any is applied."""
        specs = self.weight_specs()
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
            require(bool(torch.isfinite(t).all()), f"tensor {name}", "contains NaN or inf")
        t0 = time.perf_counter()
        params = dict(self.model.named_parameters())
        with self._lock, torch.no_grad():
            require(new_version == 0 or new_version > self.policy_version, "new_version",
                    f"{new_version} is not newer than the serving version {self.policy_version}")
            for name, t in tensors.items():
                params[name].copy_(t)
            self.policy_version = new_version or self.policy_version + 1
            self.last_apply_seconds = time.perf_counter() - t0
            return self.policy_version
