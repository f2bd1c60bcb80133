"""A model's serialisation in pieces, each large weight's bytes a piece of its own.

Why: `SerializeToString` on a model with 478 MB of inline weights costs one to two seconds
(upb grows its buffer by copying it, then copies it into a bytes object, all in fresh pages),
and optimize needs the bytes twice: the verdict cache's digest of the model to write
(pipeline/verdicts.py) and the file written (package/write.py). Here protobuf serialises only
the small messages around the weights; the headers that join them (field tag and length) are
written here, and each weight's bytes are taken as they are.

Why the pieces joined are byte for byte what SerializeToString returns: protobuf writes a
message's known fields in field-number order, each length-delimited field as its tag, its length
as a varint and its bytes, and unknown fields after the known ones. A message split here (the
model, its graph, a large weight) is serialised as its fields before the split field, the split
field, then its fields after it; one with unknown fields is serialised whole instead.
`tests/test_cached_rerun.py` compares both on every model it builds and on the zoo.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import onnx
from google.protobuf.message import Message

from mlso_cli.frontend.inference import copy_fields, large_weight

_LEN = 2
"""Wire type of a length-delimited field."""


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low = n & 0x7F
        n >>= 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _header(number: int, length: int) -> bytes:
    """Tag and length of a length-delimited field."""
    return _varint(number << 3 | _LEN) + _varint(length)


def _has_unknown(msg: Message) -> bool:
    """Whether `msg` holds unknown fields. A protobuf without either API answers True: the
    message is then serialised whole, which is always right, only slower."""
    try:
        from google.protobuf import unknown_fields
    except ImportError:  # protobuf < 4.24
        try:
            return len(msg.UnknownFields()) > 0
        except (AttributeError, NotImplementedError):
            return True
    return len(unknown_fields.UnknownFieldSet(msg)) > 0


def _fields_between(msg: Message, lo: int, hi: int) -> bytes:
    """The serialisation of `msg`'s known fields numbered above `lo` and below `hi`."""
    part = type(msg)()
    copy_fields(msg, part, lambda fd: lo < fd.number < hi)
    return part.SerializeToString()


def _around(msg: Message, name: str, middle: Sequence[bytes]) -> list[bytes]:
    """`msg` serialised with the field `name` written as `middle` (its header included)."""
    number = msg.DESCRIPTOR.fields_by_name[name].number
    pieces = [_fields_between(msg, 0, number), *middle, _fields_between(msg, number, 1 << 29)]
    return [p for p in pieces if p]


def _tensor(t: onnx.TensorProto) -> list[bytes]:
    if not large_weight(t) or _has_unknown(t):
        return [t.SerializeToString()]
    raw = t.raw_data
    return _around(
        t, "raw_data", [_header(t.DESCRIPTOR.fields_by_name["raw_data"].number, len(raw)), raw]
    )


def serialized_chunks(model: onnx.ModelProto) -> list[bytes]:
    """Pieces whose concatenation is `model.SerializeToString()` (module docstring)."""
    graph = model.graph
    if not any(large_weight(t) for t in graph.initializer) or any(
        _has_unknown(m) for m in (model, graph)
    ):
        return [model.SerializeToString()]
    number = graph.DESCRIPTOR.fields_by_name["initializer"].number
    inits: list[bytes] = []
    for t in graph.initializer:
        body = _tensor(t)
        inits.append(_header(number, sum(map(len, body))))
        inits.extend(body)
    pieces = _around(graph, "initializer", inits)
    number = model.DESCRIPTOR.fields_by_name["graph"].number
    return _around(model, "graph", [_header(number, sum(map(len, pieces))), *pieces])


def serialized_sha256(model: onnx.ModelProto) -> str:
    """sha256 of `model.SerializeToString()`, without the one large bytes object."""
    h = hashlib.sha256()
    for piece in serialized_chunks(model):
        h.update(piece)
    return h.hexdigest()
