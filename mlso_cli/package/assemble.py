"""Assemble an optimized model: lifted regions + their programs + compiled binaries -> ONNX.

Used by `optimize` and by the test helper that packages hand-written fixtures, so both produce
models the same way.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from mlso_cli.frontend.lift import LiftedRegion
from mlso_cli.ir import KernelGraph, dumps
from mlso_cli.package.absorb import absorb_constants, prune_unused
from mlso_cli.package.rewrite import PackagedRegion, package_model


class _LazyConstants(Mapping):
    """Initializers and Constant-node values by name, converted to numpy only when read."""

    def __init__(self, model: onnx.ModelProto) -> None:
        from mlso_cli.frontend.fold import constant_node_value

        self._inits = {t.name: t for t in model.graph.initializer}
        self._nodes = {
            n.output[0]: n for n in model.graph.node if n.op_type == "Constant" and n.output
        }
        self._value = constant_node_value

    def __getitem__(self, name: str) -> np.ndarray:
        if name in self._inits:
            return numpy_helper.to_array(self._inits[name])
        if name in self._nodes:
            v = self._value(self._nodes[name])
            if v is not None:
                return v
        raise KeyError(name)

    def __contains__(self, name: object) -> bool:
        return name in self._inits or name in self._nodes

    def __iter__(self) -> Iterator[str]:
        yield from self._inits
        yield from self._nodes

    def __len__(self) -> int:
        return len(self._inits) + len(self._nodes)


@dataclass(frozen=True)
class Built:
    """What code generation produced for one region's program."""

    program: KernelGraph
    binary: bytes
    plan: dict
    source_sha256: str


def assemble(
    model: onnx.ModelProto,
    items: Sequence[tuple[LiftedRegion, Built]],
    metadata: dict[str, str],
    *,
    copy: bool = True,
) -> onnx.ModelProto:
    """A new model: `model` with each item's region packaged. `model` is copied once here, and
    each step after works on that copy in place (a copy is a copy of every weight byte).
    `copy=False`: `model` itself is packaged and returned, for a caller that gives it up."""
    m = model
    if copy:
        m = onnx.ModelProto()
        m.CopyFrom(model)
    have = {t.name for t in m.graph.initializer}
    for lr, _ in items:
        for name, arr in lr.extra_inputs.items():
            if name not in have:
                m.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(arr), name))
                have.add(name)
    consts = _LazyConstants(m)
    m, indices = absorb_constants(
        m,
        [(lr.region.nodes, built.program.input_names) for lr, built in items],
        consts,
        [lr.columns for lr, _ in items],
        in_place=True,
    )
    regions = [
        PackagedRegion(
            node_indices=idx,
            inputs=list(built.program.input_names),
            outputs=list(built.program.output_names),
            binary=built.binary,
            plan=built.plan,
            ugraph_json=dumps(built.program),
            source_sha256=built.source_sha256,
            region_id=lr.region.id,
        )
        for idx, (lr, built) in zip(indices, items)
    ]
    return prune_unused(package_model(m, regions, metadata, in_place=True))
