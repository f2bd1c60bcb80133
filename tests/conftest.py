"""Shared test setup: repo root on sys.path (for `models`), the `gpu` marker skips cleanly, and
`slow` tests run only when asked for.

Why deselect rather than skip: `make test` (pytest -q tests) should run the fast suite without a
line of skip noise per slow test; `make test-slow` (pytest -m slow) runs them. Any -m expression
that names `slow` (including `not slow`) is left to pytest's own marker selection."""

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
    if "slow" not in (config.getoption("markexpr") or ""):
        slow = [item for item in items if item.get_closest_marker("slow") is not None]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if item.get_closest_marker("slow") is None]
    if any("gpu" in item.keywords for item in items) and not _have_gpu():
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU with PyCUDA")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
