"""What code generation produces: buffers, kernels, the launch plan, the program.

The plan is the contract with the ONNX Runtime op (runtime/csrc) and the PyCUDA launcher:

    {"version": 1 | 2 | 3 | 4, "targets": [...], "smem_max": int,
     "inputs": [{"dtype", "shape"}], "outputs": [{"dtype", "shape"}],
     "scratch": [{"bytes"} | {"bytes", "dtype", "shape"}],
     "zero": [{"kind", "index"}],
     "launches": [{"kernel", "grid", "block", "smem", "args"}                 # a generated kernel
                  | {"kind": "gemm", "m", "n", "k", "batch", "a", "b", "c",   # a library GEMM
                     "dtype_ab", "dtype_c", "alpha", "beta"[, "bias" | "residual"]}]}

Kernels take only pointers, in `args` order; every shape is a constant in the source. Scratch
buffers are fp32 unless the entry names a dtype (a library GEMM's 16-bit operand). A launch
whose `smem` exceeds 48 KB (49152 bytes) needs its function's MAX_DYNAMIC_SHARED_SIZE_BYTES
raised to `smem` before launching; both runtimes do that for exactly those launches.

A library GEMM (version 2; a plan without one stays version 1, byte for byte as before) computes,
for every batch entry `e`, row-major C[e] = alpha * A[e] @ B[e] + beta * C[e] with fp32
accumulation. Each operand is {"buf": ref, "offset", "ld", "stride", "trans"} in elements of its
dtype: element (e, r, c) of the logical (rows x cols) matrix is at
offset + e * stride + (trans ? c * ld + r : r * ld + c); C is never transposed. runtime/plan.py
validates it (bounds included) and both runtimes run it with cuBLASLt (docs/runtime.md).
A GEMM with a bias epilogue (version 3; a plan without one keeps its version) also names
"bias": {"buf": ref, "offset"}, n elements of C's dtype added to every row of C in fp32 before C
is rounded to its dtype (codegen/libgemm.py decides where). A GEMM with a residual epilogue
(version 4, likewise only then) names "residual": {"buf": ref, "offset", "ld", "stride"}, an
m x n matrix of C's dtype per batch entry, addressed as a (never transposed) operand is, and
computes C[e] = alpha * A[e] @ B[e] + beta * R[e] (beta 1): cuBLASLt's C is R, its D the plan's
C, and R meets the fp32 product before the one rounding to C's dtype. A launch has at most one
of "bias" and "residual".
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


@dataclass(frozen=True)
class GemmOperand:
    """One matrix of a library GEMM: a buffer and its row-major strides, in elements."""

    buf: Buffer
    offset: int
    ld: int
    stride: int
    """Between batch entries (0: every entry reads the same matrix, a broadcast operand)."""
    trans: bool = False
    """The logical (rows x cols) matrix is stored transposed: element (r, c) at c * ld + r."""

    def to_json(self) -> dict[str, Any]:
        return {
            "buf": self.buf.ref(),
            "offset": self.offset,
            "ld": self.ld,
            "stride": self.stride,
            "trans": self.trans,
        }


@dataclass(frozen=True)
class GemmBias:
    """A library GEMM's bias epilogue: n elements of C's dtype at `offset` of `buf` (cuBLASLt reads
    the bias in the output's type), the same for every row and batch entry."""

    buf: Buffer
    offset: int

    def to_json(self) -> dict[str, Any]:
        return {"buf": self.buf.ref(), "offset": self.offset}


@dataclass(frozen=True)
class GemmResidual:
    """A library GEMM's residual epilogue: an m x n matrix per batch entry, of C's dtype, row-major
    at `offset` of `buf` with leading dimension `ld` and batch stride `stride` (elements), added to
    the product inside the call (cuBLASLt's C with beta = 1; the plan's C is cuBLASLt's D)."""

    buf: Buffer
    offset: int
    ld: int
    stride: int

    def to_json(self) -> dict[str, Any]:
        return {"buf": self.buf.ref(), "offset": self.offset, "ld": self.ld, "stride": self.stride}


@dataclass
class GemmLaunch:
    """A kernel-level matmul run by the GPU's BLAS library (cuBLASLt) instead of generated code:
    C[e] = A[e] @ B[e] for e < batch, A (m x k), B (k x n), C (m x n), fp32 accumulation."""

    name: str
    m: int
    n: int
    k: int
    batch: int
    a: GemmOperand
    b: GemmOperand
    c: GemmOperand
    dtype_ab: DType
    dtype_c: DType
    what: str = ""
    bias: GemmBias | None = None
    """A bias epilogue: C[e] = A[e] @ B[e] + bias, the vector added to every row."""
    residual: GemmResidual | None = None
    """A residual epilogue: C[e] = A[e] @ B[e] + R[e] (never together with a bias)."""

    @property
    def smem(self) -> int:
        return 0

    @property
    def params(self) -> list[Buffer]:
        bias = [self.bias.buf] if self.bias is not None else []
        residual = [self.residual.buf] if self.residual is not None else []
        return [self.a.buf, self.b.buf, self.c.buf, *bias, *residual]

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "gemm",
            "m": self.m,
            "n": self.n,
            "k": self.k,
            "batch": self.batch,
            "a": self.a.to_json(),
            "b": self.b.to_json(),
            "c": self.c.to_json(),
            "dtype_ab": self.dtype_ab.value,
            "dtype_c": self.dtype_c.value,
            "alpha": 1.0,
            "beta": 0.0 if self.residual is None else 1.0,
            **({"bias": self.bias.to_json()} if self.bias is not None else {}),
            **({"residual": self.residual.to_json()} if self.residual is not None else {}),
        }


Launch = Kernel | GemmLaunch


@dataclass
class GeneratedProgram:
    source: str
    plan: dict[str, Any]
    kernel_names: list[str]
    kernels: list[Launch] = field(default_factory=list, repr=False)
    """Every launch in plan order: generated kernels and library GEMMs."""


def build_plan(
    targets: tuple[str, ...],
    inputs: list[Buffer],
    outputs: list[Buffer],
    scratch: list[Buffer],
    kernels: list[Launch],
    zero: list[Buffer] | None = None,
) -> dict[str, Any]:
    """The launch plan. Version 2 only when a library GEMM is in it, 3 only when one has a bias
    epilogue, 4 only when one has a residual epilogue, so every plan that could be written before
    those existed is still written identically (same hash, same cache keys), and older runtimes
    refuse a plan they cannot run with a clear "version" error."""
    library = [k for k in kernels if isinstance(k, GemmLaunch)]
    version = 2 if library else 1
    if any(k.bias is not None for k in library):
        version = 3
    if any(k.residual is not None for k in library):
        version = 4
    return {
        "version": version,
        "targets": list(targets),
        "smem_max": max([k.smem for k in kernels] + [0]),
        "inputs": [{"dtype": b.dtype.value, "shape": list(b.shape)} for b in inputs],
        "outputs": [{"dtype": b.dtype.value, "shape": list(b.shape)} for b in outputs],
        "scratch": [_scratch_entry(b) for b in scratch],
        "zero": [b.ref() for b in zero or []],
        "launches": [_launch_entry(k) for k in kernels],
    }


def _scratch_entry(b: Buffer) -> dict[str, Any]:
    """fp32 scratch is bytes only, as before; a 16-bit scratch (a library GEMM's materialised
    operand) names its dtype and shape, so the emulator and the validators know its type."""
    if b.dtype is DType.F32:
        return {"bytes": max(b.nbytes, 4)}
    return {"bytes": max(b.nbytes, 4), "dtype": b.dtype.value, "shape": list(b.shape)}


def _launch_entry(k: Launch) -> dict[str, Any]:
    if isinstance(k, GemmLaunch):
        return k.to_json()
    return {
        "kernel": k.name,
        "grid": list(k.grid),
        "block": list(k.block),
        "smem": k.smem,
        "args": [b.ref() for b in k.params],
    }
