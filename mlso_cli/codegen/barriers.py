"""Where a graph-defined kernel needs __syncthreads(): between passes that share shared memory.

Why a module of its own: the barrier rule is the one place where emission must know what each
pass reads and writes, and it must hold for every pass kind alike. A pass is a function that
appends its lines to a Code and reports the shared buffers it touched.
"""

from __future__ import annotations

from collections.abc import Callable

from mlso_cli.codegen.cfmt import Code

Touched = Callable[[], tuple[set[str], set[str]]]
"""After a pass ran: (shared buffers it read, shared buffers it wrote)."""


def emit_with_barriers(
    code: Code, passes: list[Callable[[Code], None]], touched: Callable[[], None], last: Touched
) -> None:
    """Emit passes in order with a barrier only where a pass reads or writes shared memory that an
    earlier pass since the last barrier wrote, or writes what one read (RAW, WAW, WAR).
    `touched()` resets the tracker before each pass, `last()` reports what the pass touched."""
    reads: set[str] = set()
    writes: set[str] = set()
    for p in passes:
        sub = Code(code.ind)
        touched()
        p(sub)
        if not sub.lines:
            continue
        r, w = last()
        if (r & writes) or (w & (reads | writes)):
            code("__syncthreads();")
            reads, writes = set(), set()
        code.lines.extend(sub.lines)
        reads |= r
        writes |= w
