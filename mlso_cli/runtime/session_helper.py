"""Open an ONNX Runtime session for an mlso model, with the MlsoKernel library only when it can run.

Why the care: once the library is registered, ORT stops running the nodes' function bodies, and
the op has only a CUDA kernel. Registering it for a CPU session fails ("NOT_IMPLEMENTED: Could not
find an implementation"), and registering it on a GPU whose arch or shared memory does not fit
a plan fails at kernel creation. So the library is registered only for CUDA sessions, on a real
GPU (asked of the driver: onnxruntime-gpu lists the CUDA EP even without one), that fits every
plan; otherwise the session runs the original subgraphs through the function-body fallback.
Every MlsoKernel node is validated first (check.py), whichever way the session goes.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx
from google.protobuf.message import DecodeError

from mlso_cli.console import log
from mlso_cli.errors import InputError
from mlso_cli.runtime.check import CheckedNode, check_model
from mlso_cli.runtime.gpu import gpu_info, plan_fits

CUDA_EP = "CUDAExecutionProvider"
CPU_EP = "CPUExecutionProvider"

Provider = str | tuple[str, dict[str, Any]]


def library_path() -> Path:
    """The built libmlso_ort.so (see build.py). Imported lazily, so that importing the package
    does not import build.py and `python -m mlso_cli.runtime.build` runs it exactly once."""
    from mlso_cli.runtime import build  # noqa: PLC0415

    return build.library_path()


@dataclass(frozen=True)
class LibraryDecision:
    register: bool
    reason: str


def read_model(model: str | os.PathLike[str] | bytes) -> tuple[onnx.ModelProto, Path | None]:
    """The model's graph (external weights are not read) and the folder its external data is in."""
    if isinstance(model, (bytes, bytearray)):
        proto = onnx.ModelProto()
        try:
            proto.ParseFromString(bytes(model))
        except DecodeError:
            raise InputError(
                "the model bytes are not an ONNX model", "Pass a serialized onnx.ModelProto"
            ) from None
        return proto, None
    path = Path(model)
    if not path.is_file():
        raise InputError(f"{path}: no such file", "Check the path")
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except (DecodeError, OSError, ValueError) as e:
        raise InputError(
            f"{path} is not a readable ONNX model ({e})", "Pass a complete .onnx file"
        ) from None
    return proto, path.resolve().parent


def _name(p: Provider) -> str:
    return p if isinstance(p, str) else p[0]


def _cuda_device(providers: Sequence[Provider], provider_options: Sequence[dict] | None) -> int:
    for i, p in enumerate(providers):
        if _name(p) != CUDA_EP:
            continue
        opts: dict[str, Any] = {}
        if not isinstance(p, str) and len(p) > 1 and p[1]:
            opts = dict(p[1])
        elif provider_options is not None and i < len(provider_options):
            opts = dict(provider_options[i] or {})
        return int(opts.get("device_id", 0))
    return 0


def default_providers() -> list[str]:
    """CUDA then CPU when onnxruntime has the CUDA EP and the driver sees a GPU; else CPU only."""
    import onnxruntime as ort  # noqa: PLC0415 - slow import, only when a session is made

    if CUDA_EP in ort.get_available_providers() and gpu_info(0) is not None:
        return [CUDA_EP, CPU_EP]
    return [CPU_EP]


def library_decision(
    nodes: Sequence[CheckedNode],
    providers: Sequence[Provider],
    provider_options: Sequence[dict] | None = None,
) -> LibraryDecision:
    """Whether to register the MlsoKernel library for these (already checked) nodes, and why."""
    import onnxruntime as ort  # noqa: PLC0415

    if not nodes:
        return LibraryDecision(False, "the model has no MlsoKernel nodes")
    if CUDA_EP not in [_name(p) for p in providers]:
        return LibraryDecision(False, f"the session does not use {CUDA_EP}")
    if CUDA_EP not in ort.get_available_providers():
        return LibraryDecision(False, f"this onnxruntime build has no {CUDA_EP}")
    device = _cuda_device(providers, provider_options)
    gpu = gpu_info(device)
    if gpu is None:
        return LibraryDecision(False, f"the CUDA driver reports no GPU {device}")
    for node in nodes:
        why = plan_fits(node.plan, gpu)
        if why is not None:
            return LibraryDecision(
                False, f"MlsoKernel node '{node.name}' does not fit GPU {device}: {why}"
            )
    return LibraryDecision(
        True, f"all {len(nodes)} MlsoKernel nodes fit GPU {device} ({gpu.name}, {gpu.arch})"
    )


def session(
    path_or_bytes: str | os.PathLike[str] | bytes,
    providers: Sequence[Provider] | None = None,
    **kw: Any,
) -> Any:
    """An onnxruntime.InferenceSession for the model, with the mlso library registered when it can
    run (see the module docstring), else the function-body fallback.

    providers: as for onnxruntime; None picks CUDA+CPU when there is a GPU, else CPU.
    kw: passed to InferenceSession (sess_options, provider_options, ...). A given sess_options
    object gets the library registered on it.
    """
    import onnxruntime as ort  # noqa: PLC0415

    model, base_dir = read_model(path_or_bytes)
    nodes = check_model(model, base_dir=base_dir, subgraphs=True)
    chosen = default_providers() if providers is None else list(providers)
    decision = library_decision(nodes, chosen, kw.get("provider_options"))
    options = kw.pop("sess_options", None) or ort.SessionOptions()
    if decision.register:
        options.register_custom_ops_library(str(library_path()))
        log(f"mlso runtime library registered: {decision.reason}")
    elif nodes:
        log(f"mlso runtime library not registered ({decision.reason}); the original subgraphs run")
    source = (
        bytes(path_or_bytes)
        if isinstance(path_or_bytes, (bytes, bytearray))
        else str(path_or_bytes)
    )
    return ort.InferenceSession(source, sess_options=options, providers=chosen, **kw)
