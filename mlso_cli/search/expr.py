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

Known limits (each errs towards admitting, except where marked *prunes*):
  - a monomial's coefficient is not compared (a mean over the wrong length passes the
    subexpression check; equality with the target output catches it);
  - *prunes*: a strided partial sum (a sum over the high digit of a split index, which block
    graphs never produce: their chunks are contiguous) is not recognised as a piece of the sum;
  - *prunes*: a multi-variable sum whose body separates (sum_{a,b} x_a y_b) is not factored;
    the normal form never creates one from the IR's ops, but a reshape of a contraction could;
  - *prunes* in principle: commutative children with identical name-free structure are ordered
    by id, so two alpha-equivalent terms with such ties could intern differently;
  - the intern tables in terms.py only grow: a long search should run in a worker process.
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

__all__ = [
    "BlockContext",
    "Expr",
    "ExprAlgebra",
    "ExprError",
    "Target",
    "abstract",
    "abstract_graph",
    "expr_equal",
    "run_block",
]
