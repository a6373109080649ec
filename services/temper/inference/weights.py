"""The weight-update wire format: tensors as safetensors blobs, split into bounded chunks.

Sender: ``chunks_from_tensors`` yields UpdateWeightsRequest messages (chunks), or their wire bytes built
straight from the tensors' memory, one tensor after another, each tensor's blob in order, with the blob's
digest on its last chunk: XXH3-128 by default (an integrity check against truncation and corruption that
costs little next to copying the bytes) or sha256. The server reads each chunk with ``decode_chunk`` (its
``data`` a view of the received bytes, not two copies as upb makes). Receiver: ``WeightAssembler`` checks
order and sizes as chunks arrive, reads the blob's
safetensors header from its first bytes (one tensor, of the name the chunks carry; its dtype, shape
and size agreeing with ``total_bytes``), allocates that tensor once and copies each chunk's bytes
straight into it while hashing them (XXH3 as they arrive; sha256, if that is the digest sent, over
the finished blob): no joined blob, no second copy. It returns the tensors only when the stream is
complete and every digest present matched (the caller then applies them atomically).
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Iterable, Iterator

import numpy as np
import torch
import xxhash

from temper.client.transport import varint
from temper.runtime.errors import InvalidArgument, require
from temper.v1 import inference_pb2

DEFAULT_CHUNK_BYTES = 4 << 20  # = the server's default max_chunk_bytes
# UpdateWeightsRequest fields that carry a digest of the whole blob -> hex digest of bytes
DIGESTS = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}  # checksum name -> a streaming hash
# safetensors dtype names -> torch dtypes (what safetensors.torch writes)
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
MAX_HEADER_BYTES = 1 << 20  # one tensor's header is ~100 bytes; more is not a blob of ours


TORCH_TO_SAFETENSORS = {v: k for k, v in SAFETENSORS_DTYPES.items()}


def tensor_entry(info: object, data_bytes: int) -> tuple[torch.dtype, list[int], int, int]:
    """One safetensors header entry checked against a data section of ``data_bytes``: (dtype, shape, start, end),
    its bytes' place in that section. ValueError saying what is wrong: not an entry, an unknown dtype, a bad
    shape, data_offsets that disagree with the shape or leave the section. Both readers of safetensors from
    outside use it: a streamed blob (``_Incoming``) and a stored file (``policy_store.read_version``)."""
    if not (isinstance(info, dict) and info.get("dtype") in SAFETENSORS_DTYPES and isinstance(info.get("shape"), list)):
        raise ValueError(f"bad entry {str(info)[:200]}")
    shape = info["shape"]
    if not all(type(d) is int and d >= 0 for d in shape):
        raise ValueError(f"bad shape {str(shape)[:200]}")
    dtype = SAFETENSORS_DTYPES[info["dtype"]]
    nbytes = math.prod(shape) * dtype.itemsize
    offsets = info.get("data_offsets")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= data_bytes and offsets[1] - offsets[0] == nbytes):
        raise ValueError(f"{info['dtype']} {shape} is {nbytes} bytes, data_offsets {str(offsets)[:100]}, "
                         f"{data_bytes} bytes of data")
    return dtype, shape, offsets[0], offsets[1]


def safetensors_parts(name: str, tensor: torch.Tensor) -> tuple[bytes, memoryview]:
    """The safetensors blob of one tensor as (length prefix + header, the tensor's own bytes without a copy):
    byte for byte what ``safetensors.torch.save({name: tensor})`` writes (compact JSON, padded with spaces to
    8 bytes), so a receiver cannot tell them apart."""
    head, (data,) = safetensors_file_parts({name: tensor})
    return head, data


def safetensors_file_parts(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
                           ) -> tuple[bytes, list[memoryview]]:
    """A safetensors file of ``tensors`` as (length prefix + header, each tensor's own bytes without a copy, in
    the order the header places them): writing the parts one after another writes the file with one copy of
    the data, where ``safetensors.torch.save_file`` first builds the whole file in memory. Wider dtypes first
    (as safetensors orders them), so every tensor starts aligned to its dtype for readers that map the file."""
    flat = {}
    for name, tensor in tensors.items():
        t = tensor.detach().contiguous().cpu()
        if t.dtype not in TORCH_TO_SAFETENSORS:
            raise InvalidArgument(f"tensor {name}: dtype {t.dtype} has no safetensors name", field="tensors")
        flat[name] = t
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    views, offset = [], 0
    for name in sorted(flat, key=lambda n: -flat[n].element_size()):  # stable: names keep their order
        t = flat[name]
        data = memoryview(t.reshape(-1).view(torch.uint8).numpy())
        header[name] = {"dtype": TORCH_TO_SAFETENSORS[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        views.append(data)
        offset += len(data)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded, views


def chunks_from_tensors(tensors: dict[str, torch.Tensor], chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                        new_version: int = 0, checksum: str = "xxh3_128", lineage: str = "",
                        encoded: bool = False) -> Iterator[inference_pb2.UpdateWeightsRequest | bytes]:
    """Each tensor's safetensors blob in chunks of at most ``chunk_bytes``, its digest on its last chunk. The blob
    is never built: the digest is taken over the header and the tensor's memory. ``encoded``: each chunk as its
    UpdateWeightsRequest wire bytes (what ``InferenceClient.update_weights`` sends as they are), the tensor's
    bytes copied once, straight into them; otherwise as messages (protobuf takes no views: a copy into the
    message, another when it is serialized)."""
    if checksum not in DIGESTS:
        raise InvalidArgument(f"checksum {checksum!r} is not one of {sorted(DIGESTS)}", field="checksum")
    first = True
    for name, tensor in tensors.items():
        prefix, data = safetensors_parts(name, tensor)
        state = DIGESTS[checksum]()
        state.update(prefix)
        state.update(data)
        digest = {checksum: state.hexdigest()}
        total, head = len(prefix) + len(data), len(prefix)
        for offset in range(0, total, chunk_bytes):
            end = min(offset + chunk_bytes, total)
            pieces = [prefix[offset:min(end, head)]] if offset < head else []
            pieces.append(data[max(offset - head, 0):max(end - head, 0)])
            fields = dict(tensor_name=name, offset=offset, total_bytes=total, new_version=new_version if first else 0,
                          lineage=lineage if first else "", **(digest if end == total else {}))
            first = False
            if encoded:  # the fields but data, then data (field 2) framed by hand: order is free on the wire
                size = sum(len(p) for p in pieces)
                yield b"".join([inference_pb2.UpdateWeightsRequest(**fields).SerializeToString(), b"\x12",
                                varint(size), *pieces])
            else:
                yield inference_pb2.UpdateWeightsRequest(data=b"".join(pieces), **fields)


class Chunk:
    """An UpdateWeightsRequest read from its wire bytes by ``decode_chunk``: the same fields, ``data`` a view
    of those bytes rather than a copy (upb copies it into the message, and reading the field copies it again)."""

    __slots__ = ("tensor_name", "data", "offset", "total_bytes", "sha256", "new_version", "xxh3_128", "lineage",
                 "stored_id")

    def __init__(self):
        self.tensor_name = self.sha256 = self.xxh3_128 = self.lineage = self.stored_id = ""
        self.data = memoryview(b"")
        self.offset = self.total_bytes = self.new_version = 0


_STRINGS = {1: "tensor_name", 5: "sha256", 7: "xxh3_128", 8: "lineage", 9: "stored_id"}
_UINT64 = {3: "offset", 4: "total_bytes"}


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value & 0xFFFFFFFFFFFFFFFF, pos
        shift += 7
        if shift >= 70:
            raise ValueError("varint longer than 10 bytes")


def decode_chunk(wire: bytes) -> Chunk:
    """An UpdateWeightsRequest from its wire bytes, as protobuf reads it (the last value of a field wins, a
    field of another wire type or number is skipped as unknown), ``data`` without a copy. Malformed bytes
    (a truncated field, a bad UTF-8 string, a group) raise ValueError, which the server's runtime answers as
    INVALID_ARGUMENT naming the stream's item (temper.runtime.rpc), as it does a message upb cannot parse."""
    buf = memoryview(wire)
    chunk = Chunk()
    pos, n = 0, len(buf)
    while pos < n:
        key, pos = _read_varint(buf, pos)
        number, kind = key >> 3, key & 7
        if number == 0 or number > 0x1FFFFFFF:
            raise ValueError(f"field number {number}")
        if kind == 0:
            value, pos = _read_varint(buf, pos)
            if number in _UINT64:
                setattr(chunk, _UINT64[number], value)
            elif number == 6:  # int64: two's complement
                chunk.new_version = value - (1 << 64) if value >> 63 else value
        elif kind == 2:
            size, pos = _read_varint(buf, pos)
            if size > n - pos:
                raise ValueError("a field runs past the end")
            view, pos = buf[pos:pos + size], pos + size
            if number == 2:
                chunk.data = view
            elif number in _STRINGS:
                try:
                    setattr(chunk, _STRINGS[number], str(view, "utf-8"))
                except UnicodeDecodeError as e:
                    raise ValueError(f"{_STRINGS[number]} is not UTF-8") from e
        elif kind in (1, 5):
            pos += 8 if kind == 1 else 4
            if pos > n:
                raise ValueError("a field runs past the end")
        else:
            raise ValueError(f"wire type {kind} (field {number})")
    return chunk


class _Incoming:
    """One tensor being received: its safetensors header (buffered until whole), then its data copied
    straight into the tensor it describes, hashed on the way."""

    def __init__(self, name: str, total: int):
        self.name, self.total = name, total
        self.received = 0
        self.xxh3 = xxhash.xxh3_128()
        self._head = bytearray()  # the 8-byte length and the JSON header, until both are whole
        self.header = b""
        self.tensor: torch.Tensor | None = None
        self._dst: np.ndarray | None = None  # the tensor's bytes, writable
        self._filled = 0

    def add(self, data: bytes) -> None:
        self.xxh3.update(data)
        self.received += len(data)
        view = memoryview(data)
        if self.tensor is None:
            view = self._read_header(view)
            if self.tensor is None:
                return
        if len(view):
            self._dst[self._filled:self._filled + len(view)] = np.frombuffer(view, dtype=np.uint8)
            self._filled += len(view)

    def _read_header(self, view: memoryview) -> memoryview:
        """Take header bytes from ``view``; once the header is whole, allocate the tensor; the rest of ``view``."""
        field = f"tensor {self.name}"
        need = 8 if len(self._head) < 8 else 8 + struct.unpack("<Q", self._head[:8])[0]
        take = min(need - len(self._head), len(view))
        self._head += view[:take]
        view = view[take:]
        if len(self._head) == 8:
            size = struct.unpack("<Q", self._head)[0]
            require(0 < size <= MAX_HEADER_BYTES and 8 + size <= self.total, field,
                    f"not a safetensors blob: header of {size} bytes")
            return self._read_header(view) if len(view) else view
        if len(self._head) < need:
            return view
        self.header = bytes(self._head)
        try:
            meta = json.loads(self.header[8:])
        except ValueError as e:
            raise InvalidArgument(f"not a safetensors blob: {e}", field=field) from e
        require(isinstance(meta, dict), field, "not a safetensors blob: the header is not an object")
        names = [k for k in meta if k != "__metadata__"]
        require(names == [self.name], field, f"blob holds {names}, expected [{self.name!r}]")
        data_bytes = self.total - len(self.header)
        try:
            dtype, shape, start, end = tensor_entry(meta[self.name], data_bytes)
        except ValueError as e:
            raise InvalidArgument(f"not a safetensors blob: {e}", field=field) from e
        require((start, end) == (0, data_bytes), field,
                f"not a safetensors blob: its tensor is bytes {start}-{end} of {data_bytes}, not all of them")
        self.tensor = torch.empty(shape, dtype=dtype)
        self._dst = self.tensor.reshape(-1).view(torch.uint8).numpy()
        return view

    def check(self, last: inference_pb2.UpdateWeightsRequest | Chunk) -> torch.Tensor:
        """The finished tensor, once every digest the last chunk carries matched."""
        field = f"tensor {self.name}"
        digests = {f: getattr(last, f) for f in DIGESTS if getattr(last, f)}
        require(bool(digests), field, f"the last chunk must carry a digest of the blob ({' or '.join(DIGESTS)})")
        for f, expected in digests.items():
            if f == "xxh3_128":
                actual = self.xxh3.hexdigest()
            else:  # the blob again, from the header kept and the tensor's own bytes
                h = hashlib.sha256(self.header)
                if self._dst is not None:
                    h.update(self._dst)
                actual = h.hexdigest()
            require(actual == expected.lower(), field, f"checksum mismatch ({f})")
        require(self.tensor is not None, field, "not a safetensors blob: it ended inside its header")
        return self.tensor


class WeightAssembler:
    """Collects a stream of UpdateWeightsRequest chunks into tensors, validating as it goes."""

    def __init__(self, max_chunk_bytes: int, max_total_bytes: int):
        self.max_chunk_bytes = max_chunk_bytes
        self.max_total_bytes = max_total_bytes
        self.tensors: dict[str, torch.Tensor] = {}
        self.new_version = 0
        self.lineage = ""
        self.bytes = 0
        self._current: _Incoming | None = None

    def add(self, chunk: inference_pb2.UpdateWeightsRequest | Chunk | bytes, index: int) -> None:
        field = f"chunks[{index}]"
        if isinstance(chunk, (bytes, bytearray, memoryview)):  # wire bytes, as the SDK sends them
            try:
                chunk = decode_chunk(chunk)
            except ValueError as e:
                raise InvalidArgument(f"not a valid message: {e}", field=field) from e
        data = chunk.data  # a Chunk's a view of the received bytes (a message's a copy); into the tensor from it
        require(not chunk.stored_id, f"{field}.stored_id", "an update by reference is the stream's only message")
        require(bool(chunk.tensor_name), f"{field}.tensor_name", "required")
        require(len(data) <= self.max_chunk_bytes, f"{field}.data",
                f"{len(data)} bytes exceed the max chunk size {self.max_chunk_bytes}")
        if index == 0:
            self.new_version = chunk.new_version
            self.lineage = chunk.lineage
        current = self._current
        if current is None:  # a new tensor starts
            require(chunk.tensor_name not in self.tensors, f"tensor {chunk.tensor_name}", "sent twice")
            require(chunk.offset == 0, f"{field}.offset", "a tensor's first chunk must have offset 0")
            require(0 < chunk.total_bytes <= self.max_total_bytes, f"{field}.total_bytes",
                    f"must be in (0, {self.max_total_bytes}]")
            current = self._current = _Incoming(chunk.tensor_name, chunk.total_bytes)
        require(chunk.tensor_name == current.name, f"tensor {current.name}",
                f"incomplete: {current.received} of {current.total} bytes before {chunk.tensor_name!r} started")
        require(chunk.offset == current.received, f"{field}.offset", f"expected {current.received}, got {chunk.offset}")
        require(chunk.total_bytes == current.total, f"{field}.total_bytes", "changed within a tensor")
        self.bytes += len(data)
        require(self.bytes <= self.max_total_bytes, "chunks", f"update exceeds {self.max_total_bytes} bytes")
        require(current.received + len(data) <= current.total, f"tensor {current.name}", "more bytes than total_bytes")
        current.add(data)
        if current.received == current.total:
            self.tensors[current.name] = current.check(chunk)
            self._current = None

    def finish(self) -> dict[str, torch.Tensor]:
        if self._current is not None:
            raise InvalidArgument(f"stream ended after {self._current.received} of {self._current.total} bytes",
                                  field=f"tensor {self._current.name}")
        require(bool(self.tensors), "chunks", "no tensors received")
        return self.tensors

    @classmethod
    def collect(cls, chunks: Iterable[inference_pb2.UpdateWeightsRequest | Chunk | bytes], max_chunk_bytes: int,
                max_total_bytes: int) -> WeightAssembler:
        assembler = cls(max_chunk_bytes, max_total_bytes)
        for i, chunk in enumerate(chunks):
            assembler.add(chunk, i)
        assembler.finish()
        return assembler
