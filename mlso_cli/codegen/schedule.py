"""The one scheduling loop: a dependency-first order of what a kernel graph or block must compute.

Why one: the kernel-level lowering (which kernels run in which order) and a graph-defined kernel
(which passes run in which order) both order nodes by a depth-first walk from their targets
over "what must exist before this" edges. Two copies of that walk drifted; this is the only one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from mlso_cli.ir.node import Node


def schedule(
    targets: Iterable[Node],
    deps: Callable[[Node], list[Node]],
    keep: Callable[[Node], bool] = lambda n: True,
) -> list[Node]:
    """Every node reachable from `targets` through `deps`, each after its dependencies, in the
    order a depth-first walk finishes them (targets in their given order); `keep` filters."""
    order: list[Node] = []
    done: set[Node] = set()
    stack: list[tuple[Node, bool]] = [(t, False) for t in reversed(list(targets))]
    while stack:
        n, expanded = stack.pop()
        if n in done:
            continue
        if expanded:
            done.add(n)
            if keep(n):
                order.append(n)
            continue
        stack.append((n, True))
        for d in reversed(deps(n)):
            if d not in done:
                stack.append((d, False))
    return order
