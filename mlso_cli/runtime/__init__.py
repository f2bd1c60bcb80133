"""mlso's runtime: the MlsoKernel custom-op library (csrc/), its build, and the session helper.

    library_path()                  the built libmlso_ort.so (built into the cache on first use)
    session(model, providers=None)  an onnxruntime.InferenceSession, with the library registered
                                    only when it can run (CUDA EP, real GPU, every plan fits)
    gpu_info(index=0)               the GPU as the driver reports it, or None

onnxruntime is imported only when a session is made, so importing this package stays cheap.
"""

from __future__ import annotations

from mlso_cli.runtime.check import CheckedNode, check_model, check_node
from mlso_cli.runtime.gpu import GpuInfo, gpu_info
from mlso_cli.runtime.session_helper import (
    LibraryDecision,
    library_decision,
    library_path,
    session,
)

__all__ = [
    "CheckedNode",
    "GpuInfo",
    "LibraryDecision",
    "check_model",
    "check_node",
    "gpu_info",
    "library_decision",
    "library_path",
    "session",
]
