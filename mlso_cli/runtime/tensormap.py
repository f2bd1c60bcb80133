"""CUtensorMap (TMA descriptor) encoding on the host, through libcuda's cuTensorMapEncodeTiled.

    spec = row_major_2d("float16", w_ptr, rows=K, cols=N, box_rows=128, box_cols=64)
    raw = encode_tiled(spec)            # 128 bytes, passed by value to a __grid_constant__ param

Why here and not in the kernel: an sm_90 TMA copy reads its tensor geometry (base address, sizes,
byte strides, box, swizzle) from an opaque 128-byte descriptor that only the driver can encode.
The kernels of kernels_templates/mlso_sm90_*.cuh take two of them per GEMM (W and X).

Why validate in Python first: the driver answers every bad argument with the same
CUDA_ERROR_INVALID_VALUE. `validate` checks the documented rules (cuda.h, cuTensorMapEncodeTiled)
that matter to mlso and says which one failed; it runs without a GPU, so tests cover it on CPU.
libcuda.so.1 is opened lazily, only by `encode_tiled`, so CPU-only machines import this module.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache

from mlso_cli.errors import EnvironmentProblem

TENSOR_MAP_BYTES = 128
MAX_RANK = 5
MAX_BOX = 256
MAX_DIM = 1 << 32
MAX_STRIDE = 1 << 40

# CUtensorMapDataType codes (cuda.h) and element sizes, by mlso's dtype names.
DATA_TYPES: dict[str, tuple[int, int]] = {
    "uint8": (0, 1),
    "uint16": (1, 2),
    "uint32": (2, 4),
    "int32": (3, 4),
    "uint64": (4, 8),
    "int64": (5, 8),
    "float16": (6, 2),
    "float32": (7, 4),
    "float64": (8, 8),
    "bfloat16": (9, 2),
}

# CUtensorMapSwizzle codes and the largest inner box extent (bytes) each allows.
SWIZZLES: dict[str, tuple[int, int]] = {
    "none": (0, 0),
    "32b": (1, 32),
    "64b": (2, 64),
    "128b": (3, 128),
}

# CUtensorMapL2promotion codes.
L2_PROMOTIONS: dict[str, int] = {"none": 0, "64b": 1, "128b": 2, "256b": 3}

_INTERLEAVE_NONE = 0
_OOB_FILL_ZERO = 0


class TensorMapError(ValueError):
    """A tensor map argument breaks one of cuTensorMapEncodeTiled's rules (a caller bug)."""


@dataclass(frozen=True)
class TiledSpec:
    """Arguments of cuTensorMapEncodeTiled, innermost dimension first (as the driver takes them).

    dims are in elements; strides in bytes, one per dimension above the innermost (so
    len(strides) == rank - 1); box is the tile one copy moves, in elements."""

    dtype: str
    address: int
    dims: tuple[int, ...]
    strides: tuple[int, ...]
    box: tuple[int, ...]
    element_strides: tuple[int, ...] | None = None
    swizzle: str = "128b"
    l2_promotion: str = "256b"

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def element_size(self) -> int:
        return DATA_TYPES[self.dtype][1]

    @property
    def box_bytes(self) -> int:
        """Bytes one copy writes to shared memory (out-of-bounds elements included, as zeros):
        what an mbarrier's expect_tx must announce for it."""
        n = self.element_size
        for b in self.box:
            n *= b
        return n


def row_major_2d(
    dtype: str,
    address: int,
    rows: int,
    cols: int,
    box_rows: int,
    box_cols: int,
    swizzle: str = "128b",
    l2_promotion: str = "256b",
) -> TiledSpec:
    """The spec of a dense row-major [rows, cols] matrix read in [box_rows, box_cols] tiles.

    Why a helper: the driver wants the contiguous dimension first (cols, then rows) and the row
    stride in bytes; getting that order wrong is the usual TMA bug."""
    size = DATA_TYPES[dtype][1] if dtype in DATA_TYPES else 0
    return TiledSpec(
        dtype=dtype,
        address=int(address),
        dims=(int(cols), int(rows)),
        strides=(int(cols) * size,),
        box=(int(box_cols), int(box_rows)),
        swizzle=swizzle,
        l2_promotion=l2_promotion,
    )


def validate(spec: TiledSpec) -> None:
    """Raise TensorMapError naming the first documented rule `spec` breaks (no GPU needed)."""
    if spec.dtype not in DATA_TYPES:
        raise TensorMapError(f"tensor map dtype {spec.dtype!r} is not one of {sorted(DATA_TYPES)}")
    if spec.swizzle not in SWIZZLES:
        raise TensorMapError(f"tensor map swizzle {spec.swizzle!r} is not one of {list(SWIZZLES)}")
    if spec.l2_promotion not in L2_PROMOTIONS:
        raise TensorMapError(
            f"tensor map L2 promotion {spec.l2_promotion!r} is not one of {list(L2_PROMOTIONS)}"
        )
    rank = spec.rank
    if not 1 <= rank <= MAX_RANK:
        raise TensorMapError(f"tensor map rank {rank} is outside 1..{MAX_RANK}")
    if len(spec.box) != rank:
        raise TensorMapError(f"tensor map box has {len(spec.box)} entries for rank {rank}")
    if len(spec.strides) != rank - 1:
        raise TensorMapError(
            f"tensor map takes {rank - 1} byte strides for rank {rank} (the innermost dimension "
            f"is contiguous), got {len(spec.strides)}"
        )
    estrides = spec.element_strides or (1,) * rank
    if len(estrides) != rank:
        raise TensorMapError(
            f"tensor map element strides have {len(estrides)} entries for rank {rank}"
        )
    esize = spec.element_size
    if spec.address % 16:
        raise TensorMapError(f"tensor map base address {spec.address:#x} is not 16-byte aligned")
    for i, d in enumerate(spec.dims):
        if not 1 <= d <= MAX_DIM:
            raise TensorMapError(f"tensor map dimension {i} has size {d}, outside 1..2^32")
    for i, s in enumerate(spec.strides):
        if s % 16:
            raise TensorMapError(
                f"tensor map stride {i} is {s} bytes, not a multiple of 16 (a row-major matrix "
                f"of {spec.dtype} needs its row length to be a multiple of {16 // esize})"
            )
        if not 0 < s < MAX_STRIDE:
            raise TensorMapError(f"tensor map stride {i} is {s} bytes, outside 1..2^40-1")
    if spec.strides and spec.strides[0] < spec.dims[0] * esize:
        raise TensorMapError(
            f"tensor map stride 0 ({spec.strides[0]} bytes) is shorter than a row of "
            f"{spec.dims[0]} {spec.dtype} elements"
        )
    for i, b in enumerate(spec.box):
        if not 1 <= b <= MAX_BOX:
            raise TensorMapError(f"tensor map box dimension {i} is {b}, outside 1..{MAX_BOX}")
    inner = spec.box[0] * esize
    if inner % 16:
        raise TensorMapError(
            f"tensor map box's inner extent is {inner} bytes, not a multiple of 16"
        )
    limit = SWIZZLES[spec.swizzle][1]
    if limit and inner > limit:
        raise TensorMapError(
            f"tensor map box's inner extent is {inner} bytes; swizzle {spec.swizzle} allows at "
            f"most {limit}"
        )
    for i, e in enumerate(estrides):
        if not 1 <= e <= 8:
            raise TensorMapError(f"tensor map element stride {i} is {e}, outside 1..8")


@cache
def _libcuda() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise EnvironmentProblem(
            f"libcuda.so.1 (the NVIDIA driver library) could not be loaded ({exc})",
            "TMA tensor maps need the NVIDIA driver: run on a machine with an NVIDIA GPU and "
            "driver installed.",
        ) from None
    try:
        fn = lib.cuTensorMapEncodeTiled
    except AttributeError:
        raise EnvironmentProblem(
            "the NVIDIA driver has no cuTensorMapEncodeTiled (it predates CUDA 12)",
            "Update the NVIDIA driver to one that supports CUDA 12 or newer.",
        ) from None
    u32p = ctypes.POINTER(ctypes.c_uint32)
    u64p = ctypes.POINTER(ctypes.c_uint64)
    fn.argtypes = [
        ctypes.c_void_p,  # CUtensorMap*
        ctypes.c_int,  # CUtensorMapDataType
        ctypes.c_uint32,  # rank
        ctypes.c_void_p,  # globalAddress
        u64p,  # globalDim
        u64p,  # globalStrides
        u32p,  # boxDim
        u32p,  # elementStrides
        ctypes.c_int,  # interleave
        ctypes.c_int,  # swizzle
        ctypes.c_int,  # l2Promotion
        ctypes.c_int,  # oobFill
    ]
    fn.restype = ctypes.c_int
    return lib


def _error_string(lib: ctypes.CDLL, code: int) -> str:
    msg = ctypes.c_char_p()
    try:
        if lib.cuGetErrorString(code, ctypes.byref(msg)) == 0 and msg.value:
            return msg.value.decode(errors="replace")
    except AttributeError:
        pass
    return f"CUresult {code}"


def encode_tiled(spec: TiledSpec) -> bytes:
    """The 128-byte CUtensorMap for `spec` (validated first; a CUDA context should be current).

    The bytes are what the kernel parameter holds: pass them by value (a pointer to them in
    cuLaunchKernel's kernelParams), never a device pointer to them."""
    validate(spec)
    lib = _libcuda()
    rank = spec.rank
    out = (ctypes.c_uint8 * TENSOR_MAP_BYTES)()
    # CUtensorMap is 64-byte aligned in cuda.h; encode into an aligned scratch buffer.
    scratch = ctypes.create_string_buffer(TENSOR_MAP_BYTES + 64)
    base = (ctypes.addressof(scratch) + 63) & ~63
    dims = (ctypes.c_uint64 * rank)(*spec.dims)
    strides = (ctypes.c_uint64 * max(rank - 1, 1))(*(spec.strides or (0,)))
    box = (ctypes.c_uint32 * rank)(*spec.box)
    estrides = (ctypes.c_uint32 * rank)(*(spec.element_strides or (1,) * rank))
    rc = lib.cuTensorMapEncodeTiled(
        ctypes.c_void_p(base),
        DATA_TYPES[spec.dtype][0],
        rank,
        ctypes.c_void_p(spec.address),
        dims,
        strides,
        box,
        estrides,
        _INTERLEAVE_NONE,
        SWIZZLES[spec.swizzle][0],
        L2_PROMOTIONS[spec.l2_promotion],
        _OOB_FILL_ZERO,
    )
    if rc != 0:
        raise RuntimeError(
            f"cuTensorMapEncodeTiled failed: {_error_string(lib, rc)} for {spec} (the Python "
            "checks passed: a rule they do not cover, or no current CUDA context)"
        )
    ctypes.memmove(out, base, TENSOR_MAP_BYTES)
    return bytes(out)
