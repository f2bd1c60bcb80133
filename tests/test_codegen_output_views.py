"""A graph-defined kernel saves through the transposes and reshapes of a region output.

Why: a fused attention core computes [heads, seq, d] tiles and the model hands on
[seq, heads * d]. Before, that output went out through a copy kernel (one more launch and a round
trip through memory), so a partition that puts the views with the core gained nothing.
"""

from __future__ import annotations

import numpy as np

from mlso_cli.codegen import generate, hostemu
from mlso_cli.codegen.roots import kernel_roots
from mlso_cli.ir import KernelGraph, Op, check
from mlso_cli.ir import build as b
from tests.test_codegen_graphs import F16, flash_relaid
from tests.test_codegen_properties import emu_cache, mismatch

__all__ = ["emu_cache"]  # the fixture, imported for pytest

G, M, D = 2, 32, 16


def _relaid(extra_output: bool = False) -> KernelGraph:
    """flash attention over G heads, handed on as [M, G * D] (and as it is, if extra_output)."""
    kg = flash_relaid(F16, g=G, m=M, d=D)
    if extra_output:
        (viewed,) = kg.outputs
        o = viewed.src[0].src[0]
        kg = b.kernel_graph(list(kg.inputs), [viewed, o], list(kg.input_names), ["O2", "O"])
    check(kg)
    return kg


def _inputs(kg: KernelGraph) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.uniform(-1, 1, n.shape).astype(np.float32) for n in kg.inputs]


def test_the_kernel_saves_through_the_views_with_their_strides(emu_cache):
    kg = _relaid()
    kr = kernel_roots(kg)
    ((proj, strides),) = kr.target_strides.items()
    assert proj.op is Op.PROJ and proj.shape == (G, M, D)
    # head h, row m, column d of the tile lands at m * (G * D) + h * D + d of the output
    assert strides == (D, G * D, 1)
    gp = generate(kg)
    assert len(gp.kernels) == 1, [k.name for k in gp.kernels]
    ins = _inputs(kg)
    why = mismatch(kg, ins, hostemu.run(gp, ins))
    assert why is None, why


def test_a_value_also_handed_on_as_it_is_still_goes_out_through_a_copy(emu_cache):
    kg = _relaid(extra_output=True)
    assert not kernel_roots(kg).target_strides
    gp = generate(kg)
    # the kernel saves to scratch; then one launch writes the views and copies the value out
    # (two sibling elementwise kernels, siblings.launch_groups)
    assert len(gp.kernels) == 2
    ins = _inputs(kg)
    why = mismatch(kg, ins, hostemu.run(gp, ins))
    assert why is None, why
