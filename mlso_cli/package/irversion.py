"""Which ONNX IR version the packaged model declares.

Why: onnx 1.23 writes IR 14 by default, which ONNX Runtime 1.31 refuses ("Unsupported model IR
version"); and MlsoKernel's function overloads (FunctionProto.overload / NodeProto.overload) need
IR >= 10. So the input's IR version is kept when the installed ORT accepts it, raised to 10 when
lower, and lowered to the ORT's maximum otherwise.
"""

from __future__ import annotations

import re

MIN_IR_FOR_OVERLOADS = 10

# (ORT major, minor) -> highest IR version it loads. Only measured or well-known points; a
# version between two points gets the lower one, which is always safe to write.
_MAX_IR: tuple[tuple[tuple[int, int], int], ...] = (
    ((1, 18), 10),  # first ORT bundling onnx 1.16 (IR 10)
    ((1, 31), 13),  # measured: ORT 1.31.1 loads IR <= 13 and refuses 14
)


def _major_minor(version: str) -> tuple[int, int]:
    m = re.match(r"^\s*(\d+)\.(\d+)", version)
    if not m:
        raise ValueError(f"not an onnxruntime version: {version!r}")
    return int(m.group(1)), int(m.group(2))


def max_ir_for_ort(version: str) -> int:
    """Highest IR version the given onnxruntime version loads (9 before 1.18)."""
    mm = _major_minor(version)
    best = 9
    for since, ir in _MAX_IR:
        if mm >= since:
            best = ir
    return best


_ORT_DISTRIBUTIONS = (
    "onnxruntime",
    "onnxruntime-gpu",
    "onnxruntime-directml",
    "onnxruntime-openvino",
    "onnxruntime-qnn",
    "onnxruntime-rocm",
    "onnxruntime-training",
    "onnxruntime-silicon",
    "onnxruntime-cann",
    "ort-nightly",
    "ort-nightly-gpu",
)
"""The distributions known to install the `onnxruntime` package."""


def installed_ort_version() -> str:
    """The installed onnxruntime's version: the module's where it is imported already; else the
    metadata's where exactly one of the distributions known to install it is installed and the
    package is there; else the module's, imported. Why not always import it: on a cached rerun
    nothing else needs onnxruntime, and its import was 0.08-0.2 s of it (the version only
    decides the IR version the packaged model declares)."""
    import sys

    module = sys.modules.get("onnxruntime")
    if module is None:
        try:
            import importlib.util
            from importlib import metadata

            found = set()
            for name in _ORT_DISTRIBUTIONS:
                try:
                    found.add(metadata.version(name))
                except metadata.PackageNotFoundError:
                    continue
            if len(found) == 1 and importlib.util.find_spec("onnxruntime") is not None:
                return found.pop()
        except Exception:  # noqa: BLE001 - broken metadata: the module says
            pass
        import onnxruntime as module  # noqa: PLC0415 - slow import, only when packaging
    return module.__version__


def installed_max_ir() -> int:
    return max_ir_for_ort(installed_ort_version())


def output_ir_version(input_ir: int, ort_version: str | None = None) -> int:
    """The IR version to write: the input's, clamped to [10, max the ORT accepts]."""
    ceiling = max_ir_for_ort(ort_version) if ort_version else installed_max_ir()
    return max(MIN_IR_FOR_OVERLOADS, min(int(input_ir), ceiling))
