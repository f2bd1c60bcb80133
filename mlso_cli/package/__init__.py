"""Pipeline step 7, package: fused regions become ai.mlso::MlsoKernel nodes with a fallback body.

package_model(model, regions, metadata)     -> a new onnx.ModelProto
write_model_atomic(model, out, input_path=) -> writes it (temp file + rename, never the input)
regions_in(model)                           -> the MlsoKernel nodes of a packaged model
check_input_shapes(model, shapes, source)   -> UsageError unless the shapes are those it was made for
"""

from __future__ import annotations

from mlso_cli.package.irversion import max_ir_for_ort, output_ir_version
from mlso_cli.package.rewrite import (
    META_BOUND,
    META_EXECUTABLE,
    META_MODEL_CHECK,
    META_SEED,
    META_SERVE,
    META_TARGETS,
    META_VERSION,
    PackagedRegion,
    package_model,
    standard_metadata,
)
from mlso_cli.package.shapes import (
    META_INPUT_SHAPES,
    check_input_shapes,
    recorded_input_shapes,
)
from mlso_cli.package.unpack import RegionView, regions_in
from mlso_cli.package.write import write_model_atomic

__all__ = [
    "META_BOUND",
    "META_EXECUTABLE",
    "META_INPUT_SHAPES",
    "META_MODEL_CHECK",
    "META_SEED",
    "META_SERVE",
    "META_TARGETS",
    "META_VERSION",
    "PackagedRegion",
    "RegionView",
    "check_input_shapes",
    "max_ir_for_ort",
    "output_ir_version",
    "package_model",
    "recorded_input_shapes",
    "regions_in",
    "standard_metadata",
    "write_model_atomic",
]
