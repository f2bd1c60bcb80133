"""Horizontal fusion: which consecutive, independent elementwise kernels share one launch.

Why: under CUDA graphs each launch of a small kernel costs about 2 µs whatever it computes, and a
lifted decoder layer ends in sibling elementwise kernels that read the same GEMM result and write
separate outputs (Qwen2's v + bias, q rotary and k rotary: three launches of 64 to 448 blocks).
They need not be separate: one launch whose grid is the sum of theirs, each block running the
part its index falls in (a block-uniform branch: no divergence), does the same work.

Decided from the μGraph alone, with the launch order (roots.kernel_roots holds the result); the
printer is siblingkernel.py. A kernel joins the launch of the kernels scheduled just before it
when every rule of JOIN holds (a table: rule name -> condition), so the groups are runs of
consecutive kernels in the schedule, which is dependency-first; nothing is reordered.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mlso_cli.ir.node import Node

MAX_PARTS = 16
"""Kernels one launch may hold. Each part is at most kernels.GRID_CAP (2^20) blocks, so the
summed grid stays far below CUDA's 2^31-1; and a block finds its part by comparing its index with
the parts' bounds in order, which should stay a short chain."""


@dataclass(frozen=True)
class Context:
    """What the rules read about the program's kernels."""

    fusable: Callable[[Node], bool]
    """An elementwise kernel of its own (kernels.emit_elementwise prints it: 256 threads, no
    shared memory, a grid-stride loop over its elements), not a value a library GEMM's epilogue
    may compute (that has no kernel to share)."""
    deps: Callable[[Node], list[Node]]
    """The kernels a kernel reads (roots._deps)."""


JOIN: tuple[tuple[str, Callable[[Context, tuple[Node, ...], Node], bool]], ...] = (
    ("the launch so far is elementwise kernels", lambda cx, g, n: all(map(cx.fusable, g))),
    ("the kernel is elementwise", lambda cx, g, n: cx.fusable(n)),
    # the schedule is dependency-first, so no earlier part reads n; n must read no earlier part
    ("it reads no kernel of the launch", lambda cx, g, n: not set(cx.deps(n)) & set(g)),
    ("the launch has room", lambda cx, g, n: len(g) < MAX_PARTS),
)
"""Conditions for kernel n to join the launch g of the kernels scheduled just before it. Same
block size (256) and no shared memory follow from "elementwise"; writes never clash, since every
kernel writes its own buffer and a kernel reading another's is a dependency."""


def launch_groups(schedule: tuple[Node, ...], cx: Context) -> tuple[tuple[Node, ...], ...]:
    """The schedule cut into launches: runs of consecutive kernels that JOIN admits, in order."""
    groups: list[tuple[Node, ...]] = []
    for n in schedule:
        if groups and all(rule(cx, groups[-1], n) for _, rule in JOIN):
            groups[-1] = (*groups[-1], n)
        else:
            groups.append((n,))
    return tuple(groups)
