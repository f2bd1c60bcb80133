"""Views as strides: which view chains over a stored tensor are plain strided accesses.

Why: RESHAPE / TRANSPOSE / BROADCAST are free in the IR; consumers index through them. When a
chain of views over a stored tensor is a strided view (it almost always is), loaders can use
direct addresses (and 16-byte cp.async when the inner dim is contiguous) instead of evaluating
coordinates with div/mod. CAST is transparent here: loads widen to fp32 anyway.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mlso_cli.codegen.scale import Storage
from mlso_cli.codegen.synthetic import Copy
from mlso_cli.ir.node import Node
from mlso_cli.ir.ops import Op


@dataclass(frozen=True)
class Strided:
    leaf: Node
    strides: tuple[int, ...]
    base: int = 0


def view_strides(
    old_shape: Sequence[int], old_strides: Sequence[int], new_shape: Sequence[int]
) -> tuple[int, ...] | None:
    """Strides of a reshape of a strided tensor, or None if it is not a view (PyTorch's rule)."""
    if not old_shape:
        return tuple(0 for _ in new_shape)
    if not new_shape:
        return ()
    new_strides = [0] * len(new_shape)
    view_d = len(new_shape) - 1
    chunk = old_strides[-1]
    tensor_numel = 1
    view_numel = 1
    for d in range(len(old_shape) - 1, -1, -1):
        tensor_numel *= old_shape[d]
        if d == 0 or (old_shape[d - 1] != 1 and old_strides[d - 1] != tensor_numel * chunk):
            while view_d >= 0 and (view_numel < tensor_numel or new_shape[view_d] == 1):
                new_strides[view_d] = view_numel * chunk
                view_numel *= new_shape[view_d]
                view_d -= 1
            if view_numel != tensor_numel:
                return None
            if d > 0:
                chunk = old_strides[d - 1]
                tensor_numel = 1
                view_numel = 1
    if view_d != -1:
        return None
    return tuple(new_strides)


def strided(n: Node, storage: Mapping[Node, Storage]) -> Strided | None:
    """n as a strided view of a stored tensor, or None (computed values, non-view reshapes)."""
    if n in storage:
        # a computed input (indexmask) has no memory to view: readers evaluate it instead
        return None if storage[n].computed is not None else Strided(n, storage[n].strides)
    if n.op is Op.CAST:
        return strided(n.src[0], storage)
    if n.op is Op.TRANSPOSE:
        r = strided(n.src[0], storage)
        return None if r is None else Strided(r.leaf, tuple(r.strides[p] for p in n.arg), r.base)
    if n.op is Op.BROADCAST:
        r = strided(n.src[0], storage)
        if r is None:
            return None
        src = n.src[0].shape
        lead = len(n.shape) - len(src)
        st = tuple(
            0 if i < lead or src[i - lead] == 1 else r.strides[i - lead]
            for i in range(len(n.shape))
        )
        return Strided(r.leaf, st, r.base)
    if n.op is Op.RESHAPE:
        r = strided(n.src[0], storage)
        if r is None:
            return None
        if isinstance(n.arg, Copy) or n.shape == n.src[0].shape:
            return r
        st = view_strides(n.src[0].shape, r.strides, n.shape)
        return None if st is None else Strided(r.leaf, st, r.base)
    return None
