"""The weight-update stream's digests: XXH3-128 (what the SDK sends) or SHA-256, each one checked."""

import pytest
import torch

from temper.inference.weights import WeightAssembler, chunks_from_tensors
from temper.runtime.errors import InvalidArgument


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
