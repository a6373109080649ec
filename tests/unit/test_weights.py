import pytest
import torch

from temper.inference.weights import WeightAssembler, chunks_from_tensors
from temper.runtime.errors import InvalidArgument


def _tensors():
    torch.manual_seed(0)
    return {"a.weight": torch.randn(64, 33), "b.bias": torch.randn(5)}


def test_roundtrip_with_small_chunks():
    tensors = _tensors()
    chunks = list(chunks_from_tensors(tensors, chunk_bytes=1000, new_version=7))
    assert len(chunks) > 3 and all(len(c.data) <= 1000 for c in chunks)
    got = WeightAssembler.collect(chunks, max_chunk_bytes=1000, max_total_bytes=1 << 20)
    assert got.new_version == 7
    for name, t in tensors.items():
        assert torch.equal(got.tensors[name], t)


def test_bad_checksum_names_the_tensor():
    chunks = list(chunks_from_tensors(_tensors(), chunk_bytes=1 << 20))
    chunks[0].sha256 = "0" * 64
    with pytest.raises(InvalidArgument) as e:
        WeightAssembler.collect(chunks, 1 << 20, 1 << 20)
    assert e.value.field == "tensor a.weight" and "checksum" in e.value.message


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
