"""Sibling projections: MatMuls of one region that read the same input with constant weights.

Why: a decoder's q, k and v projections read one normed input, and so do gate and up. Lifted
one by one they are one library GEMM each (codegen/libgemm.py), each paying cuBLASLt's fixed
call cost and reading A again. Lifted as one GEMM over the weights concatenated along N, then
one column selection per projection (frontend/selection.py, the form Slice and Split already
lift to), they are one launch. The rule reads the graph's structure only (op types, which
tensors are constants, shapes and dtypes), never node names or labels:

  - an ONNX MatMul whose second input is a constant (an initializer or a Constant node) of rank
    2, K x N_i, and whose first input has rank 2 or more, is a *projection* of its first input;
  - projections of one tensor with the same K and weight dtype (fp32 or fp16) in one region,
    two or more, are *siblings*, concatenated in the region's node order.

Lifting (frontend/lift.py) then builds the concatenated weight as a constant of its own,
`mlso_concat_<digest>` (the digest is of its bytes, so the same weights give the same name in
every region, model and fallback body), and lifts each sibling as its columns of the one matmul.
The form is exact: every output element is the same dot product as before. Lifting leaves a group
as separate matmuls when a weight cannot be read or a column selection does not factor within the
selection bound.

The packaged fallback body (package/absorb.py) reads each merged MatMul's weight as a Slice of
columns of that concatenation, which the kernel takes anyway, so the original weights are no
longer read by the region and are dropped unless something else reads them: the file holds each
projection weight once. Slicing columns of a concatenation is exact, so the body computes what
the original nodes did, bit for bit.

What checks it. The concatenated weight is a lifter constant (verify/liftcheck.py,
LIFTER_CONSTANTS), but it is not re-derived from the fallback body, which reads it and would
give it back whatever it holds: its columns that each body Slice takes are compared, bit for bit,
with the weight of the MatMul of the original model A that produces the same output, and every
column must be so read. Lifting a body lifts those Slices as the sibling weights
(frontend/lift.py, column_views), so the body lifts to the kernel's own merged form for the field
check. The lifting and emulator checks compare the program with the body numerically; and the
algebraic A-vs-B check lifts A with this rule off (`merge=False`), so the field evaluates A's
separate products with A's weights against B's one product with B's concatenated weight, exact
constants on both sides. Below opset 10 (Slice without bound inputs) the body keeps copies of
the originals instead, and verify re-derives the concatenation by lifting it, as before.

On by default; MLSO_MERGE_SIBLINGS=0 turns it off (mlso_cli/knobs.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto

MIN_SIBLINGS = 2
WEIGHT_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16)
"""Weight element types merged (numpy holds them exactly; bf16 weights stay separate)."""
PREFIX = "mlso_concat_"


@dataclass(frozen=True)
class Siblings:
    """Projections of tensor `a` merged into one matmul: (output name, weight name, N_i) each,
    in the region's node order."""

    a: str
    members: tuple[tuple[str, str, int], ...]

    @property
    def n(self) -> int:
        return sum(m[2] for m in self.members)

    def offset(self, output: str) -> int:
        off = 0
        for out, _, n in self.members:
            if out == output:
                return off
            off += n
        raise KeyError(output)


def weight_types(
    model: onnx.ModelProto, consts: Mapping[str, np.ndarray]
) -> dict[str, tuple[tuple[int, ...], int]]:
    """Constant name -> (shape, ONNX element type), for initializers and Constant-node values."""
    out = {t.name: (tuple(t.dims), t.data_type) for t in model.graph.initializer}
    for name, v in consts.items():
        if name not in out:
            code = {
                np.dtype(np.float32): TensorProto.FLOAT,
                np.dtype(np.float16): TensorProto.FLOAT16,
            }
            out[name] = (tuple(np.shape(v)), code.get(np.asarray(v).dtype, 0))
    return out


def groups(
    nodes: Sequence[onnx.NodeProto],
    region_nodes: Sequence[int],
    shapes: Mapping[str, tuple[int, ...]],
    weights: Mapping[str, tuple[tuple[int, ...], int]],
) -> dict[str, Siblings]:
    """Output name of every sibling projection in the region -> its group."""
    found: dict[tuple[str, int, int], list[tuple[str, str, int]]] = {}
    for i in region_nodes:
        node = nodes[i]
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.input) != 2:
            continue
        a, w = node.input
        info = weights.get(w)
        ashape = shapes.get(a)
        if info is None or ashape is None or len(ashape) < 2:
            continue
        wshape, code = info
        if len(wshape) != 2 or code not in WEIGHT_TYPES or wshape[0] != ashape[-1]:
            continue
        found.setdefault((a, wshape[0], code), []).append((node.output[0], w, wshape[1]))
    out: dict[str, Siblings] = {}
    for (a, _, _), members in found.items():
        if len(members) >= MIN_SIBLINGS:
            g = Siblings(a, tuple(members))
            for name, _, _ in members:
                out[name] = g
    return out
