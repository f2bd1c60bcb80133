"""Abstract expressions for the μGraph search: the one import the enumerator needs.

    target = Target.from_graph(lifted)          # normalise the target once
    env[node] = abstract(node, env, ctx)        # incremental: from the sources' expressions
    target.admits(env[node])                    # prune a candidate tensor that is no
                                                # subexpression of any target tensor
    expr_equal(env[out], target.outputs[0])     # a finished candidate computes the target

Block-level nodes need the BlockContext of their graph-defined kernel (`BlockContext.of(bg,
source expressions)`); `run_block` abstracts a whole block graph and returns its outputs.
Modules: terms.py (hash-consed normal form), abstract.py (ops and views on indexed
expressions), target.py (pattern keys and the target's subexpression set).
"""

from __future__ import annotations

from mlso_cli.search.abstract import (
    BlockContext,
    Expr,
    ExprAlgebra,
    ExprError,
    abstract,
    abstract_graph,
    expr_equal,
    run_block,
)
from mlso_cli.search.target import Target

__all__ = ["BlockContext", "Expr", "ExprAlgebra", "ExprError", "Target", "abstract", "abstract_graph",
           "expr_equal", "run_block"]
