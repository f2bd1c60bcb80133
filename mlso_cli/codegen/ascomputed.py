"""The μGraph as code generation computes it, for the interpreter's float32 mode.

Why: the interpreter's float32 mode exists to show what generated code computes, so it must not
make its own numerical choices. This module rewrites a kernel graph into one whose literal
float32 evaluation follows codegen's decisions, each taken from the function codegen uses:
  - block graphs get codegen's exact rewrites (normalise.normalise);
  - every EXP that codegen keeps relative to a row max (stabilise.stabilised) is marked
    (synthetic.Stabilised) with its mask factors as extra sources;
  - the operands of a block matmul that runs on tensor cores are cast to its 16-bit type, as
    the staging copies (and 16-bit tiles) that ldmatrix reads are (the BlockPlan's matmul plans,
    blockplan.plan_block);
  - a library GEMM's C that codegen keeps in 16-bit scratch (libgemm.c_dtype) is rounded there
    (`sixteen_bit_scratch`, which the interpreter's float32 backend stores in its dtype).
"""

from __future__ import annotations

from mlso_cli.codegen import synthetic
from mlso_cli.codegen.blockplan import plan_block
from mlso_cli.codegen.normalise import normalise
from mlso_cli.codegen.stabilise import consumers_of, stabilised
from mlso_cli.ir.graph import BlockGraph, KernelGraph
from mlso_cli.ir.node import Node, toposort
from mlso_cli.ir.ops import DType, Op

MMA_OPERANDS = {Op.MATMUL: (0, 1), Op.ACC_EXP_WSUM: (1,)}
"""Block op -> the sources its tensor-core plan reads from 16-bit storage."""


def _rounded_operands(bg: BlockGraph) -> dict[Node, DType]:
    """Block node -> the 16-bit type its matmul operands are read in (tensor-core plans only)."""
    plans = plan_block(bg).plans
    return {n: p.dtype for n, p in plans.items() if p.kind == "mma" and p.dtype is not None}


def _cast(x: Node, dt: DType) -> Node:
    if x.dtype is dt:
        return x  # a tile stored in that type: nothing to round
    return Node(Op.CAST, (x,), dt, x.shape, DType.F32, x.phase)


def _rebuild(
    nodes: list[Node], roots: tuple[Node, ...], rounded: dict[Node, DType]
) -> dict[Node, Node]:
    """node -> node as computed, bottom-up."""
    stab = stabilised(nodes, consumers_of(nodes))
    done: dict[Node, Node] = {}

    def rebuild(n: Node) -> None:
        src = tuple(done[s] for s in n.src)
        if n in rounded:
            dt = rounded[n]
            src = tuple(
                _cast(s, dt) if i in MMA_OPERANDS.get(n.op, ()) else s for i, s in enumerate(src)
            )
        if n in stab:
            axis, factors = stab[n]
            # a mask factor meets the EXP only downstream (exp * mask), so the topological order
            # of the roots may not have reached it yet: rebuild its cone first
            for m in toposort(list(factors)):
                if m not in done:
                    rebuild(m)
            done[n] = Node(
                Op.EXP,
                src + tuple(done[f] for f in factors),
                synthetic.Stabilised(axis),
                n.shape,
                n.dtype,
                n.phase,
            )
        elif n.op is Op.GRAPH_DEF:
            bg = normalise(n.arg)
            bdone = _rebuild(bg.nodes(), bg.outputs, _rounded_operands(n.arg))
            done[n] = n.replace(
                src=src, arg=bg.replace(outputs=tuple(bdone[s] for s in bg.outputs))
            )
        else:
            done[n] = n if src == n.src else n.replace(src=src)

    for n in toposort(list(roots)):
        if n not in done:
            rebuild(n)
    return done


def as_computed(kg: KernelGraph) -> KernelGraph:
    """kg rewritten so that its literal float32 evaluation makes codegen's decisions."""
    return as_computed_map(kg)[0]


def as_computed_map(kg: KernelGraph) -> tuple[KernelGraph, dict[Node, Node]]:
    """as_computed(kg), and each node of kg -> its node there."""
    done = _rebuild(kg.nodes(), tuple(kg.inputs) + tuple(kg.outputs), {})
    out = kg.replace(
        inputs=tuple(done[n] for n in kg.inputs), outputs=tuple(done[n] for n in kg.outputs)
    )
    return out, done


def sixteen_bit_scratch(kg: KernelGraph) -> frozenset[Node]:
    """The kernel-level values of kg that generated code stores in 16-bit scratch (a library
    GEMM's C, or the bias/residual ADD its epilogue writes there, and a value only GEMMs read:
    libgemm.scratch_dtype), read off a
    real lowering, since whether a matmul becomes a library GEMM is only decided there. Empty
    when kg does not lower (the interpreter runs μGraphs that code generation refuses too)."""
    from mlso_cli.codegen.errors import CodegenError
    from mlso_cli.codegen.libgemm import SIXTEEN_BIT
    from mlso_cli.codegen.lower import Lowering
    from mlso_cli.codegen.program import Buffer

    lw = Lowering(kg, ("sm_90",))
    try:
        lw.generate()
    except (CodegenError, AssertionError, KeyError, ValueError):
        return frozenset()
    nodes = set(kg.nodes())
    return frozenset(
        n
        for n, st in lw.storage.items()
        if n in nodes
        and isinstance(st.buffer, Buffer)
        and st.buffer.kind == "scratch"
        and st.dtype in SIXTEEN_BIT
    )
