"""The one check that a GPU is there, shared by every stage and command that times kernels.

Why its own module: `optimize --gpu` (the select stage) and `bench` both need it, and a command
module is not a library; the check raises the documented exit-4 error before any work starts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlso_cli.errors import EnvironmentProblem

if TYPE_CHECKING:
    from mlso_cli.runtime.gpu import GpuInfo


def require_gpu(index: int) -> GpuInfo:
    """The GpuInfo of GPU `index`, or EnvironmentProblem (exit 4) when there is none, or when
    the installed onnxruntime cannot run on it.

    Why the onnxruntime check here: every `--gpu` path (optimize's select stage, verify, bench)
    runs ONNX Runtime on the CUDA EP. With the CPU package installed, the first GPU tensor fails
    deep inside ORT ("Can't allocate memory on the device using this package"), after minutes
    of search, as a generic error (exit 1). Measured on the H200 machine, 2026-12-03."""
    from mlso_cli.runtime import gpu_info

    info = gpu_info(index)
    if info is None:
        raise EnvironmentProblem(
            f"no CUDA GPU with index {index} was found",
            "Timing kernels needs a GPU: run on a machine with an NVIDIA GPU and driver "
            "(optimize without --gpu decides by the cost model instead)",
        )
    require_cuda_ep()
    return info


def require_cuda_ep() -> None:
    """EnvironmentProblem (exit 4) unless onnxruntime has the CUDA execution provider."""
    import onnxruntime as ort

    from mlso_cli.runtime.session_helper import CUDA_EP

    if CUDA_EP not in ort.get_available_providers():
        raise EnvironmentProblem(
            f"this onnxruntime build ({ort.__version__}) has no {CUDA_EP}",
            "Install onnxruntime-gpu in place of onnxruntime (pip uninstall onnxruntime; "
            "pip install onnxruntime-gpu), or drop --gpu",
        )
