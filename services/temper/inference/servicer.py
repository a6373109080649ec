"""gRPC InferenceService: translates protobuf <-> engine objects, nothing more.

``UpdateWeights`` reads its chunks with ``decode_chunk`` (``register`` installs it): each chunk's tensor
bytes are copied once, from the received message into the tensor, not first into a protobuf message.
An update by reference (one message with ``stored_id``) is read from this server's policy_dir instead
(``policy_store.read_version``): no tensor byte crosses gRPC.
"""

from __future__ import annotations

import itertools
import math

import grpc

from temper.inference.engine import Engine, SamplingParams
from temper.inference.weights import WeightAssembler, decode_chunk
from temper.inference import policy_store
from temper.runtime.errors import FailedPrecondition, reject_unknown_fields, require
from temper.runtime.rpc import add_service
from temper.v1 import inference_pb2, inference_pb2_grpc

SERVICE = inference_pb2.DESCRIPTOR.services_by_name["InferenceService"]


class InferenceServicer(inference_pb2_grpc.InferenceServiceServicer):
    def __init__(self, engine: Engine, max_chunk_bytes: int, model_name: str, max_sequences: int = 4096,
                 policy_dir: str = ""):
        self.engine = engine
        self.policy_dir = policy_dir  # where updates by reference (stored_id) are read from; "": none taken
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
        results, version = self.engine.generate(prompts, params, cancelled=lambda: not context.is_active(),
                                                adapters=[p.adapter for p in request.prompts])
        return inference_pb2.GenerateResponse(policy_version=version, results=[
            inference_pb2.PromptResult(prompt_token_ids=r.prompt_token_ids, completions=[
                inference_pb2.Completion(token_ids=c.token_ids, logprobs=c.logprobs, text=c.text,
                                         finish_reason=c.finish_reason) for c in r.completions])
            for r in results])

    def UpdateWeights(self, request_iterator, context):
        request_iterator = iter(request_iterator)
        first = next(request_iterator, None)
        if first is not None and getattr(first, "stored_id", ""):
            tensors, size = self._stored(first, request_iterator)
            version = self.engine.apply_weights(tensors, first.new_version, first.lineage)
            return inference_pb2.UpdateWeightsResponse(policy_version=version, tensors=len(tensors), bytes=size,
                                                       apply_seconds=self.engine.last_apply_seconds)
        chunks = itertools.chain([first], request_iterator) if first is not None else ()
        assembler = WeightAssembler.collect(chunks, self.max_chunk_bytes, self.max_update_bytes)
        version = self.engine.apply_weights(assembler.tensors, assembler.new_version, assembler.lineage)
        return inference_pb2.UpdateWeightsResponse(policy_version=version, tensors=len(assembler.tensors),
                                                   bytes=assembler.bytes,
                                                   apply_seconds=self.engine.last_apply_seconds)

    def _stored(self, first, rest) -> tuple[dict, int]:
        """The tensors of an update by reference (``first.stored_id``), read from this server's policy_dir."""
        require(first.new_version > 0, "new_version", "required (> 0) with stored_id: the stored version to install")
        require(not first.tensor_name and not len(first.data) and not first.total_bytes and not first.offset,
                "stored_id", "an update by reference carries no tensor fields (tensor_name, data, offset, "
                "total_bytes)")
        require(next(rest, None) is None, "chunks[1]", "an update by stored_id is the stream's only message")
        if not self.policy_dir:
            raise FailedPrecondition("this server has no policy_dir to read stored versions from: stream the chunks",
                                     field="stored_id")
        try:
            return policy_store.read_version(self.policy_dir, first.new_version, first.stored_id, first.lineage,
                                             self.max_update_bytes)
        except policy_store.NotStored as e:
            raise FailedPrecondition(f"not in this server's policy_dir ({e}): stream the chunks",
                                     field="stored_id") from e
        except ValueError as e:
            raise FailedPrecondition(str(e), field="stored_id") from e

    def GetPolicyVersion(self, request, context):
        return inference_pb2.GetPolicyVersionResponse(policy_version=self.engine.policy_version, model=self.model_name,
                                                      engine=self.engine.name, vocab_size=self.engine.vocab_size,
                                                      lineage=self.engine.lineage,
                                                      reads_stored_updates=bool(self.policy_dir))


def register(servicer: InferenceServicer, server: grpc.Server) -> str:
    """Add ``servicer`` to ``server``, UpdateWeights' chunks read by ``decode_chunk``; returns the service name."""
    return add_service(servicer, server, SERVICE, {"UpdateWeights": decode_chunk})
