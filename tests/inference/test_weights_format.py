"""The weight-update stream: digests (XXH3-128, what the SDK sends, or SHA-256, each one checked) and the
receiver's reading of each blob's safetensors header, whatever the chunking."""

import json
import struct

import pytest
import torch
import xxhash

from temper.inference.weights import WeightAssembler, chunks_from_tensors, decode_chunk
from temper.runtime.errors import InvalidArgument
from temper.v1 import inference_pb2


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(64, 33, generator=g), "b.bias": torch.randn(5, generator=g)}


@pytest.mark.parametrize("checksum", ["xxh3_128", "sha256"])
def test_either_digest_round_trips(checksum):
    tensors = _tensors()
    chunks = list(chunks_from_tensors(tensors, chunk_bytes=700, checksum=checksum))
    last = [c for c in chunks if c.xxh3_128 or c.sha256]
    assert len(last) == len(tensors) and all(bool(getattr(c, checksum)) for c in last)
    got = WeightAssembler.collect(chunks, max_chunk_bytes=700, max_total_bytes=1 << 20).tensors
    assert all(torch.equal(got[n], t) for n, t in tensors.items())


@pytest.mark.parametrize("field", ["xxh3_128", "sha256"])
def test_any_wrong_digest_is_refused(field):
    chunks = list(chunks_from_tensors(_tensors(), chunk_bytes=700))
    last_of_a = max(i for i, c in enumerate(chunks) if c.tensor_name == "a.weight")
    setattr(chunks[last_of_a], field, "0" * 32)  # a second digest that does not match counts too
    with pytest.raises(InvalidArgument, match=f"checksum mismatch \\({field}\\)") as e:
        WeightAssembler.collect(chunks, 700, 1 << 20)
    assert e.value.field == "tensor a.weight"


def test_a_blob_without_digest_is_refused():
    chunks = list(chunks_from_tensors(_tensors(), chunk_bytes=1 << 20))
    chunks[0].ClearField("xxh3_128")
    with pytest.raises(InvalidArgument, match="digest") as e:
        WeightAssembler.collect(chunks, 1 << 20, 1 << 20)
    assert e.value.field == "tensor a.weight"


def test_corrupted_bytes_are_caught():
    chunks = list(chunks_from_tensors(_tensors(), chunk_bytes=700))
    data = bytearray(chunks[1].data)
    data[10] ^= 0xFF
    chunks[1].data = bytes(data)
    with pytest.raises(InvalidArgument, match="checksum mismatch") as e:
        WeightAssembler.collect(chunks, 700, 1 << 20)
    assert e.value.field == "tensor a.weight"


def test_chunks_are_bounded_and_carry_the_version():
    chunks = list(chunks_from_tensors(_tensors(), chunk_bytes=1000, new_version=7))
    assert len(chunks) > 3 and all(len(c.data) <= 1000 for c in chunks)
    assert [c.new_version for c in chunks] == [7] + [0] * (len(chunks) - 1)  # first chunk only
    assert WeightAssembler.collect(chunks, max_chunk_bytes=1000, max_total_bytes=1 << 20).new_version == 7


def test_truncated_stream_is_refused():
    chunks = [c for c in chunks_from_tensors(_tensors(), chunk_bytes=500) if c.tensor_name == "a.weight"]
    with pytest.raises(InvalidArgument) as e:  # the stream ends mid-tensor
        WeightAssembler.collect(chunks[:-1], 500, 1 << 20)
    assert e.value.field == "tensor a.weight"
    full = list(chunks_from_tensors(_tensors(), chunk_bytes=500))
    del full[len(chunks) - 1]  # a.weight's last chunk lost, then b.bias starts
    with pytest.raises(InvalidArgument, match="incomplete") as e:
        WeightAssembler.collect(full, 500, 1 << 20)
    assert e.value.field == "tensor a.weight"


def test_oversized_chunk_is_refused():
    chunks = list(chunks_from_tensors(_tensors(), chunk_bytes=1 << 20))
    with pytest.raises(InvalidArgument) as e:
        WeightAssembler.collect(chunks, 100, 1 << 20)
    assert e.value.field == "chunks[0].data"


@pytest.mark.parametrize("chunk_bytes", [3, 16, 97, 1 << 20])
def test_every_dtype_and_shape_round_trips_whatever_the_chunking(chunk_bytes):
    """Chunks as small as 3 bytes split the 8-byte length and the header itself; each tensor is rebuilt from them."""
    g = torch.Generator().manual_seed(1)
    tensors = {"w": torch.randn(7, 5, generator=g), "half": torch.randn(4, 3, generator=g).to(torch.bfloat16),
               "f16": torch.randn(6, generator=g).half(), "mask": torch.rand(9, generator=g) > 0.5,
               "ids": torch.arange(11, dtype=torch.int64), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4)}
    for checksum in ("xxh3_128", "sha256"):
        chunks = list(chunks_from_tensors(tensors, chunk_bytes=chunk_bytes, checksum=checksum))
        got = WeightAssembler.collect(chunks, max_chunk_bytes=chunk_bytes, max_total_bytes=1 << 20).tensors
        assert list(got) == list(tensors)
        for name, t in tensors.items():
            assert got[name].dtype == t.dtype and got[name].shape == t.shape and torch.equal(got[name], t), name



@pytest.mark.parametrize("chunk_bytes", [3, 97, 1 << 20])
def test_the_sender_writes_what_safetensors_writes_byte_for_byte(chunk_bytes):
    """The sender never builds the blob (header written by hand, data copied from the tensor's memory): joined,
    its chunks are exactly ``safetensors.torch.save`` of each tensor, a non-contiguous one and fp8 included."""
    from safetensors.torch import save

    g = torch.Generator().manual_seed(2)
    tensors = {"w": torch.randn(7, 5, generator=g), "bf16": torch.randn(4, 3, generator=g).to(torch.bfloat16),
               "mask": torch.rand(9, generator=g) > 0.5, "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4),
               "transposed": torch.randn(4, 6, generator=g).t(), "f64": torch.randn(3, dtype=torch.float64),
               "fp8": torch.randn(5, generator=g).to(torch.float8_e4m3fn), "model.layers.0.q_proj.weight": torch.ones(2)}
    for name, t in tensors.items():
        joined = b"".join(c.data for c in chunks_from_tensors({name: t}, chunk_bytes=chunk_bytes))
        assert joined == save({name: t.contiguous()}), name
    with pytest.raises(InvalidArgument, match="complex64 has no safetensors name"):
        list(chunks_from_tensors({"c": torch.zeros(2, dtype=torch.complex64)}))

def _with_header(name: str, header: dict, data: bytes) -> list:
    """A hand-made blob (8-byte length, JSON header, data) as one chunk with a correct digest."""
    head = json.dumps(header).encode()
    blob = struct.pack("<Q", len(head)) + head + data
    return [inference_pb2.UpdateWeightsRequest(tensor_name=name, data=blob, offset=0, total_bytes=len(blob),
                                               xxh3_128=xxhash.xxh3_128_hexdigest(blob))]


@pytest.mark.parametrize("header, data, words", [
    ({"w": {"dtype": "F32", "shape": [1 << 40], "data_offsets": [0, 1 << 42]}}, b"\0" * 16, "data_offsets"),
    ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 12, "12 bytes of data"),
    ({"w": {"dtype": "C64", "shape": [2], "data_offsets": [0, 16]}}, b"\0" * 16, "bad entry"),
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 16, "bytes 0-8 of 16, not all of them"),
    ({"w": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}}, b"\0" * 16, "bad shape"),
    ({"v": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 16, r"blob holds \['v'\]"),
])
def test_a_header_that_does_not_match_the_data_is_refused_before_anything_is_allocated(header, data, words):
    with pytest.raises(InvalidArgument, match=words) as e:
        WeightAssembler.collect(_with_header("w", header, data), 1 << 20, 1 << 20)
    assert e.value.field == "tensor w"


def test_bytes_that_are_no_safetensors_blob_are_refused():
    for blob in (struct.pack("<Q", 1 << 30) + b"{}", struct.pack("<Q", 4) + b"nope" + b"\0" * 8, b"\x01\x02"):
        chunk = inference_pb2.UpdateWeightsRequest(tensor_name="w", data=blob, offset=0, total_bytes=len(blob),
                                                   xxh3_128=xxhash.xxh3_128_hexdigest(blob))
        with pytest.raises(InvalidArgument, match="not a safetensors blob") as e:
            WeightAssembler.collect([chunk], 1 << 20, 1 << 20)
        assert e.value.field == "tensor w"


# -- the wire: encoded chunks and decode_chunk ---------------------------------------------------
FIELDS = ("tensor_name", "offset", "total_bytes", "sha256", "new_version", "xxh3_128", "lineage", "stored_id")


def _same(view, message) -> bool:
    return bytes(view.data) == message.data and all(getattr(view, f) == getattr(message, f) for f in FIELDS)


@pytest.mark.parametrize("chunk_bytes", [7, 700, 1 << 20])
def test_encoded_chunks_are_the_messages_wire_bytes_and_decode_without_a_copy(chunk_bytes):
    tensors = _tensors()
    messages = list(chunks_from_tensors(tensors, chunk_bytes=chunk_bytes, new_version=9, lineage="run-1"))
    wire = list(chunks_from_tensors(tensors, chunk_bytes=chunk_bytes, new_version=9, lineage="run-1", encoded=True))
    assert [inference_pb2.UpdateWeightsRequest.FromString(w) for w in wire] == messages
    views = [decode_chunk(w) for w in wire]
    assert all(_same(v, m) for v, m in zip(views, messages, strict=True))
    assert all(isinstance(v.data, memoryview) and v.data.obj is w for v, w in zip(views, wire))  # a view, no copy
    got = WeightAssembler.collect(views, chunk_bytes, 1 << 20)
    assert got.new_version == 9 and got.lineage == "run-1"
    assert all(torch.equal(got.tensors[n], t) for n, t in tensors.items())


def test_decode_chunk_reads_what_protobuf_reads():
    """Last value wins, negative int64, unknown fields of every wire type skipped, empty message."""
    m = inference_pb2.UpdateWeightsRequest(tensor_name="x", data=b"\x00\x01", offset=3, total_bytes=2 ** 64 - 1,
                                           new_version=-5, sha256="ab", xxh3_128="cd", lineage="é", stored_id="s")
    later = inference_pb2.UpdateWeightsRequest(tensor_name="y", data=b"zz", offset=4)
    unknown = b"\x98\x06\x01" + b"\xa1\x06" + b"\x00" * 8 + b"\xad\x06" + b"\x00" * 4 + b"\xa2\x06\x02hi"
    for wire in (m.SerializeToString(), m.SerializeToString() + later.SerializeToString(),
                 unknown + m.SerializeToString() + unknown, b""):
        assert _same(decode_chunk(wire), inference_pb2.UpdateWeightsRequest.FromString(wire))


@pytest.mark.parametrize("wire", [b"\x0a\xff\xff\xff\xff\x0f", b"\x0a\x05abc", b"\x18", b"\x18\xff", b"\x0a\x02\xff\xfe",
                                  b"\x00\x01", b"\xa1\x06\x00", b"\x18" + b"\xff" * 10 + b"\x01"])
def test_decode_chunk_refuses_what_protobuf_refuses(wire):
    with pytest.raises(Exception):  # noqa: B017 - upb's DecodeError
        inference_pb2.UpdateWeightsRequest.FromString(wire)
    with pytest.raises(ValueError):
        decode_chunk(wire)
