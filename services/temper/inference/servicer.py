"""gRPC InferenceService: translates protobuf <-> engine objects, nothing more.

``UpdateWeights`` reads its chunks with ``decode_chunk`` (``register`` installs it): each chunk's tensor
bytes are copied once, from the received message into the tensor, not first into a protobuf message.
"""

from __future__ import annotations

import math

import grpc

from temper.inference.engine import Engine, SamplingParams
from temper.inference.weights import WeightAssembler, decode_chunk
from temper.runtime.errors import reject_unknown_fields, require
from temper.runtime.rpc import add_service
from temper.v1 import inference_pb2, inference_pb2_grpc

SERVICE = inference_pb2.DESCRIPTOR.services_by_name["InferenceService"]


class InferenceServicer(inference_pb2_grpc.InferenceServiceServicer):
    def __init__(self, engine: Engine, max_chunk_bytes: int, model_name: str, max_sequences: int = 4096):
        self.engine = engine
        self.max_chunk_bytes = max_chunk_bytes
        self.model_name = model_name
        self.max_sequences = max_sequences  # prompts x n of one request: one call must not exhaust memory
        # an update may carry every tensor at up to 8 bytes per element (float64), plus headers
        numel = sum(math.prod(shape) for shape, _ in engine.weight_specs().values())
        self.max_update_bytes = 8 * numel + (1 << 20)

    def Generate(self, request, context):
        reject_unknown_fields(request, "request")
        asked = len(request.prompts) * request.sampling.n
        require(asked <= self.max_sequences, "sampling.n" if request.sampling.n > 1 else "prompts",
                f"{len(request.prompts)} prompts x n {request.sampling.n} = {asked} completions exceed this server's "
                f"max_sequences_per_request of {self.max_sequences}")
        prompts = []
        for i, p in enumerate(request.prompts):
            kind = p.WhichOneof("input")
            require(kind is not None, f"prompts[{i}]", "set text or token_ids")
            if kind == "text":
                require(bool(p.text), f"prompts[{i}].text", "empty prompt")
                prompts.append(self.engine.encode(p.text, p.apply_chat_template, field_name=f"prompts[{i}]",
                                                  assistant_prefix=p.assistant_prefix))
            else:
                prompts.append(list(p.token_ids.ids))
        s = request.sampling
        params = SamplingParams(n=s.n, temperature=s.temperature, top_p=s.top_p or 1.0, top_k=s.top_k,
                                max_tokens=s.max_tokens, stop=list(s.stop),
                                seed=s.seed if s.HasField("seed") else None)
        # a caller whose deadline passed (or who hung up) gets nothing more generated for it
        results, version = self.engine.generate(prompts, params, cancelled=lambda: not context.is_active())
        return inference_pb2.GenerateResponse(policy_version=version, results=[
            inference_pb2.PromptResult(prompt_token_ids=r.prompt_token_ids, completions=[
                inference_pb2.Completion(token_ids=c.token_ids, logprobs=c.logprobs, text=c.text,
                                         finish_reason=c.finish_reason) for c in r.completions])
            for r in results])

    def UpdateWeights(self, request_iterator, context):
        assembler = WeightAssembler.collect(request_iterator, self.max_chunk_bytes, self.max_update_bytes)
        version = self.engine.apply_weights(assembler.tensors, assembler.new_version, assembler.lineage)
        return inference_pb2.UpdateWeightsResponse(policy_version=version, tensors=len(assembler.tensors),
                                                   bytes=assembler.bytes,
                                                   apply_seconds=self.engine.last_apply_seconds)

    def GetPolicyVersion(self, request, context):
        return inference_pb2.GetPolicyVersionResponse(policy_version=self.engine.policy_version, model=self.model_name,
                                                      engine=self.engine.name, vocab_size=self.engine.vocab_size,
                                                      lineage=self.engine.lineage)


def register(servicer: InferenceServicer, server: grpc.Server) -> str:
    """Add ``servicer`` to ``server``, UpdateWeights' chunks read by ``decode_chunk``; returns the service name."""
    return add_service(servicer, server, SERVICE, {"UpdateWeights": decode_chunk})
