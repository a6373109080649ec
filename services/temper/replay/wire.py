"""Wire-level views of replay's messages, so a group's big arrays are never decoded by the server.

Replay stores a group's bytes as received and needs from it only ids, versions, reward status
and the *lengths* of its token and logprob arrays. Decoding ``repeated int32`` token ids is most
of the cost of parsing a group (2,048 packed varints: ~50 µs in upb; the floats are ~1 µs), so
the server parses requests with *view* types: copies of the real descriptors (built here from
``temper.v1``'s own, so they cannot drift) in which ``Trajectory``'s three packed arrays are
``repeated bytes``. A packed array is one length-delimited record on the wire, exactly what a
bytes field reads; its element count is then the number of varint-final bytes (ids) or
``len / 4`` (floats), and its well-formedness is checked as the real parser would.

A sender may legally encode repeated scalars unpacked (one tagged value each); the view then
sees no bytes for that array, so a trajectory whose view shows an empty completion array is
parsed again with the real type (``needs_full_parse``): slow, but right.
"""

from __future__ import annotations

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.message_factory import GetMessageClass

from temper.client.transport import varint  # noqa: F401 - framing of replay payloads (servicer, tests)
from temper.v1 import common_pb2, replay_pb2

VIEW_PACKAGE = "temper.v1view"
PACKED_AS_BYTES = {"prompt_token_ids", "completion_token_ids", "completion_logprobs"}


def _build_views():
    common = descriptor_pb2.FileDescriptorProto.FromString(common_pb2.DESCRIPTOR.serialized_pb)
    replay = descriptor_pb2.FileDescriptorProto.FromString(replay_pb2.DESCRIPTOR.serialized_pb)
    view = descriptor_pb2.FileDescriptorProto(name="temper/v1view/view.proto", package=VIEW_PACKAGE, syntax="proto3")
    view.enum_type.extend(common.enum_type)
    view.message_type.extend(common.message_type)
    view.message_type.extend(m for m in replay.message_type if m.name == "InsertRequest")

    def rename(message: descriptor_pb2.DescriptorProto) -> None:
        for f in message.field:
            if f.type_name.startswith(".temper.v1."):
                f.type_name = f".{VIEW_PACKAGE}." + f.type_name.removeprefix(".temper.v1.")
            if message.name == "Trajectory" and f.name in PACKED_AS_BYTES:
                f.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
                f.ClearField("options")
        for nested in message.nested_type:
            rename(nested)

    for m in view.message_type:
        rename(m)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(view)
    get = lambda name: GetMessageClass(pool.FindMessageTypeByName(f"{VIEW_PACKAGE}.{name}"))  # noqa: E731
    return get("InsertRequest"), get("RolloutGroup"), get("Trajectory")


InsertRequestView, RolloutGroupView, TrajectoryView = _build_views()
TRAJECTORY_VIEW = TrajectoryView.DESCRIPTOR


def _varint_count(records) -> int:
    """Elements in packed varint ``records``, or -1 if malformed: the last varint unterminated,
    or one longer than 10 bytes (upb refuses both)."""
    n = 0
    for r in records:
        if not r:
            continue
        high = np.frombuffer(r, np.uint8) >= 0x80
        run = high[:-1] & high[1:]  # runs of continuation bytes, by doubling: 2, 4, 8, then 8 + 2 = 10
        run4 = run[:-2] & run[2:]
        run8 = run4[:-4] & run4[4:]
        if high[-1] or (run8[:-2] & run[8:len(run8) - 2 + 8]).any():
            return -1
        n += high.size - int(np.count_nonzero(high))
    return n


def _float_count(records) -> int:
    n = 0
    for r in records:
        if len(r) % 4:
            return -1
        n += len(r) // 4
    return n


def array_lengths(t) -> tuple[int, int, str | None]:
    """(completion tokens, completion logprobs, the name of a malformed packed array or None) of
    a Trajectory or a TrajectoryView; a view's packed bytes are checked as parsing would."""
    if t.DESCRIPTOR is not TRAJECTORY_VIEW:
        return len(t.completion_token_ids), len(t.completion_logprobs), None
    tokens, logprobs = _varint_count(t.completion_token_ids), _float_count(t.completion_logprobs)
    bad = ("prompt_token_ids" if _varint_count(t.prompt_token_ids) < 0 else
           "completion_token_ids" if tokens < 0 else "completion_logprobs" if logprobs < 0 else None)
    return tokens, logprobs, bad


def needs_full_parse(group) -> bool:
    """True if a view may have missed unpacked-encoded arrays (see the module docstring)."""
    return any(not t.completion_token_ids or not t.completion_logprobs for t in group.trajectories)


def _read_varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7


def decode_insert_request(data: bytes):
    """(request view, the ``group`` field's bytes as sent, each ``groups`` entry's bytes as sent).

    Bytes are None where protobuf would merge repeated occurrences of ``group`` or the wire has
    deprecated groups (then the parsed messages are serialized again). A group needing a full
    parse (``needs_full_parse``) is replaced by the real ``RolloutGroup`` in the returned view's
    place: the caller gets ``(request, group, groups, raw, raws)`` with real or view messages.
    ``groups`` entries are copied out (one memcpy each) so a stored group does not keep its whole
    batch message alive; a single ``group`` is its request's bytes, kept without a copy.
    """
    request = InsertRequestView.FromString(data)  # validates the wire format (packed arrays: array_lengths)
    view = memoryview(data)
    raw, seen, batch, i = None, 0, [], 0
    while i < len(data):
        key, i = _read_varint(data, i)
        wire = key & 7
        if wire == 2:
            length, i = _read_varint(data, i)
            field = key >> 3
            if field == 2:
                raw, seen = view[i:i + length], seen + 1  # no copy: the request's bytes
            elif field == 4:
                batch.append(bytes(view[i:i + length]))
            i += length
        elif wire == 0:
            _, i = _read_varint(data, i)
        elif wire in (1, 5):
            i += 8 if wire == 1 else 4
        else:  # groups (deprecated wire types): leave it to the parsed message
            raw, seen, batch = None, 0, None
            break
    group = request.group if request.HasField("group") else None
    if group is not None and needs_full_parse(group):
        group = common_pb2.RolloutGroup.FromString(group.SerializeToString())
    groups = [common_pb2.RolloutGroup.FromString(g.SerializeToString()) if needs_full_parse(g) else g
              for g in request.groups]
    return (request, group, groups, raw if seen == 1 else None,
            batch if batch is not None and len(batch) == len(groups) else None)


__all__ = ["varint", "InsertRequestView", "RolloutGroupView", "TrajectoryView", "array_lengths", "decode_insert_request",
           "needs_full_parse"]
