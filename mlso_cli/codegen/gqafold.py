"""Grouped heads as GEMM rows: a matmul whose B repeats each group's matrix over R heads is one
GEMM per group with R times the rows.

Why: grouped-query attention lifts K (and V) as [.., G, s, d] reshaped to [.., G, 1, s, d],
broadcast to [.., G, R, s, d] and merged into [.., H = G * R, s, d]. No single batch stride
reads that (head h reads group h // R), so a library GEMM had to stage the repeated K, a launch
and a copy per attention core. The R query heads of a group are consecutive in A ([.., H, M, K]
is [.., G, R * M, K] read row-major), and so are their rows of C, so the same product is G GEMMs
of (R * M) x K by K x N over the group's own B: B read in place, C written as the original shape
expects (a reshape, a view). Exact: every output element is the same dot product.

Applied by roots.kernel_roots before any decision, so that generate, the lowering plan and the
cost model see one graph; the verifier and the search see the μGraph as written. Nodes are
structurally equal, so the rewritten graph's inputs are the original's.

Not folded: a matmul that is a program output, or whose product is read by an ADD (the
library GEMM's bias and residual epilogues are decided on the graph as written, and a folded
product is read through a reshape), or read only through views (it may be saved through them
into an output, roots.through_views: for P @ V that is the copy the fold would save).
"""

from __future__ import annotations

from mlso_cli.codegen.stabilise import consumers_of
from mlso_cli.ir import build as b
from mlso_cli.ir.graph import KernelGraph
from mlso_cli.ir.node import Node
from mlso_cli.ir.ops import VIEW, Op


def fold_grouped_heads(kg: KernelGraph) -> KernelGraph:
    """kg with every foldable matmul (module docstring) computed per group; kg itself when none."""
    nodes = kg.nodes()
    consumers = consumers_of(nodes)
    outputs = set(kg.outputs)
    folds: dict[Node, Node] = {}
    for n in nodes:
        if n.op is not Op.MATMUL or n in outputs:
            continue
        readers = consumers.get(n, [])
        if not readers or any(r.op is Op.ADD for r in readers):
            continue
        if all(r.op in VIEW for r in readers):
            continue
        got = _folded(n)
        if got is not None:
            folds[n] = got
    if not folds:
        return kg
    done: dict[Node, Node] = {}
    for n in nodes:
        if n in folds:
            done[n] = folds[n]
            continue
        src = tuple(done[s] for s in n.src)
        done[n] = n if src == n.src else n.replace(src=src)
    return kg.replace(outputs=tuple(done[o] for o in kg.outputs))


def _folded(mm: Node) -> Node | None:
    """reshape(matmul(A as [.., G, R * M, K], B's group matrices), mm.shape), or None."""
    a, bb = mm.src
    if len(mm.shape) < 3 or a.shape[:-2] != mm.shape[:-2]:
        return None
    group = _group_matrices(bb)
    if group is None:
        return None
    s, r = group
    *lead, h, m, k = a.shape
    g = h // r
    if g * r != h or s.shape[-3] != g:
        return None
    a2 = b.reshape(a, (*lead, g, r * m, k))
    c2 = b.matmul(a2, s)
    if c2.dtype is not mm.dtype:
        return None
    return b.reshape(c2, mm.shape)


def _group_matrices(x: Node) -> tuple[Node, int] | None:
    """(S, R) when x[.., h, :, :] is S[.., h // R, :, :] for S of shape [.., G, rows, cols]:
    x is the merge of a broadcast of S over R, under transposes of its last two dims."""
    if x.op is Op.TRANSPOSE:
        perm = x.arg
        nd = len(perm)
        if tuple(perm[:-2]) != tuple(range(nd - 2)):
            return None
        inner = _group_matrices(x.src[0])
        if inner is None:
            return None
        s, r = inner
        return b.transpose(s, perm), r
    if x.op is not Op.RESHAPE or len(x.shape) < 3:
        return None
    bc = x.src[0]
    if bc.op is not Op.BROADCAST or len(bc.shape) != len(x.shape) + 1:
        return None
    *lead, g, r, rows, cols = bc.shape
    if tuple(x.shape) != (*lead, g * r, rows, cols) or r < 2:
        return None
    src = bc.src[0]
    if tuple(src.shape) != (*lead, g, 1, rows, cols):
        return None
    return b.reshape(src, (*lead, g, rows, cols)), r
