"""Op kinds, dtypes and loop phases of the μGraph, and the facts about each op as tables.

One `Op` enum serves all three levels; `LEVELS` says where each op may appear. Everything the
spec checker, the interpreter and code generation need to know about an op is looked up here,
never re-derived in an if-chain.
"""

from __future__ import annotations

from enum import Enum


class DType(Enum):
    F16 = "float16"
    BF16 = "bfloat16"
    F32 = "float32"

    @property
    def itemsize(self) -> int:
        return 4 if self is DType.F32 else 2


class Phase(Enum):
    """When a block op runs: before the for-loop, once per step inside it, or after it."""

    PRE = "pre"
    LOOP = "loop"
    POST = "post"


class Op(Enum):
    # sources
    INPUT = "input"  # kernel graph input; arg = input index
    CONST = "const"  # scalar constant; arg = float or fractions.Fraction
    ITER = "iter"  # block: this block's tile of kernel input `arg` (imap/fmap in BlockGraph)
    # unary elementwise
    EXP = "exp"
    SQUARE = "square"
    SQRT = "sqrt"
    RSQRT = "rsqrt"
    RECIPROCAL = "reciprocal"
    NEG = "neg"
    SILU = "silu"
    SIGMOID = "sigmoid"
    TANH = "tanh"
    ERF = "erf"
    GELU = "gelu"  # exact GELU: 0.5 x (1 + erf(x / sqrt 2))
    RELU = "relu"
    CAST = "cast"  # arg = DType
    # binary elementwise, numpy broadcasting
    ADD = "add"
    SUB = "sub"
    MUL = "mul"
    DIV = "div"
    MAX = "max"
    # contraction over the last dim of a and the second-last of b; leading dims broadcast
    MATMUL = "matmul"
    # reductions over one axis, keepdims; arg = axis (non-negative)
    REDUCE_SUM = "reduce_sum"
    REDUCE_MEAN = "reduce_mean"
    REDUCE_MAX = "reduce_max"
    # views; arg = target shape / permutation / target shape
    RESHAPE = "reshape"
    TRANSPOSE = "transpose"
    BROADCAST = "broadcast"
    # block for-loop accumulators (src in LOOP phase, result in POST phase)
    ACC_SUM = "acc_sum"  # sum over loop steps of src
    ACC_EXP_SUM = "acc_exp_sum"  # sum over steps of rowsum(exp(s)); rescaling accumulator, part 1
    ACC_EXP_WSUM = "acc_exp_wsum"  # sum over steps of exp(s) @ v; rescaling accumulator, part 2
    SAVE = "save"  # block output saver; arg = OutputMap
    # kernel level
    GRAPH_DEF = "graph_def"  # graph-defined kernel; arg = BlockGraph; src = kernel tensors
    PROJ = "proj"  # output `arg` of a multi-output node
    # thread level
    THREAD = "thread"  # fused elementwise chain in registers; arg = ThreadGraph
    THREAD_IN = "thread_in"  # placeholder inside a ThreadGraph; arg = index


UNARY = frozenset(
    {
        Op.EXP,
        Op.SQUARE,
        Op.SQRT,
        Op.RSQRT,
        Op.RECIPROCAL,
        Op.NEG,
        Op.SILU,
        Op.SIGMOID,
        Op.TANH,
        Op.ERF,
        Op.GELU,
        Op.RELU,
        Op.CAST,
    }
)
BINARY = frozenset({Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.MAX})
ELEMENTWISE = UNARY | BINARY
REDUCE = frozenset({Op.REDUCE_SUM, Op.REDUCE_MEAN, Op.REDUCE_MAX})
VIEW = frozenset({Op.RESHAPE, Op.TRANSPOSE, Op.BROADCAST})
ACCUMULATORS = frozenset({Op.ACC_SUM, Op.ACC_EXP_SUM, Op.ACC_EXP_WSUM})
COMPUTE = ELEMENTWISE | REDUCE | VIEW | {Op.MATMUL, Op.CONST}

ARITY: dict[Op, int] = {
    **{op: 1 for op in UNARY},
    **{op: 2 for op in BINARY},
    **{op: 1 for op in REDUCE},
    **{op: 1 for op in VIEW},
    Op.MATMUL: 2,
    Op.INPUT: 0,
    Op.CONST: 0,
    Op.ITER: 0,
    Op.ACC_SUM: 1,
    Op.ACC_EXP_SUM: 1,
    Op.ACC_EXP_WSUM: 2,
    Op.SAVE: 1,
    Op.PROJ: 1,
    Op.THREAD_IN: 0,
}
"""Fixed arity of each op; GRAPH_DEF and THREAD take any number of sources."""

KERNEL_OPS = COMPUTE | {Op.INPUT, Op.GRAPH_DEF, Op.PROJ}
BLOCK_OPS = COMPUTE | ACCUMULATORS | {Op.ITER, Op.SAVE, Op.THREAD}
THREAD_OPS = ELEMENTWISE | {Op.CONST, Op.THREAD_IN}
