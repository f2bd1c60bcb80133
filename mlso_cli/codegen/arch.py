"""What code generation knows of each GPU architecture it lays kernels out for.

Why its own module: the layout (blocklayout), the kernel printers and the architecture check
(budget.py) all read these figures, and none of them should import another to get a number.
"""

from __future__ import annotations

SMEM_BUDGET: dict[str, int] = {"sm_80": 163 * 1024, "sm_90": 227 * 1024}
"""Usable shared memory per block, by arch (with the opt-in limit raised by the launcher)."""
