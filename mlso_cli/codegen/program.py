"""What code generation produces: buffers, kernels, the launch plan, the program.

The plan is the contract with the ONNX Runtime op (runtime/csrc) and the PyCUDA launcher:

    {"version": 1, "targets": [...], "smem_max": int,
     "inputs": [{"dtype", "shape"}], "outputs": [{"dtype", "shape"}], "scratch": [{"bytes"}],
     "zero": [{"kind", "index"}], "launches": [{"kernel", "grid", "block", "smem", "args"}]}

Kernels take only pointers, in `args` order; every shape is a constant in the source. Scratch
buffers are fp32. A launch whose `smem` exceeds 48 KB (49152 bytes) needs its function's
MAX_DYNAMIC_SHARED_SIZE_BYTES raised to `smem` before launching; both runtimes do that for
exactly those launches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mlso_cli.codegen.cfmt import numel
from mlso_cli.ir.ops import DType

DEFAULT_SMEM_LIMIT = 48 * 1024
"""Dynamic shared memory a launch may use without raising the function's limit."""

KIND_ORDER = {"input": 0, "output": 1, "scratch": 2}
PREFIX = {"input": "in", "output": "out", "scratch": "sc"}


@dataclass(eq=False)
class Buffer:
    kind: str
    index: int
    dtype: DType
    shape: tuple[int, ...]

    @property
    def name(self) -> str:
        return f"{PREFIX[self.kind]}{self.index}"

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * self.dtype.itemsize

    def ref(self) -> dict[str, Any]:
        return {"kind": self.kind, "index": self.index}

    def sort_key(self) -> tuple[int, int]:
        return KIND_ORDER[self.kind], self.index


@dataclass
class Kernel:
    name: str
    source: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int
    params: list[Buffer]
    what: str = ""
    """One line for logs: which μGraph node(s) this kernel computes."""


@dataclass
class GeneratedProgram:
    source: str
    plan: dict[str, Any]
    kernel_names: list[str]
    kernels: list[Kernel] = field(default_factory=list, repr=False)


def build_plan(
    targets: tuple[str, ...],
    inputs: list[Buffer],
    outputs: list[Buffer],
    scratch: list[Buffer],
    kernels: list[Kernel],
    zero: list[Buffer] | None = None,
) -> dict[str, Any]:
    return {
        "version": 1,
        "targets": list(targets),
        "smem_max": max([k.smem for k in kernels] + [0]),
        "inputs": [{"dtype": b.dtype.value, "shape": list(b.shape)} for b in inputs],
        "outputs": [{"dtype": b.dtype.value, "shape": list(b.shape)} for b in outputs],
        "scratch": [{"bytes": max(b.nbytes, 4)} for b in scratch],
        "zero": [b.ref() for b in zero or []],
        "launches": [
            {
                "kernel": k.name,
                "grid": list(k.grid),
                "block": list(k.block),
                "smem": k.smem,
                "args": [b.ref() for b in k.params],
            }
            for k in kernels
        ],
    }
