"""Shared test setup: repo root on sys.path (for `models`), and the `gpu` marker skips cleanly."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _have_gpu() -> bool:
    try:
        import pycuda.driver as drv

        drv.init()
        return drv.Device.count() > 0
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if any("gpu" in item.keywords for item in items) and not _have_gpu():
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU with PyCUDA")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
