"""The weight-update wire format: tensors as safetensors blobs, split into bounded chunks.

Sender: ``chunks_from_tensors`` yields UpdateWeightsRequest messages (chunks), one tensor after another, each
tensor's blob in order, with the blob's digest on its last chunk: XXH3-128 by default (an
integrity check against truncation and corruption that costs little next to copying the bytes)
or sha256. Receiver: ``WeightAssembler`` checks order, sizes and every digest present, and
returns the tensors only when the stream is complete and every check passed (the caller then
applies them atomically).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator

import torch
import xxhash
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from temper.runtime.errors import InvalidArgument, require
from temper.v1 import inference_pb2

DEFAULT_CHUNK_BYTES = 4 << 20  # = the server's default max_chunk_bytes
# UpdateWeightsRequest fields that carry a digest of the whole blob -> hex digest of bytes
DIGESTS = {"xxh3_128": xxhash.xxh3_128_hexdigest, "sha256": lambda blob: hashlib.sha256(blob).hexdigest()}


def chunks_from_tensors(tensors: dict[str, torch.Tensor], chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                        new_version: int = 0, checksum: str = "xxh3_128",
                        lineage: str = "") -> Iterator[inference_pb2.UpdateWeightsRequest]:
    digest_of = DIGESTS[checksum]
    first = True
    for name, tensor in tensors.items():
        blob = save_safetensors({name: tensor.detach().contiguous().cpu()})
        digest = {checksum: digest_of(blob)}
        for offset in range(0, len(blob), chunk_bytes):
            piece = blob[offset:offset + chunk_bytes]
            last = offset + len(piece) == len(blob)
            yield inference_pb2.UpdateWeightsRequest(tensor_name=name, data=piece, offset=offset, total_bytes=len(blob),
                                            new_version=new_version if first else 0, lineage=lineage if first else "",
                                            **(digest if last else {}))
            first = False


class WeightAssembler:
    """Collects a stream of UpdateWeightsRequest chunks into tensors, validating as it goes."""

    def __init__(self, max_chunk_bytes: int, max_total_bytes: int):
        self.max_chunk_bytes = max_chunk_bytes
        self.max_total_bytes = max_total_bytes
        self.tensors: dict[str, torch.Tensor] = {}
        self.new_version = 0
        self.lineage = ""
        self.bytes = 0
        self._name: str | None = None
        self._pieces: list[bytes] = []  # the current tensor's chunks, joined once at its end
        self._received = 0
        self._total = 0

    def add(self, chunk: inference_pb2.UpdateWeightsRequest, index: int) -> None:
        field = f"chunks[{index}]"
        data = chunk.data  # one copy out of the message, reused below
        require(bool(chunk.tensor_name), f"{field}.tensor_name", "required")
        require(len(data) <= self.max_chunk_bytes, f"{field}.data",
                f"{len(data)} bytes exceed the max chunk size {self.max_chunk_bytes}")
        if index == 0:
            self.new_version = chunk.new_version
            self.lineage = chunk.lineage
        if self._name is None:  # a new tensor starts
            require(chunk.tensor_name not in self.tensors, f"tensor {chunk.tensor_name}", "sent twice")
            require(chunk.offset == 0, f"{field}.offset", "a tensor's first chunk must have offset 0")
            require(0 < chunk.total_bytes <= self.max_total_bytes, f"{field}.total_bytes",
                    f"must be in (0, {self.max_total_bytes}]")
            self._name, self._total = chunk.tensor_name, chunk.total_bytes
            self._pieces, self._received = [], 0
        require(chunk.tensor_name == self._name, f"tensor {self._name}",
                f"incomplete: {self._received} of {self._total} bytes before {chunk.tensor_name!r} started")
        require(chunk.offset == self._received, f"{field}.offset", f"expected {self._received}, got {chunk.offset}")
        require(chunk.total_bytes == self._total, f"{field}.total_bytes", "changed within a tensor")
        self._received += len(data)
        self.bytes += len(data)
        require(self.bytes <= self.max_total_bytes, "chunks", f"update exceeds {self.max_total_bytes} bytes")
        require(self._received <= self._total, f"tensor {self._name}", "more bytes than total_bytes")
        self._pieces.append(data)
        if self._received == self._total:
            self._finish(chunk)

    def _finish(self, last: inference_pb2.UpdateWeightsRequest) -> None:
        name = self._name
        blob = self._pieces[0] if len(self._pieces) == 1 else b"".join(self._pieces)
        self._pieces = []
        digests = {field: getattr(last, field) for field in DIGESTS if getattr(last, field)}
        require(bool(digests), f"tensor {name}", f"the last chunk must carry a digest of the blob ({' or '.join(DIGESTS)})")
        for field, expected in digests.items():
            require(DIGESTS[field](blob) == expected.lower(), f"tensor {name}", f"checksum mismatch ({field})")
        try:
            loaded = load_safetensors(blob)
        except Exception as e:  # noqa: BLE001 - any parse failure is the sender's fault
            raise InvalidArgument(f"not a safetensors blob: {e}", field=f"tensor {name}") from e
        require(list(loaded) == [name], f"tensor {name}", f"blob holds {list(loaded)}, expected [{name!r}]")
        self.tensors[name] = loaded[name]
        self._name = None

    def finish(self) -> dict[str, torch.Tensor]:
        if self._name is not None:
            raise InvalidArgument(f"stream ended after {self._received} of {self._total} bytes",
                                  field=f"tensor {self._name}")
        require(bool(self.tensors), "chunks", "no tensors received")
        return self.tensors

    @classmethod
    def collect(cls, chunks: Iterable[inference_pb2.UpdateWeightsRequest], max_chunk_bytes: int,
                max_total_bytes: int) -> WeightAssembler:
        assembler = cls(max_chunk_bytes, max_total_bytes)
        for i, chunk in enumerate(chunks):
            assembler.add(chunk, i)
        assembler.finish()
        return assembler
