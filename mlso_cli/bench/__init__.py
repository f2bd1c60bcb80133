"""Timing harness for `mlso bench`: ONNX Runtime on the CUDA EP with IOBinding, and region kernels."""
