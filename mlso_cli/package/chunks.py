"""A model's serialisation in pieces, each large weight's bytes a piece of its own.

Why: `SerializeToString` on a model with 478 MB of inline weights costs one to two seconds
(upb grows its buffer by copying it, then copies it into a bytes object, all in fresh pages),
and optimize needs the bytes twice: the verdict cache's digest of the model to write
(pipeline/verdicts.py) and the file written (package/write.py). Here protobuf serialises only
the small messages around the weights; the headers that join them (field tag and length) are
written here, and each weight's bytes are taken as they are. A weight's header is written with
the size its dims and type give its raw_data before the bytes are copied out (so the pieces can
be hashed and written as they come, `serialize`); a weight whose raw_data has another size
makes the model serialised whole. `serialize` keeps the weights' bytes (`Serialized`) so that
the write after the hash does not copy them out again.

Why the pieces joined are byte for byte what SerializeToString returns: protobuf writes a
message's known fields in field-number order, each length-delimited field as its tag, its length
as a varint and its bytes, and unknown fields after the known ones. A message split here (the
model, its graph, a large weight) is serialised as its fields before the split field, the split
field, then its fields after it; one with unknown fields is serialised whole instead.
`tests/test_cached_rerun.py` and `tests/test_rerun_time.py` compare both on every model they
build and on the zoo.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

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


_ITEMSIZE = {
    onnx.TensorProto.FLOAT: 4,
    onnx.TensorProto.FLOAT16: 2,
    onnx.TensorProto.BFLOAT16: 2,
    onnx.TensorProto.DOUBLE: 8,
    onnx.TensorProto.INT8: 1,
    onnx.TensorProto.UINT8: 1,
    onnx.TensorProto.INT16: 2,
    onnx.TensorProto.UINT16: 2,
    onnx.TensorProto.INT32: 4,
    onnx.TensorProto.UINT32: 4,
    onnx.TensorProto.INT64: 8,
    onnx.TensorProto.UINT64: 8,
    onnx.TensorProto.BOOL: 1,
}


@dataclass(frozen=True)
class _Raw:
    """A large weight's raw_data, still in its tensor: its bytes are taken (a copy) only when
    the pieces are joined, hashed or written; `size` is what its dims and type make it, which
    the header before it was written with (`_fetch` compares)."""

    tensor: onnx.TensorProto
    key: tuple[bytes, bytes]
    size: int


Layout = list["bytes | _Raw"]


def _guess(t: onnx.TensorProto) -> int | None:
    """The size raw_data has in a valid tensor of `t`'s dims and type (None: not a byte-sized
    type, or a dim that is not positive)."""
    size = _ITEMSIZE.get(t.data_type)
    if size is None or any(d <= 0 for d in t.dims):
        return None
    for d in t.dims:
        size *= int(d)
    return size


def _tensor(t: onnx.TensorProto, reuse: Mapping[tuple[bytes, bytes], bytes | None]) -> Layout:
    if not large_weight(t) or _has_unknown(t):
        return [t.SerializeToString()]
    number = t.DESCRIPTOR.fields_by_name["raw_data"].number
    key = (_fields_between(t, 0, number), _fields_between(t, number, 1 << 29))
    raw: bytes | _Raw | None = reuse.get(key)
    if raw is None:
        size = _guess(t)
        raw = t.raw_data if size is None else _Raw(t, key, size)
    pieces = [key[0], _header(number, len(raw) if isinstance(raw, bytes) else raw.size), raw]
    return [p for p in [*pieces, key[1]] if not isinstance(p, bytes) or p]


def _size(piece: bytes | _Raw) -> int:
    return len(piece) if isinstance(piece, bytes) else piece.size


def _layout(model: onnx.ModelProto, reuse: Mapping[tuple[bytes, bytes], bytes | None]) -> Layout:
    """The model's serialisation in pieces (module docstring), each large weight's bytes a
    `_Raw` (or its bytes from `reuse`, by the tensor's other fields)."""
    graph = model.graph
    if not any(large_weight(t) for t in graph.initializer) or any(
        _has_unknown(m) for m in (model, graph)
    ):
        return [model.SerializeToString()]
    number = graph.DESCRIPTOR.fields_by_name["initializer"].number
    inits: Layout = []
    for t in graph.initializer:
        body = _tensor(t, reuse)
        inits.append(_header(number, sum(map(_size, body))))
        inits.extend(body)
    pieces = _around(graph, "initializer", inits)
    number = model.DESCRIPTOR.fields_by_name["graph"].number
    return _around(model, "graph", [_header(number, sum(map(_size, pieces))), *pieces])


def _fetch(layout: Layout, kept: dict[tuple[bytes, bytes], bytes | None] | None = None):
    """Each piece of `layout` as bytes, in order; a `_Raw`'s bytes are copied out of its tensor
    here (into `kept` too, by its key; None there for a key two weights share). Raises
    _SizeMismatch where raw_data is not the size its header was written with (an invalid
    tensor: the model is then serialised whole)."""
    for piece in layout:
        if isinstance(piece, bytes):
            yield piece
            continue
        raw = piece.tensor.raw_data
        if len(raw) != piece.size:
            raise _SizeMismatch
        if kept is not None:
            kept[piece.key] = None if piece.key in kept else raw
        yield raw


class _SizeMismatch(Exception):
    pass


def _joinable(
    model: onnx.ModelProto, reuse: Mapping[tuple[bytes, bytes], bytes | None]
) -> list[bytes]:
    try:
        return list(_fetch(_layout(model, reuse)))
    except _SizeMismatch:
        return [model.SerializeToString()]


def serialized_chunks(model: onnx.ModelProto) -> list[bytes]:
    """Pieces whose concatenation is `model.SerializeToString()` (module docstring)."""
    return _joinable(model, {})


def serialized_sha256(model: onnx.ModelProto) -> str:
    """sha256 of `model.SerializeToString()`, without the one large bytes object."""
    return serialize(model, keep=False).sha256


@dataclass(frozen=True)
class Serialized:
    """A model's serialisation (in pieces, package/chunks.py) and its sha256, kept so that a
    model hashed can be written without copying its weights out again (`pieces_for`)."""

    model: onnx.ModelProto
    sha256: str
    raw: Mapping[tuple[bytes, bytes], bytes | None] = field(repr=False)
    """Each large weight's bytes, by the serialisation of its other fields (name, dims, type);
    None for fields two weights share (each is copied out again)."""

    def pieces_for(self, model: onnx.ModelProto) -> list[bytes] | None:
        """The serialisation of `model`, when it is the model this was made from: its fields
        other than the large weights' bytes are serialised again (a field changed since, such
        as the metadata set after the check before writing, is written as it is now), and each
        large weight whose other fields are as they were gets the bytes taken then. Why a
        weight's bytes are not compared: a copy of every byte is what this saves; nothing
        between the hash and the write edits a weight in place. None for another model."""
        if model is not self.model:
            return None
        return _joinable(model, self.raw)


class Tee(Protocol):
    """What else `serialize` gives each piece to, in order (package/prefile.py writes them to
    the output's temp file); `discard` when the pieces given are not the model's after all."""

    def __call__(self, piece: bytes) -> None: ...

    def discard(self) -> None: ...


def serialize(model: onnx.ModelProto, keep: bool = True, tee: Tee | None = None) -> Serialized:
    """`model`'s sha256, each piece hashed in a second thread while the next weight's bytes are
    copied out of the model (hashlib lets go of the GIL), and with `keep` the weights' bytes for
    `Serialized.pieces_for`; `tee` gets each piece too. Why the two at once: on a 478 MB model
    the copy and the hash each take about 0.4 s, and a cached rerun of optimize needs both
    before it writes."""
    from concurrent.futures import ThreadPoolExecutor

    kept: dict[tuple[bytes, bytes], bytes | None] = {}
    h = hashlib.sha256()
    pool = ThreadPoolExecutor(1, thread_name_prefix="mlso-sha256")
    try:
        updates = []
        for piece in _fetch(_layout(model, {}), kept if keep else None):
            if tee is not None:
                tee(piece)
            updates.append(pool.submit(h.update, piece))
        for update in updates:
            update.result()
    except _SizeMismatch:  # an invalid tensor: the model serialised whole, nothing kept
        pool.shutdown(wait=True, cancel_futures=True)
        if tee is not None:
            tee.discard()
        h = hashlib.sha256(model.SerializeToString())
        kept.clear()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return Serialized(model, h.hexdigest(), kept)
