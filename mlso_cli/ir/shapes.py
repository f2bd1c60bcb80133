"""Shape rules, one function per op family, shared by the builders and the spec checker.

Each rule takes the source shapes and the op's arg and returns the result shape, or raises
ShapeError. The checker re-derives every node's shape with these rules and compares.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mlso_cli.ir.ops import ACCUMULATORS, BINARY, REDUCE, UNARY, Op


class ShapeError(ValueError):
    pass


Shape = tuple[int, ...]


def broadcast(a: Shape, b: Shape) -> Shape:
    out = []
    for i in range(1, max(len(a), len(b)) + 1):
        x = a[-i] if i <= len(a) else 1
        y = b[-i] if i <= len(b) else 1
        if x != y and x != 1 and y != 1:
            raise ShapeError(f"cannot broadcast {a} with {b}")
        out.append(max(x, y))
    return tuple(reversed(out))


def _unary(shapes: list[Shape], arg: Any) -> Shape:
    return shapes[0]


def _binary(shapes: list[Shape], arg: Any) -> Shape:
    return broadcast(shapes[0], shapes[1])


def _matmul(shapes: list[Shape], arg: Any) -> Shape:
    a, b = shapes
    if len(a) < 2 or len(b) < 2:
        raise ShapeError(f"matmul needs rank >= 2, got {a} and {b}")
    if a[-1] != b[-2]:
        raise ShapeError(f"matmul inner dims differ: {a} @ {b}")
    return broadcast(a[:-2], b[:-2]) + (a[-2], b[-1])


def _reduce(shapes: list[Shape], arg: Any) -> Shape:
    (a,) = shapes
    if not isinstance(arg, int) or not 0 <= arg < len(a):
        raise ShapeError(f"reduce axis {arg} out of range for {a}")
    return a[:arg] + (1,) + a[arg + 1 :]


def _reshape(shapes: list[Shape], arg: Any) -> Shape:
    (a,) = shapes
    n = 1
    for d in a:
        n *= d
    m = 1
    for d in arg:
        m *= d
    if n != m or any(d <= 0 for d in arg):
        raise ShapeError(f"cannot reshape {a} to {arg}")
    return tuple(arg)


def _transpose(shapes: list[Shape], arg: Any) -> Shape:
    (a,) = shapes
    if sorted(arg) != list(range(len(a))):
        raise ShapeError(f"bad permutation {arg} for {a}")
    return tuple(a[p] for p in arg)


def _broadcast_to(shapes: list[Shape], arg: Any) -> Shape:
    (a,) = shapes
    if broadcast(a, tuple(arg)) != tuple(arg):
        raise ShapeError(f"cannot broadcast {a} to {arg}")
    return tuple(arg)


def _acc_exp_sum(shapes: list[Shape], arg: Any) -> Shape:
    (s,) = shapes
    return s[:-1] + (1,)


def _acc_exp_wsum(shapes: list[Shape], arg: Any) -> Shape:
    return _matmul(shapes, arg)


RULES: dict[Op, Callable[[list[Shape], Any], Shape]] = {
    **{op: _unary for op in UNARY},
    **{op: _binary for op in BINARY},
    **{op: _reduce for op in REDUCE},
    Op.MATMUL: _matmul,
    Op.RESHAPE: _reshape,
    Op.TRANSPOSE: _transpose,
    Op.BROADCAST: _broadcast_to,
    Op.ACC_SUM: _unary,
    Op.ACC_EXP_SUM: _acc_exp_sum,
    Op.ACC_EXP_WSUM: _acc_exp_wsum,
    Op.SAVE: _unary,
}
assert RULES.keys() >= ACCUMULATORS


def infer(op: Op, shapes: list[Shape], arg: Any) -> Shape:
    rule = RULES.get(op)
    if rule is None:
        raise ShapeError(f"no shape rule for {op.value}")
    return rule(shapes, arg)
