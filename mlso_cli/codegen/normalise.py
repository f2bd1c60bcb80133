"""Exact rewrites of a block graph into the accumulator forms that code generation keeps stable.

Why: `ACC_SUM(exp(s) @ v)` and `ACC_EXP_WSUM(s, v)` mean the same sum over the for-loop steps,
but only the second says that every step's terms should be kept relative to one running row
max. A search that writes the first form (or a lifted softmax moved inside a loop) would
otherwise make codegen sum exp(s) of every step in fp32, which overflows at logits near 89 and
in 16-bit staging near 11. The rewrites are identities of the IR's exact semantics, so codegen,
the shared-memory plan and the interpreter's "as codegen computes" mode all apply them, and the
finite-field checker never needs to (it reads the original graph). ascomputed.py builds the
graph the interpreter runs from these rewrites.

Rules are a table: op of the node -> function(node) -> replacement or None.
"""

from __future__ import annotations

from collections.abc import Callable

from mlso_cli.ir import build as b
from mlso_cli.ir.graph import BlockGraph
from mlso_cli.ir.node import Node
from mlso_cli.ir.ops import Op, Phase


def _loop_exp(x: Node) -> Node | None:
    """s when x = exp(s) is a loop-phase value with at least one key axis, else None."""
    if x.op is Op.EXP and x.phase is Phase.LOOP and len(x.shape) >= 2:
        return x.src[0]
    return None


def _acc_sum(n: Node) -> Node | None:
    x = n.src[0]
    if x.op is Op.MATMUL:
        s = _loop_exp(x.src[0])
        v = x.src[1]
        if s is not None and v.phase is Phase.LOOP:
            return b.accumulate(Op.ACC_EXP_WSUM, s, v)  # sum_t exp(s_t) @ v_t
    if x.op is Op.REDUCE_SUM:
        s = _loop_exp(x.src[0])
        if s is not None and x.arg == len(s.shape) - 1:
            return b.accumulate(Op.ACC_EXP_SUM, s)  # sum_t rowsum(exp(s_t))
    return None


RULES: dict[Op, Callable[[Node], Node | None]] = {
    Op.ACC_SUM: _acc_sum,
}
"""Op -> rewrite of a node of that op (None: keep it)."""


def normalise(bg: BlockGraph) -> BlockGraph:
    """bg with every RULES rewrite applied bottom-up (the same graph when none applies)."""
    done: dict[Node, Node] = {}
    for n in bg.nodes():
        src = tuple(done[s] for s in n.src)
        m = n if src == n.src else n.replace(src=src)
        rule = RULES.get(m.op)
        new = rule(m) if rule is not None else None
        done[n] = new if new is not None and new.shape == m.shape else m
    outs = tuple(done[s] for s in bg.outputs)
    return bg if outs == bg.outputs else bg.replace(outputs=outs)
