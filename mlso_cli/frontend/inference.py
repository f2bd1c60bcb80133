"""onnx shape inference run on a weight-less view of the model, the weights never copied.

Why: `onnx.shape_inference.infer_shapes` serialises the whole model for its C++ pass and parses
the answer back; for a model with inline weights that is every weight byte copied four times per
call (about 4 s for a 478 MB Phi-3 export), and a load runs it after reading and after each
folding round. The C++ pass here sees a view whose weights carry their name, type and dims but no
bytes, and what it inferred is copied back onto the model; its initializers are never touched.

Why the answer is the same as on the full model: inference uses an initializer's type and dims
for every input, and reads its bytes only where an op takes a value as shape data (Reshape's
shape, Slice's starts, Resize's scales, Range's bounds, OneHot's depth; data propagation reads
int32/int64 tensors of rank 0 or 1). Every such input is a scalar or a vector. A tensor left
without bytes in the view has rank 2 or more and more than STRIP_MIN_ELEMENTS elements, so no
inference function reads it; `tests/test_cached_rerun.py` compares both answers.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

STRIP_MIN_ELEMENTS = 4096
"""Initializers with more elements than this (and rank 2 or more) lose their bytes in the view.
Why a floor at all: a small tensor costs nothing to copy. (Folding reads the model's own
initializers, never this view, so the tables it may read above the floor keep their bytes.)"""


def large_weight(t: onnx.TensorProto) -> bool:
    """A weight whose bytes no inference function reads (module docstring), held in raw_data."""
    if len(t.dims) < 2 or not t.HasField("raw_data"):
        return False
    n = 1
    for d in t.dims:
        n *= int(d)
    return n > STRIP_MIN_ELEMENTS


def _repeated(fd: FieldDescriptor) -> bool:
    """Whether a field is repeated (`is_repeated` where protobuf has it; `label` was removed)."""
    rep = getattr(fd, "is_repeated", None)
    return bool(rep) if rep is not None else fd.label == FieldDescriptor.LABEL_REPEATED


def _copy_field(dst: Message, fd: FieldDescriptor, value) -> None:
    if fd.type == FieldDescriptor.TYPE_MESSAGE:
        getattr(dst, fd.name).CopyFrom(value)
    else:
        setattr(dst, fd.name, value)


def copy_except(src: Message, dst: Message, skip: str) -> None:
    """Every field of `src` but `skip` into `dst` (which has none of them)."""
    copy_fields(src, dst, lambda fd: fd.name != skip)


def copy_fields(src: Message, dst: Message, keep: Callable[[FieldDescriptor], bool]) -> None:
    """The fields of `src` that `keep` accepts into `dst` (which has none of them). Why not
    ListFields: it returns a bytes field's value, a copy of a weight's bytes even for a field
    not kept."""
    for fd in src.DESCRIPTOR.fields:
        if not keep(fd):
            continue
        if _repeated(fd):
            if len(getattr(src, fd.name)):
                getattr(dst, fd.name).extend(getattr(src, fd.name))
        elif src.HasField(fd.name):
            _copy_field(dst, fd, getattr(src, fd.name))


def weightless_view(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """A copy of `model` whose large initializers have no bytes, or None when none is large
    (then the model itself is as cheap to infer)."""
    inits = model.graph.initializer
    if not any(large_weight(t) for t in inits):
        return None
    view = onnx.ModelProto()
    copy_except(model, view, "graph")
    copy_except(model.graph, view.graph, "initializer")
    for t in inits:
        if large_weight(t):
            copy_except(t, view.graph.initializer.add(), "raw_data")
        else:
            view.graph.initializer.append(t)
    return view


def _take_inferred(model: onnx.ModelProto, inferred: onnx.ModelProto) -> None:
    """Make `model` what inference returned for it: every field but the graph's initializers
    is replaced by the inferred one (the initializers are the ones inference was given)."""
    graph = model.graph
    for fd in model.DESCRIPTOR.fields:
        if fd.name != "graph":
            model.ClearField(fd.name)
    for fd in graph.DESCRIPTOR.fields:
        if fd.name != "initializer":
            graph.ClearField(fd.name)
    copy_except(inferred, model, "graph")
    copy_except(inferred.graph, graph, "initializer")


def infer_in_place(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with onnx's shape inference (data propagation on, strict mode off) applied in
    place, as `onnx.shape_inference.infer_shapes` would return it; returns `model`. Raises what
    onnx raises. For callers that own the model (a load, a folding round)."""
    view = weightless_view(model)
    if view is None:
        inferred = infer(model)
    else:
        inferred = infer(view)
        del view
    _take_inferred(model, inferred)
    return model


def infer(model: onnx.ModelProto) -> onnx.ModelProto:
    """onnx's shape inference as the loader runs it (data propagation on, strict mode off), as a
    new model."""
    return onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
