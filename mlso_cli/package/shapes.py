"""The input shapes an optimized model was made for: recorded when packaging, checked before a run.

Why: `mlso optimize` fixes every graph input to one static shape (`--input-shape`), folds the
model's shape arithmetic for it and compiles kernels for it, so the model computes only at those
shapes. The output keeps its graph inputs static on purpose: ONNX Runtime then refuses any other
shape at the boundary, before a node runs. Kept symbolic, the folded Reshape targets would meet the
new shape inside the graph, where they fail with an error about some inner node or, when the
element counts happen to agree, run and compute the wrong thing.

ONNX Runtime's refusal names neither mlso nor the fix, and graph inputs are easily edited (made
dynamic to get past that very error), so the shapes are also recorded in `metadata_props` under
`mlso.input_shapes`: a JSON object, graph input name -> list of dims (an int, or null for a dim
that was not static). mlso's runners and users compare their feeds with it first
(`check_input_shapes`), and the MlsoKernel op refuses mismatched inputs itself on the GPU
(runtime/csrc/mlso_ort.cc).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

import onnx

from mlso_cli.errors import UsageError

META_INPUT_SHAPES = "mlso.input_shapes"

Dims = tuple[int | None, ...]


def graph_input_shapes(model: onnx.ModelProto) -> dict[str, Dims]:
    """The dims of every graph input that is not an initializer: an int where static, None where
    symbolic or unknown. Inputs without a tensor shape are left out."""
    inits = {t.name for t in model.graph.initializer}
    out: dict[str, Dims] = {}
    for vi in model.graph.input:
        if vi.name in inits or not vi.type.HasField("tensor_type"):
            continue
        tt = vi.type.tensor_type
        if not tt.HasField("shape"):
            continue
        out[vi.name] = tuple(
            d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None
            for d in tt.shape.dim
        )
    return out


def input_shapes_json(model: onnx.ModelProto) -> str:
    """The value of mlso.input_shapes for `model` (its graph inputs as they are now)."""
    return json.dumps({k: list(v) for k, v in graph_input_shapes(model).items()})


def _parse(text: str) -> dict[str, Dims] | None:
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError, TypeError):
        return None
    if not isinstance(value, dict):
        return None
    out: dict[str, Dims] = {}
    for name, dims in value.items():
        if not isinstance(dims, list) or not all(
            d is None or (isinstance(d, int) and not isinstance(d, bool) and d > 0) for d in dims
        ):
            return None
        out[name] = tuple(dims)
    return out


def _has_mlso_nodes(model: onnx.ModelProto) -> bool:
    return any(n.domain == "ai.mlso" for n in model.graph.node)


def recorded_input_shapes(model: onnx.ModelProto) -> dict[str, Dims] | None:
    """The input shapes `model` was optimized for, or None when it says nothing about them.

    mlso.input_shapes when present and well formed; else, for a model with MlsoKernel nodes
    (written before the record existed), its graph inputs' static dims. Pass the model as read
    from its file: once `--input-shape` has been applied to it, its graph inputs say what was
    asked for, not what it was made for. A malformed record counts as none: it is advice for
    messages, and the MlsoKernel op checks the shapes its kernels need on its own."""
    props = {p.key: p.value for p in model.metadata_props}
    if META_INPUT_SHAPES in props:
        parsed = _parse(props[META_INPUT_SHAPES])
        if parsed is not None:
            return parsed
    if _has_mlso_nodes(model):
        return graph_input_shapes(model)
    return None


def _spec(name: str, dims: Sequence[int | None]) -> str:
    return f"{name}=" + ",".join("N" if d is None else str(d) for d in dims)


def input_shape_mismatches(
    model: onnx.ModelProto, shapes: Mapping[str, Sequence[int]]
) -> list[tuple[str, Dims, tuple[int, ...]]]:
    """(input, shape it was optimized for, shape given) for each input in `shapes` whose shape
    differs from the record: another rank, or another value in a dim that was static."""
    recorded = recorded_input_shapes(model) or {}
    out = []
    for name, got in shapes.items():
        want = recorded.get(name)
        got = tuple(int(d) for d in got)
        if want is None:
            continue
        if len(want) != len(got) or any(w is not None and w != g for w, g in zip(want, got)):
            out.append((name, want, got))
    return out


def check_input_shapes(
    model: onnx.ModelProto, shapes: Mapping[str, Sequence[int]], source: str
) -> None:
    """Raise UsageError (exit 2) when `shapes` (graph input -> the shape about to be fed, e.g.
    `{k: v.shape for k, v in feeds.items()}`) differ from those `model` was optimized for.

    Call it before opening a session on an optimized model, with the model as read from its file
    (see `recorded_input_shapes`). Models that record nothing pass."""
    bad = input_shape_mismatches(model, shapes)
    if not bad:
        return
    recorded = recorded_input_shapes(model) or {}
    want = " ".join(_spec(n, w) for n, w, _ in bad)
    got = " ".join(_spec(n, g) for n, _, g in bad)
    wanted = {n: tuple(s) for n, s in shapes.items()}
    flags = " ".join(f"--input-shape {_spec(n, wanted.get(n, d))}" for n, d in recorded.items())
    raise UsageError(
        f"{source} was optimized for input shape {want} (its graph and MlsoKernel nodes are "
        f"specialised to it), but this run feeds {got}",
        f"Feed the shapes it was optimized for, or re-run `mlso optimize` on the original model "
        f"with {flags}",
    )
