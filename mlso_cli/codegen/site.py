"""`KernelSite`: what a kernel-level printer gets from the lowering, and nothing more.

Why: the printers of kernel-level kernels (matmulkernel.print_matmul, reducekernel.print_reduce)
print a frozen plan; the lowering decides where tensors live and what each kernel's plan is.
A site gives a printer its kernel's name and parameters, emitters over kernel tensors, and a
read-only view of where they are stored: no Lowering to call back into.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

from mlso_cli.codegen.scale import Storage
from mlso_cli.ir.node import Node

if TYPE_CHECKING:
    from mlso_cli.codegen.emitter import Emitter
    from mlso_cli.codegen.lower import Lowering, Uses


@dataclass(frozen=True)
class KernelSite:
    name: str
    uses: Uses
    """The kernel's parameters, as the printer reads and writes buffers."""
    storage: Mapping[Node, Storage]
    emitter: Callable[..., Emitter]
    """emitter(uses, names[, flat]): an emitter over kernel tensors for this kernel's parameters
    and names (Lowering.emitter)."""


def site(lw: Lowering) -> KernelSite:
    """The next kernel's site in the lowering (its name is the launch index)."""
    return KernelSite(lw.kernel_name(), lw.uses(), MappingProxyType(lw.storage), lw.emitter)
