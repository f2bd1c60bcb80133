"""Open models for `mlso bench`: read, fix input shapes, and nothing ONNX Runtime would not ask.

Why not `frontend.load.load_model`: it runs onnx's checker and shape inference, which know only
the ops onnx defines. ONNX Runtime's transformer optimizer writes ops only ONNX Runtime knows
(SimplifiedLayerNormalization in the default domain, SkipSimplifiedLayerNormalization,
FusedMatMul, ... in `com.microsoft`), and the checker rejected them ("No Op registered for
SimplifiedLayerNormalization"), so a user could not compare mlso with what they run today. bench
needs only the graph inputs (their names, static shapes and types, for one set of feeds shared by
every model); whether the rest of the model is valid is for ONNX Runtime to say, when it opens it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from mlso_cli.errors import UsageError
from mlso_cli.frontend.load import (
    LoadedModel,
    _apply_input_shapes,
    _check_external_files,
    _static_input_shapes,
    is_stream,
    read_proto,
    uses_external_data,
    with_weights,
)
from mlso_cli.package.shapes import check_input_shapes
from mlso_cli.runtime.check import is_mlso_node
from mlso_cli.verify.reference64 import input_specs


@dataclass
class BenchModel:
    """One model as bench runs it."""

    source: str
    """The model as the user named it ("stdin" for -)."""
    path: str | None
    """Its file, None for stdin."""
    model: onnx.ModelProto
    """The graph with the --input-shape fixes applied; external weights not read."""
    base_dir: Path | None
    reshaped: bool
    """Whether --input-shape changed the graph (then ONNX Runtime gets these bytes, not the file)."""
    inputs: list[tuple[str, tuple[int, ...], np.dtype]]

    @property
    def mlso_nodes(self) -> int:
        """MlsoKernel nodes of the main graph."""
        return sum(1 for n in self.model.graph.node if is_mlso_node(n))

    def for_session(self) -> str | bytes:
        """What to open in ONNX Runtime: the file itself when bench changed nothing (ONNX Runtime
        then reads external weights itself, and models over 2 GB work), else the fixed graph
        with its weights, serialised."""
        if not self.reshaped and self.path is not None:
            return self.path
        return self.with_weights().SerializeToString()

    def with_weights(self) -> onnx.ModelProto:
        return with_weights(LoadedModel(self.model, self.source, self.base_dir))


def open_model(source: str, shapes: dict[str, tuple[int, ...]]) -> BenchModel:
    """Read `source` (a path, or - for stdin), apply `shapes` and require static inputs.

    Raises InputError (exit 1) for a missing or unreadable file or missing external data, and
    UsageError (exit 2) for an open input dimension, a --input-shape naming no input, or one an
    mlso-optimized model was not made for (its kernels are specialised to its recorded shapes:
    said here in mlso's words rather than by the MlsoKernel plan check, which would call the
    model tampered)."""
    model, base = read_proto(source)
    where = "stdin" if source == "-" else source
    if uses_external_data(model):
        _check_external_files(model, base, where)
    check_input_shapes(model, shapes, where)
    applicable = _applicable(model, shapes)
    try:
        _apply_input_shapes(model, applicable)
        _static_input_shapes(model)
    except UsageError as exc:
        raise UsageError(f"{where}: {exc.what}", exc.fix) from None
    # a pipe or FIFO was read into memory once (frontend/load.py); ONNX Runtime must not reopen it
    path = None if source == "-" or is_stream(source) else source
    return BenchModel(where, path, model, base, bool(applicable), input_specs(model))


def _applicable(model: onnx.ModelProto, shapes: dict[str, tuple[int, ...]]) -> dict:
    """The --input-shape entries that change `model`'s inputs. Why skip the equal ones: a model
    already static at that shape then still goes to ONNX Runtime as its own file."""
    inits = {t.name for t in model.graph.initializer}
    current = {}
    for i in model.graph.input:
        if i.name in inits:
            continue
        dims = i.type.tensor_type.shape.dim
        if all(d.HasField("dim_value") and d.dim_value > 0 for d in dims):
            current[i.name] = tuple(d.dim_value for d in dims)
    return {k: v for k, v in shapes.items() if current.get(k) != v}


def _describe(shape: tuple[int, ...], dtype: np.dtype) -> str:
    return f"{np.dtype(dtype).name}[{','.join(map(str, shape))}]"


def require_same_inputs(models: Sequence[BenchModel]) -> None:
    """Every model must take the first one's inputs (names, shapes, element types), since one
    set of feeds is made from the first and given to all. UsageError naming the first mismatch."""
    first = models[0]
    ref = {n: (s, np.dtype(d)) for n, s, d in first.inputs}
    for m in models[1:]:
        got = {n: (s, np.dtype(d)) for n, s, d in m.inputs}
        missing = [n for n in ref if n not in got]
        extra = [n for n in got if n not in ref]
        fix = "bench compares models that take the same inputs; fix open dimensions with --input-shape"
        if missing or extra:
            what = (
                f"{m.source} has no input '{missing[0]}', which {first.source} has"
                if missing
                else f"{m.source} has an input '{extra[0]}' that {first.source} does not have"
            )
            raise UsageError(what, fix)
        for name, (shape, dtype) in ref.items():
            if got[name] != (shape, dtype):
                raise UsageError(
                    f"input '{name}' is {_describe(*got[name])} in {m.source} but "
                    f"{_describe(shape, dtype)} in {first.source}",
                    fix,
                )
