"""Entry point: python -m temper.inference [--config FILE] [--model-dir DIR] [--port P] ..."""

from __future__ import annotations

import sys

from temper.inference.engine import HFEngine
from temper.inference.servicer import InferenceServicer
from temper.runtime.config import ServiceConfig, load_config
from temper.runtime.rpc import Service, serve
from temper.v1 import inference_pb2, inference_pb2_grpc


class InferenceConfig(ServiceConfig):
    section = "inference"
    model_dir: str = ".temper/models/tiny"
    engine: str = "hf"
    max_chunk_bytes: int = 4 << 20


def main(argv: list[str] | None = None) -> None:
    config = load_config(InferenceConfig, sys.argv[1:] if argv is None else argv)
    if config.engine != "hf":
        raise SystemExit(f"engine {config.engine!r} is not available yet; use engine = \"hf\"")
    engine = HFEngine(config.model_dir)
    servicer = InferenceServicer(engine, config.max_chunk_bytes, model_name=config.model_dir)

    def register(server):
        inference_pb2_grpc.add_InferenceServiceServicer_to_server(servicer, server)
        return [inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name]

    serve(config, Service("inference", register))


if __name__ == "__main__":
    main()
