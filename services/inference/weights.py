"""The weight-update wire format: tensors as safetensors blobs, split into bounded chunks.

Sender: ``chunks_from_tensors`` yields WeightChunk messages, one tensor after another, each
tensor's blob in order, with the blob's sha256 on its last chunk. Receiver: ``WeightAssembler``
checks order, sizes and checksums and returns the tensors only when the stream is complete
and every check passed (the caller then applies them atomically).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from temper.runtime.errors import InvalidArgument, require
from temper.v1 import inference_pb2

DEFAULT_CHUNK_BYTES = 1 << 20


def chunks_from_tensors(tensors: dict[str, torch.Tensor], chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                        new_version: int = 0) -> Iterator[inference_pb2.WeightChunk]:
    first = True
    for name, tensor in tensors.items():
        blob = save_safetensors({name: tensor.detach().contiguous().cpu()})
        digest = hashlib.sha256(blob).hexdigest()
        for offset in range(0, len(blob), chunk_bytes):
            piece = blob[offset:offset + chunk_bytes]
            last = offset + len(piece) == len(blob)
            yield inference_pb2.WeightChunk(tensor_name=name, data=piece, offset=offset, total_bytes=len(blob),
                                            sha256=digest if last else "", new_version=new_version if first else 0)
            first = False


class WeightAssembler:
    """Collects a stream of WeightChunk into tensors, validating as it goes."""

    def __init__(self, max_chunk_bytes: int, max_total_bytes: int):
        self.max_chunk_bytes = max_chunk_bytes
        self.max_total_bytes = max_total_bytes
        self.tensors: dict[str, torch.Tensor] = {}
        self.new_version = 0
        self.bytes = 0
        self._name: str | None = None
        self._buf = bytearray()
        self._total = 0

    def add(self, chunk: inference_pb2.WeightChunk, index: int) -> None:
        field = f"chunks[{index}]"
        require(bool(chunk.tensor_name), f"{field}.tensor_name", "required")
        require(len(chunk.data) <= self.max_chunk_bytes, f"{field}.data",
                f"{len(chunk.data)} bytes exceed the max chunk size {self.max_chunk_bytes}")
        if index == 0:
            self.new_version = chunk.new_version
        if self._name is None:  # a new tensor starts
            require(chunk.tensor_name not in self.tensors, f"tensor {chunk.tensor_name}", "sent twice")
            require(chunk.offset == 0, f"{field}.offset", "a tensor's first chunk must have offset 0")
            require(0 < chunk.total_bytes <= self.max_total_bytes, f"{field}.total_bytes",
                    f"must be in (0, {self.max_total_bytes}]")
            self._name, self._total, self._buf = chunk.tensor_name, chunk.total_bytes, bytearray()
        require(chunk.tensor_name == self._name, f"tensor {self._name}",
                f"incomplete: {len(self._buf)} of {self._total} bytes before {chunk.tensor_name!r} started")
        require(chunk.offset == len(self._buf), f"{field}.offset", f"expected {len(self._buf)}, got {chunk.offset}")
        require(chunk.total_bytes == self._total, f"{field}.total_bytes", "changed within a tensor")
        self._buf.extend(chunk.data)
        self.bytes += len(chunk.data)
        require(self.bytes <= self.max_total_bytes, "chunks", f"update exceeds {self.max_total_bytes} bytes")
        require(len(self._buf) <= self._total, f"tensor {self._name}", "more bytes than total_bytes")
        if len(self._buf) == self._total:
            self._finish(chunk.sha256)

    def _finish(self, sha256: str) -> None:
        name, blob = self._name, bytes(self._buf)
        require(bool(sha256), f"tensor {name}", "the last chunk must carry the sha256 of the blob")
        require(hashlib.sha256(blob).hexdigest() == sha256.lower(), f"tensor {name}", "checksum mismatch")
        try:
            loaded = load_safetensors(blob)
        except Exception as e:  # noqa: BLE001 - any parse failure is the sender's fault
            raise InvalidArgument(f"not a safetensors blob: {e}", field=f"tensor {name}") from e
        require(list(loaded) == [name], f"tensor {name}", f"blob holds {list(loaded)}, expected [{name!r}]")
        self.tensors[name] = loaded[name]
        self._name, self._buf = None, bytearray()

    def finish(self) -> dict[str, torch.Tensor]:
        if self._name is not None:
            raise InvalidArgument(f"stream ended after {len(self._buf)} of {self._total} bytes",
                                  field=f"tensor {self._name}")
        require(bool(self.tensors), "chunks", "no tensors received")
        return self.tensors

    @classmethod
    def collect(cls, chunks: Iterable[inference_pb2.WeightChunk], max_chunk_bytes: int,
                max_total_bytes: int) -> WeightAssembler:
        assembler = cls(max_chunk_bytes, max_total_bytes)
        for i, chunk in enumerate(chunks):
            assembler.add(chunk, i)
        assembler.finish()
        return assembler
