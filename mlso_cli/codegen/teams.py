"""Reduction loops shared by kernel-level reductions and block-level reductions.

A reduction folds L values per output. A team of threads owns one output at a time:
  thread: one thread per output (short axes, or axes that are not innermost in memory, where
          consecutive threads then read consecutive addresses);
  warp:   32 lanes stride the axis, then a shuffle all-reduce;
  block:  every thread of the block strides the axis, then a block all-reduce (few long rows).
Each fold is a Pass; several passes over the same axis run one after the other (the split-KV
combine first finds the global max, then sums rescaled partials).
"""

from __future__ import annotations

from dataclasses import dataclass

from mlso_cli.codegen.cfmt import Code

FOLD = {
    "sum": ("0.0f", "{a} + {b}", "mlso::SumOp"),
    "max": ("mlso::neg_inf()", "fmaxf({a}, {b})", "mlso::MaxOp"),
}
LOOP_VAR = "rr"
"""The axis variable; coordinate strings mention it exactly when they vary along the axis."""


@dataclass
class Pass:
    acc: str
    op: str
    lines: list[str]
    expr: str


def choose_mode(length: int, outputs: int, innermost: bool, warps: int | None) -> str:
    """warps=None: kernel level (the grid has plenty of warps); else the block's warp count."""
    if length < 32 or not innermost:
        return "thread"
    if warps is not None and outputs < warps and length >= 1024:
        return "block"
    return "warp"


def loop_header(mode: str, length: int, threads: int) -> str:
    """The `for` over the axis that one thread of a team of `mode` walks (its share, strided)."""
    start, step = {
        "thread": ("0", "1"),
        "warp": ("lane", "32"),
        "block": ("threadIdx.x", str(threads)),
    }[mode]
    return f"for (int {LOOP_VAR} = {start}; {LOOP_VAR} < {length}; {LOOP_VAR} += {step})"


def emit_passes(code: Code, passes: list[Pass], length: int, mode: str, threads: int) -> None:
    for p in passes:
        init, fold, op = FOLD[p.op]
        code(f"float {p.acc} = {init};")
        with code.block(loop_header(mode, length, threads)):
            code.extend(p.lines)
            code(f"{p.acc} = {fold.format(a=p.acc, b=p.expr)};")
        if mode == "warp":
            code(f"{p.acc} = mlso::warp_allreduce<{op}>({p.acc});")
        elif mode == "block":
            code(f"{p.acc} = mlso::block_allreduce<{op}, {threads}>({p.acc}, red);")
