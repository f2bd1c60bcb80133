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
    """The GpuInfo of GPU `index`, or EnvironmentProblem (exit 4) when there is none."""
    from mlso_cli.runtime import gpu_info

    info = gpu_info(index)
    if info is None:
        raise EnvironmentProblem(
            f"no CUDA GPU with index {index} was found",
            "Timing kernels needs a GPU: run on a machine with an NVIDIA GPU and driver "
            "(optimize without --gpu decides by the cost model instead)",
        )
    return info
