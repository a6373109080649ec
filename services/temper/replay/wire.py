"""Wire-level views of replay's messages, so a group's big arrays are never decoded by the server.

Replay stores a group's bytes as received and needs from it only ids, versions, reward status
and the *lengths* of its token and logprob arrays. So the server parses requests with *view*
types: copies of the real descriptors (built here from ``temper.v1``'s own, so they cannot
drift) in which ``Trajectory``'s three packed arrays are ``repeated bytes``. A packed array is
one length-delimited record on the wire, exactly what a bytes field reads; every one of the
three is fixed-width (``sfixed32`` ids, ``float`` logprobs), so its element count is
``len / 4`` and it is well-formed exactly when that divides.

A sender may legally encode repeated scalars unpacked (one tagged value each); the view then
sees no bytes for that array, so a trajectory whose view shows an empty completion array is
parsed again with the real type (``needs_full_parse``): slow, but right.
"""

from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.message_factory import GetMessageClass

from temper.client.transport import varint  # noqa: F401 - framing of replay payloads (servicer, tests)
from temper.v1 import common_pb2, replay_pb2

VIEW_PACKAGE = "temper.v1view"
LEGACY_PACKAGE = "temper.v1schema1"
PACKED_AS_BYTES = {"prompt_token_ids", "completion_token_ids", "completion_logprobs"}
TOKEN_IDS = ("prompt_token_ids", "completion_token_ids")
_TYPE = descriptor_pb2.FieldDescriptorProto


def _copy(package: str, retype: dict[str, int], with_insert: bool) -> descriptor_pool.DescriptorPool:
    """A pool holding ``temper.v1``'s messages (and replay's InsertRequest) under ``package``,
    with ``Trajectory``'s fields named in ``retype`` given another type."""
    common = descriptor_pb2.FileDescriptorProto.FromString(common_pb2.DESCRIPTOR.serialized_pb)
    replay = descriptor_pb2.FileDescriptorProto.FromString(replay_pb2.DESCRIPTOR.serialized_pb)
    copy = descriptor_pb2.FileDescriptorProto(name=f"{package.replace('.', '/')}/copy.proto", package=package,
                                              syntax="proto3")
    copy.enum_type.extend(common.enum_type)
    copy.message_type.extend(common.message_type)
    if with_insert:
        copy.message_type.extend(m for m in replay.message_type if m.name == "InsertRequest")

    def rename(message: descriptor_pb2.DescriptorProto) -> None:
        for f in message.field:
            if f.type_name.startswith(".temper.v1."):
                f.type_name = f".{package}." + f.type_name.removeprefix(".temper.v1.")
            if message.name == "Trajectory" and f.name in retype:
                f.type = retype[f.name]
                f.ClearField("options")
        for nested in message.nested_type:
            rename(nested)

    for m in copy.message_type:
        rename(m)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(copy)
    return pool


def _message(pool: descriptor_pool.DescriptorPool, package: str, name: str):
    return GetMessageClass(pool.FindMessageTypeByName(f"{package}.{name}"))


_views = _copy(VIEW_PACKAGE, dict.fromkeys(PACKED_AS_BYTES, _TYPE.TYPE_BYTES), with_insert=True)
InsertRequestView, RolloutGroupView, TrajectoryView = (
    _message(_views, VIEW_PACKAGE, name) for name in ("InsertRequest", "RolloutGroup", "Trajectory"))
TRAJECTORY_VIEW = TrajectoryView.DESCRIPTOR
# replay schema 1 stored groups whose token ids were varints (``int32``): read to migrate them
LegacyRolloutGroup = _message(_copy(LEGACY_PACKAGE, dict.fromkeys(TOKEN_IDS, _TYPE.TYPE_INT32), with_insert=False),
                              LEGACY_PACKAGE, "RolloutGroup")


def recode_token_ids(group, to: type):
    """``group`` (a RolloutGroup of either schema: ``common_pb2.RolloutGroup`` or ``LegacyRolloutGroup``) as a
    ``to`` message: every other field through the wire, unchanged; the token ids, whose wire types differ,
    carried over by value."""
    stripped = type(group)()
    stripped.CopyFrom(group)
    for t in stripped.trajectories:
        for f in TOKEN_IDS:
            t.ClearField(f)
    out = to.FromString(stripped.SerializeToString())
    for t, source in zip(out.trajectories, group.trajectories):
        for f in TOKEN_IDS:
            getattr(t, f).extend(getattr(source, f))
    return out


def upgrade_token_ids(data: bytes) -> bytes:
    """A RolloutGroup's bytes written with varint (``int32``) token ids, as the current wire
    (``sfixed32``): every other field exactly as it was."""
    return recode_token_ids(LegacyRolloutGroup.FromString(data), common_pb2.RolloutGroup).SerializeToString()


def _fixed_count(records) -> int:
    """Elements in packed 4-byte ``records``, or -1 if one is not a whole number of them."""
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
    tokens, logprobs = _fixed_count(t.completion_token_ids), _fixed_count(t.completion_logprobs)
    bad = ("prompt_token_ids" if _fixed_count(t.prompt_token_ids) < 0 else
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
           "needs_full_parse", "upgrade_token_ids", "recode_token_ids", "LegacyRolloutGroup", "TOKEN_IDS"]
