"""Is there a real NVIDIA GPU, what is its arch, and does a kernel plan fit it?

Why not ask ONNX Runtime: onnxruntime-gpu lists CUDAExecutionProvider even on machines without a
GPU, so only the driver can tell. PyCUDA is used when installed (it is what the profiler uses);
otherwise libcuda.so.1 is queried through ctypes. Neither creates a CUDA context.
"""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass
from functools import cache
from typing import Any

from mlso_cli.runtime.plan import smem_needed

_ATTR_CC_MAJOR = 75
_ATTR_CC_MINOR = 76
_ATTR_SMEM_OPTIN = 97  # CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
_TARGET = re.compile(r"^(sm|compute)_([0-9]+)([0-9])([a-z]?)$")


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    compute_capability: tuple[int, int]
    max_smem_optin: int
    """Largest dynamic shared memory a block may use after raising the function's limit."""

    @property
    def arch(self) -> str:
        major, minor = self.compute_capability
        return f"sm_{major}{minor}"


def _pycuda_info(index: int) -> GpuInfo | None:
    import pycuda.driver as cuda  # noqa: PLC0415 - optional dependency

    cuda.init()
    if index >= cuda.Device.count():
        return None
    dev = cuda.Device(index)
    attr = cuda.device_attribute
    return GpuInfo(
        index=index,
        name=dev.name(),
        compute_capability=tuple(dev.compute_capability()),  # type: ignore[arg-type]
        max_smem_optin=int(dev.get_attribute(attr.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)),
    )


def _ctypes_info(index: int) -> GpuInfo | None:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    if lib.cuInit(0) != 0:
        return None
    count = ctypes.c_int(0)
    if lib.cuDeviceGetCount(ctypes.byref(count)) != 0 or index >= count.value:
        return None
    dev = ctypes.c_int(0)
    if lib.cuDeviceGet(ctypes.byref(dev), index) != 0:
        return None

    def attribute(which: int) -> int:
        out = ctypes.c_int(0)
        if lib.cuDeviceGetAttribute(ctypes.byref(out), which, dev) != 0:
            return 0
        return out.value

    name = ctypes.create_string_buffer(256)
    lib.cuDeviceGetName(name, 256, dev)
    return GpuInfo(
        index=index,
        name=name.value.decode(errors="replace"),
        compute_capability=(attribute(_ATTR_CC_MAJOR), attribute(_ATTR_CC_MINOR)),
        max_smem_optin=attribute(_ATTR_SMEM_OPTIN),
    )


@cache
def gpu_info(index: int = 0) -> GpuInfo | None:
    """The GPU with this ordinal, or None when there is no usable NVIDIA GPU/driver."""
    try:
        import pycuda.driver  # noqa: F401, PLC0415
    except ImportError:
        return _ctypes_info(index)
    try:
        return _pycuda_info(index)
    except Exception:  # pycuda raises its own error types when the driver is unusable
        return None


def target_runs_on(target: str, cc: tuple[int, int]) -> bool:
    """Whether code built for `target` runs on a GPU of compute capability `cc`.

    sm_XY SASS runs on X.Y' with Y' >= Y (same major); sm_XYa only on exactly X.Y; compute_XY PTX
    is JIT-compiled for any cc >= X.Y (but compute_XYa only on X.Y).
    """
    m = _TARGET.match(target)
    if not m:
        return False
    kind, major, minor, suffix = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)
    if suffix:
        return cc == (major, minor)
    if kind == "sm":
        return cc[0] == major and cc[1] >= minor
    return cc >= (major, minor)


def plan_fits(plan: dict[str, Any], gpu: GpuInfo) -> str | None:
    """None when the plan's binary can run on `gpu`, else the reason it cannot."""
    targets = plan.get("targets", [])
    if not any(target_runs_on(t, gpu.compute_capability) for t in targets):
        return (
            f"its binary targets {', '.join(targets)}, which cannot run on {gpu.arch} ({gpu.name})"
        )
    need = smem_needed(plan)
    if need > gpu.max_smem_optin:
        return f"it needs {need} bytes of shared memory per block, {gpu.name} allows {gpu.max_smem_optin}"
    return None
