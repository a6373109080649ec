"""Hypothesis strategies built from the protobuf descriptors: every method of every temper.v1
service gets malformed and extreme requests without a line written for it.

``methods()`` enumerates the services of the generated ``temper.v1.*_pb2`` modules, so a new
method is fuzzed as soon as it is in a .proto. ``message_strategy(descriptor)`` draws a message
field by field: per field type its extremes (0, -1, the type's min and max; NaN, +-inf, -0.0,
denormals; empty, huge, NUL, unicode and path-like strings; unknown enum numbers), repeated and
map fields with a few or thousands of entries, nested messages down to a depth limit.
``raw_request(descriptor)`` draws the bytes a broken client sends instead: garbage, a valid
message cut short or with bits flipped, unknown fields, and nesting deeper than protobuf's
recursion limit.

Domain words (``WORDS``: table, domain, language names) are mixed into strings so a draw gets
past the first check now and then and reaches the code behind it.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass

from google.protobuf.descriptor import FieldDescriptor, MethodDescriptor, ServiceDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

import temper.v1
from temper.client.transport import varint

F = FieldDescriptor
MAX_DEPTH = 4          # nesting of generated sub-messages (deeper nesting comes as raw bytes)
HUGE_STRING = 1 << 18  # characters of a huge string (bytes: a quarter): far past any sane field
MANY = 5000            # items of a "many items" repeated field
MANY_BYTES = 1 << 21   # ... as long as they stay under 2 MiB in all (huge and many multiply otherwise)
HUGE_DEPTH = 1         # huge strings and many items only this near the top (the same reason)

WORDS = ["", "default", "toy.copy", "toy.next", "math", "math.gsm8k", "code", "code.python", "python", "python3",
         "bash", "c", "cpp", "grpo", "fifo", "uniform", "prioritized", "float32", "bfloat16", "j", "g", "job-1",
         "main.py", "a", "..", "../../..", "/", "/dev/null", ".", "\x00", "a\x00b", "é", "\u202e", "🙂",
         "\U0010ffff", " ", "\n", "%s%n", "{}", '{"weights": {"toy.copy": -1}}', '{"adaptive": {"floor": 1e309}}',
         "NaN", "inf", "-1", "9" * 40]

_INT_RANGES = {
    F.TYPE_INT32: (-(2**31), 2**31 - 1), F.TYPE_SINT32: (-(2**31), 2**31 - 1), F.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    F.TYPE_INT64: (-(2**63), 2**63 - 1), F.TYPE_SINT64: (-(2**63), 2**63 - 1), F.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    F.TYPE_UINT32: (0, 2**32 - 1), F.TYPE_FIXED32: (0, 2**32 - 1),
    F.TYPE_UINT64: (0, 2**64 - 1), F.TYPE_FIXED64: (0, 2**64 - 1),
}
_FLOAT_EXTREMES = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, -1.0, 1.0, 0.5, 1e-45, -1e30, 1e30]
_DOUBLE_EXTREMES = [*_FLOAT_EXTREMES, 5e-324, 1.7976931348623157e308, -1.7976931348623157e308, 1e300]


def _ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = sorted({v for v in (0, 1, -1, 2, 7, 64, 1000, 10_001, 1_000_000, lo, lo + 1, hi, hi - 1) if lo <= v <= hi})
    return st.one_of(st.sampled_from(edges), st.integers(-1000, 1000).filter(lambda v: lo <= v <= hi),
                     st.integers(lo, hi))


def _strings(huge: bool) -> st.SearchStrategy[str]:
    return st.one_of(
        st.sampled_from(WORDS),
        st.text(max_size=24),
        st.text(alphabet=st.characters(codec="utf-8"), max_size=64),  # any code point protobuf can carry
        st.builds(lambda w, t: w + t, st.sampled_from(WORDS), st.text(max_size=8)),
        *([st.builds(lambda c, n: c * n, st.sampled_from(["x", "\x00", "é", "🙂", "/"]),
                     st.integers(1000, HUGE_STRING))] if huge else []),
    )


def _bytes(huge: bool) -> st.SearchStrategy[bytes]:
    if not huge:
        return st.binary(max_size=64)
    return st.one_of(st.binary(max_size=64), st.builds(lambda b, n: b * n, st.binary(min_size=1, max_size=4),
                                                       st.integers(1000, HUGE_STRING // 4)))


def _path_strings() -> st.SearchStrategy[str]:
    """Strings for ``path`` fields: the services write where these point, so absolute ones stay in /tmp."""
    return st.one_of(
        st.sampled_from(["", ".", "..", "../../outside", "/", "/dev/null", "/proc/self", "a\x00b", "/tmp/\x00",
                         "x" * 5000, "/tmp/" + "y" * 300, "/nonexistent-dir/\x00/z"]),
        st.text(max_size=24).filter(lambda s: not s.startswith("/")),
    )


FIELD_OVERRIDES = {"path": _path_strings}  # by field name, for every message


def scalar_strategy(field: FieldDescriptor, depth: int = 0) -> st.SearchStrategy:
    t, huge = field.type, depth <= HUGE_DEPTH
    if t in _INT_RANGES:
        return _ints(*_INT_RANGES[t])
    if t == F.TYPE_FLOAT:
        return st.one_of(st.sampled_from(_FLOAT_EXTREMES), st.floats(width=32))
    if t == F.TYPE_DOUBLE:
        return st.one_of(st.sampled_from(_DOUBLE_EXTREMES), st.floats())
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t == F.TYPE_STRING:
        return FIELD_OVERRIDES[field.name]() if field.name in FIELD_OVERRIDES else _strings(huge)
    if t == F.TYPE_BYTES:
        return _bytes(huge)
    if t == F.TYPE_ENUM:  # proto3 enums are open: any int32 may arrive
        return st.one_of(st.sampled_from([v.number for v in field.enum_type.values]), _ints(-(2**31), 2**31 - 1))
    raise TypeError(f"no strategy for field {field.full_name} of type {t}")


def _size(x) -> int:
    if isinstance(x, Message):
        return x.ByteSize() + 2
    return len(x.encode() if isinstance(x, str) else x) + 2 if isinstance(x, (str, bytes)) else 8


def _many(x, n: int) -> list:
    return [x] * max(1, min(n, MANY_BYTES // _size(x)))


def _repeated(element: st.SearchStrategy, depth: int) -> st.SearchStrategy[list]:
    if depth > HUGE_DEPTH:
        return st.lists(element, max_size=3)
    return st.one_of(st.lists(element, max_size=4), st.builds(_many, element, st.integers(100, MANY)))


def field_strategy(field: FieldDescriptor, depth: int) -> st.SearchStrategy | None:
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
        values = field_strategy(value, depth + 1)
        return None if values is None else st.dictionaries(scalar_strategy(key, depth + 1), values, max_size=6)
    if field.message_type is not None:
        if depth >= MAX_DEPTH:
            return None
        element = message_strategy(field.message_type, depth + 1)
    else:
        element = scalar_strategy(field, depth)
    return _repeated(element, depth) if field.is_repeated else element


def _assign(msg: Message, field: FieldDescriptor, value) -> None:
    """Set ``field`` of ``msg`` to ``value`` (a scalar, a message, a list or a dict of either)."""
    msg.ClearField(field.name)
    target = getattr(msg, field.name)
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        for k, v in value.items():
            if isinstance(v, Message):
                target[k].CopyFrom(v)
            else:
                target[k] = v
    elif field.is_repeated:
        if field.message_type is not None:
            for v in value:
                target.add().CopyFrom(v)
        else:
            target.extend(value)
    elif field.message_type is not None:
        target.CopyFrom(value)
    else:
        setattr(msg, field.name, value)


def _build(descriptor, values: dict) -> Message:
    msg = GetMessageClass(descriptor)()
    for name, value in values.items():
        _assign(msg, descriptor.fields_by_name[name], value)
    return msg


def message_strategy(descriptor, depth: int = 0) -> st.SearchStrategy[Message]:
    """Messages of type ``descriptor``: any subset of its fields set, each to an extreme or random value."""
    optional = {f.name: s for f in descriptor.fields if (s := field_strategy(f, depth)) is not None}
    return st.builds(lambda values: _build(descriptor, values), st.fixed_dictionaries({}, optional=optional))


def _deep(depth: int) -> bytes:
    """Field 1 (length-delimited) nested ``depth`` times: past protobuf's recursion limit when it is a message."""
    out = b""
    for _ in range(depth):
        out = b"\x0a" + varint(len(out)) + out
    return out


def _cut(data: bytes, at: int) -> bytes:
    return data[: at % max(len(data), 1)]


def _flip(data: bytes, at: int, bit: int) -> bytes:
    if not data:
        return b"\xff"
    i = at % len(data)
    return data[:i] + bytes([data[i] ^ (1 << bit)]) + data[i + 1:]


def raw_request(descriptor) -> st.SearchStrategy[bytes]:
    """Wire bytes a broken or hostile client sends for ``descriptor``'s type."""
    valid = message_strategy(descriptor, depth=MAX_DEPTH - 1).map(lambda m: m.SerializeToString())
    return st.one_of(
        st.binary(max_size=256),
        st.builds(_cut, valid, st.integers(0, 1 << 20)),              # truncated
        st.builds(_flip, valid, st.integers(0, 1 << 20), st.integers(0, 7)),  # a bit flipped
        st.builds(lambda v, tail: v + tail, valid,                     # unknown fields, a bad length, a bad wire type
                  st.sampled_from([b"\xf8\x3e\x01", b"\x0a\xff\xff\xff\xff\x0f", b"\x0f", b"\x80", b"\x0a\x05ab"])),
        st.builds(_deep, st.sampled_from([50, 101, 200, 5000])),       # deep nesting
    )


def _mild(field: FieldDescriptor) -> st.SearchStrategy | None:
    """Ordinary values of a scalar field (a mutation that often stays valid reaches the code behind the checks)."""
    if field.message_type is not None:
        return None
    t = field.type
    if t in _INT_RANGES:
        element = st.integers(max(-1, _INT_RANGES[t][0]), 8)
    elif t in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        element = st.one_of(st.sampled_from([0.0, 0.5, 1.0]), st.floats(0, 2, width=32 if t == F.TYPE_FLOAT else 64))
    elif t == F.TYPE_BOOL:
        element = st.booleans()
    elif t == F.TYPE_STRING:
        element = st.one_of(st.sampled_from(WORDS), st.text(max_size=8))
    elif t == F.TYPE_BYTES:
        element = st.binary(max_size=16)
    else:
        element = st.sampled_from([v.number for v in field.enum_type.values])
    return st.lists(element, max_size=3) if field.is_repeated else element


@st.composite
def mutated(draw, seed: Message, max_changes: int = 3) -> Message:
    """A copy of the valid ``seed`` with one to ``max_changes`` fields, at any depth (into set sub-messages
    and items of repeated ones), replaced by an extreme value or (half the time) an ordinary one: it gets
    past the checks that came before, and now and then past every check."""
    msg = type(seed)()
    msg.CopyFrom(seed)
    for _ in range(draw(st.integers(1, max_changes))):
        target, depth = msg, 0
        while target.DESCRIPTOR.fields:  # (a message with no fields stays as it is: raw_request fuzzes it)
            field = draw(st.sampled_from(list(target.DESCRIPTOR.fields)))
            is_map = field.message_type is not None and field.message_type.GetOptions().map_entry
            if field.message_type is not None and not is_map and draw(st.booleans()):
                if not field.is_repeated and target.HasField(field.name):
                    target, depth = getattr(target, field.name), depth + 1
                    continue
                items = getattr(target, field.name)
                if field.is_repeated and len(items):
                    target, depth = items[draw(st.integers(0, len(items) - 1))], depth + 1
                    continue
            mild = _mild(field) if field.name not in FIELD_OVERRIDES else None
            strategy = mild if mild is not None and draw(st.booleans()) else field_strategy(field, min(depth, HUGE_DEPTH))
            if strategy is not None:
                _assign(target, field, draw(strategy))
            break
    return msg


@dataclass(frozen=True)
class Method:
    service: ServiceDescriptor
    method: MethodDescriptor

    @property
    def path(self) -> str:
        """The gRPC method path, ``/temper.v1.ReplayService/Sample``."""
        return f"/{self.service.full_name}/{self.method.name}"

    @property
    def id(self) -> str:
        return f"{self.service.name}.{self.method.name}"

    @property
    def streaming_request(self) -> bool:
        return self.method.client_streaming


def methods() -> list[Method]:
    """Every method of every service in the generated temper.v1 modules."""
    out = []
    for info in pkgutil.iter_modules(temper.v1.__path__):
        if not info.name.endswith("_pb2"):
            continue
        module = importlib.import_module(f"temper.v1.{info.name}")
        for service in module.DESCRIPTOR.services_by_name.values():
            out.extend(Method(service, m) for m in service.methods)
    return sorted(out, key=lambda m: m.id)


def _serialized(m: Message) -> bytes:
    return m.SerializeToString()


@st.composite
def _mutated_stream(draw, seed: list[Message], one: st.SearchStrategy[bytes]) -> list[bytes]:
    """The valid stream ``seed`` with one or two of its requests mutated, replaced by ``one``, dropped or repeated."""
    out = [m.SerializeToString() for m in seed]
    for _ in range(draw(st.integers(1, 2))):
        if not out:
            break
        i = draw(st.integers(0, len(out) - 1))
        action = draw(st.sampled_from(["mutate", "replace", "drop", "repeat"]))
        if action == "mutate":
            out[i] = draw(mutated(seed[min(i, len(seed) - 1)]).map(_serialized))
        elif action == "replace":
            out[i] = draw(one)
        elif action == "drop":
            del out[i]
        else:
            out.insert(i, out[i])
    return out


def request_strategy(method: Method, seeds: list = ()) -> st.SearchStrategy:
    """What a fuzz case sends to ``method``: one request (bytes) or, for a client stream, a list of them.

    ``seeds``: valid requests of the method (of a client stream: valid streams, lists of requests). A
    third of the cases are a seed with a few fields made extreme, a third messages of the input type
    drawn field by field, a third raw garbage (for a stream: per request)."""
    d = method.method.input_type
    one = st.one_of(message_strategy(d).map(_serialized), raw_request(d))
    if method.streaming_request:
        kinds = [st.lists(one, max_size=4)]
        if seeds:
            kinds.append(st.sampled_from(list(seeds)).flatmap(lambda seq: _mutated_stream(seq, one)))
        return st.one_of(kinds)
    kinds = [message_strategy(d).map(_serialized), raw_request(d)]
    if seeds:
        kinds.append(st.sampled_from(list(seeds)).flatmap(mutated).map(_serialized))
    return st.one_of(kinds)
