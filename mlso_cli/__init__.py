"""mlso: a multi-level superoptimizer for ONNX models."""

from __future__ import annotations

__version__ = "0.1.0"
