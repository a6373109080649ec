"""policy_store.read_version: the version the learner stored under an id, mapped, or a refusal that says why."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from temper.inference import policy_store
from temper.inference.policy_store import NotStored, read_version, version_file


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(3, 5, generator=g), "b.bias": torch.randn(7, generator=g).to(torch.bfloat16),
            "c.ids": torch.arange(6, dtype=torch.int64).reshape(2, 3), "d.empty": torch.zeros(0, 4)}


def test_the_stored_version_reads_back_exactly_as_views_of_the_file(tmp_path):
    tensors = _tensors()
    path = policy_store.write(tmp_path, tensors, 3, "run-1", stored_id="id-3")
    got, size = read_version(tmp_path, 3, "id-3", "run-1", 1 << 20)
    assert size == path.stat().st_size and set(got) == set(tensors)
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    # pruned (the learner keeps two versions) while mapped: the mapping keeps this version's bytes
    for v in (4, 5):
        policy_store.write(tmp_path, {k: t + 1 if t.is_floating_point() else t for k, t in tensors.items()}, v,
                           "run-1", stored_id=f"id-{v}")
    assert not path.exists() and torch.equal(got["a.weight"], tensors["a.weight"])
    got["a.weight"].add_(1)  # copy-on-write: the file is never written through a mapping
    assert torch.equal(read_version(tmp_path, 5, "id-5", "run-1", 1 << 20)[0]["a.weight"], tensors["a.weight"] + 1)


@pytest.mark.parametrize("ask", [dict(stored_id="id-other"), dict(lineage="run-2"), dict(version=4)])
def test_another_writers_file_or_a_missing_version_is_not_stored(tmp_path, ask):
    policy_store.write(tmp_path, _tensors(), 3, "run-1", stored_id="id-3")
    args = {"version": 3, "stored_id": "id-3", "lineage": "run-1", **ask}
    with pytest.raises(NotStored):
        read_version(tmp_path, args["version"], args["stored_id"], args["lineage"], 1 << 20)


def test_a_file_over_the_limit_is_refused_before_it_is_read(tmp_path):
    path = policy_store.write(tmp_path, _tensors(), 3, "run-1", stored_id="id-3")
    with pytest.raises(ValueError, match=f"{path.stat().st_size} bytes, over"):
        read_version(tmp_path, 3, "id-3", "run-1", 100)


def _raw(tmp_path, header: dict, data: bytes, version: int = 1):
    header = {"__metadata__": {"temper_id": "x", "temper_version": str(version), "temper_lineage": ""}, **header}
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)  # the data starts 8-aligned, as safetensors writes it
    version_file(tmp_path, version).write_bytes(struct.pack("<Q", len(h)) + h + data)


@pytest.mark.parametrize("entry", [
    {"dtype": "F32", "shape": [2], "data_offsets": [0, 12]},  # size disagrees with the shape
    {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},  # runs past the end of the file
    {"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]},  # unknown dtype
    {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]},
    {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]},
    "not an object"])
def test_a_malformed_file_is_refused_naming_the_entry(tmp_path, entry):
    _raw(tmp_path, {"w": entry}, b"\x00" * 8)
    with pytest.raises(ValueError, match="'w'"):
        read_version(tmp_path, 1, "x", "", 1 << 20)


@pytest.mark.parametrize("content", [b"", b"\x01\x00", struct.pack("<Q", 1 << 40) + b"{}", struct.pack("<Q", 2) + b"[]",
                                     struct.pack("<Q", 3) + b"{x}"])
def test_bytes_that_are_no_safetensors_file_are_refused(tmp_path, content):
    version_file(tmp_path, 1).write_bytes(content)
    with pytest.raises(ValueError, match="not a safetensors file"):
        read_version(tmp_path, 1, "x", "", 1 << 20)


def test_a_tensor_unaligned_for_its_dtype_is_copied_right(tmp_path):
    odd = torch.tensor([1.5], dtype=torch.bfloat16)  # 2 bytes: the next tensor starts off its 4-byte alignment
    f = torch.tensor([0.25, -3.0], dtype=torch.float32)
    data = odd.view(torch.uint8).numpy().tobytes() + f.view(torch.uint8).numpy().tobytes()
    _raw(tmp_path, {"odd": {"dtype": "BF16", "shape": [1], "data_offsets": [0, 2]},
                    "f": {"dtype": "F32", "shape": [2], "data_offsets": [2, 10]}}, data)
    got, _ = read_version(tmp_path, 1, "x", "", 1 << 20)
    assert torch.equal(got["odd"], odd) and torch.equal(got["f"], f)


def test_the_file_written_without_a_second_copy_is_what_safetensors_reads(tmp_path):
    """policy_store.write streams each tensor's own bytes after the header (no file built in memory first): the
    result is a safetensors file that safetensors itself reads back, metadata included (what `read`, transformers
    and vLLM load), with every tensor aligned to its dtype (wider dtypes first)."""
    from safetensors import safe_open

    tensors = _tensors()
    path = policy_store.write(tmp_path, tensors, 2, "run-1", stored_id="id-2")
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"temper_id": "id-2", "temper_version": "2", "temper_lineage": "run-1"}
        assert set(f.keys()) == set(tensors)
        for name, t in tensors.items():
            assert torch.equal(f.get_tensor(name), t), name
    raw = path.read_bytes()
    head = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + head])
    assert (8 + head) % 8 == 0
    for name, t in tensors.items():
        assert header[name]["data_offsets"][0] % t.element_size() == 0, name
    assert policy_store.read(tmp_path)[1:] == (2, "run-1")


def test_the_writer_stores_each_version_into_a_file_allocated_after_the_previous_write(tmp_path):
    """policy_store.Writer: after a write, the next version's file is allocated in the background (one spare,
    sized like the last version); the next write takes it (renamed, written, cut to size: no stale bytes of a
    larger spare survive), the versions read back exactly, a reader's mapping of an earlier version keeps its
    bytes, and close removes the spare. Spares a killed writer left are removed by the next Writer."""
    (tmp_path / f"{policy_store.SPARE}.left-by-a-killed-learner.tmp").write_bytes(b"x" * 100)
    writer = policy_store.Writer(tmp_path)
    assert not list(tmp_path.glob(f"{policy_store.SPARE}.*"))
    big = {**_tensors(), "z.pad": torch.ones(1000)}
    first = writer.write(big, 1, "run-1", stored_id="id-1")
    mapped, _ = read_version(tmp_path, 1, "id-1", "run-1", 1 << 20)
    writer._allocating.join()
    spares = list(tmp_path.glob(f"{policy_store.SPARE}.*.tmp"))
    assert len(spares) == 1 and spares[0].stat().st_size == first.stat().st_size
    small = _tensors()
    second = writer.write(small, 2, "run-1", stored_id="id-2")  # smaller than the spare: cut to its own size
    assert not spares[0].exists()
    assert second.stat().st_size < first.stat().st_size
    got, size = read_version(tmp_path, 2, "id-2", "run-1", 1 << 20)
    assert size == second.stat().st_size and set(got) == set(small)
    for name, t in small.items():
        assert torch.equal(got[name], t), name
    assert torch.equal(mapped["z.pad"], big["z.pad"])  # version 1's mapping untouched by version 2's write
    writer.write(big, 3, "run-1", stored_id="id-3")
    assert torch.equal(read_version(tmp_path, 3, "id-3", "run-1", 1 << 20)[0]["z.pad"], big["z.pad"])
    assert policy_store.read(tmp_path)[1:] == (3, "run-1")
    writer.close()
    assert not list(tmp_path.glob(f"{policy_store.SPARE}.*"))
    assert sorted(p.name for p in tmp_path.glob("v*.safetensors")) == ["v00000002.safetensors", "v00000003.safetensors"]


def test_a_writer_whose_spare_vanished_writes_a_new_file(tmp_path):
    writer = policy_store.Writer(tmp_path)
    writer.write(_tensors(), 1, "run-1", stored_id="id-1")
    writer._allocating.join()
    for spare in tmp_path.glob(f"{policy_store.SPARE}.*.tmp"):
        spare.unlink()
    writer.write(_tensors(), 2, "run-1", stored_id="id-2")
    assert torch.equal(read_version(tmp_path, 2, "id-2", "run-1", 1 << 20)[0]["a.weight"], _tensors()["a.weight"])
    writer.close()
