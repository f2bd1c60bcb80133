"""The cost model ranks sizings of one structure as the H200 measured them.

tests/data/cost_ranking holds programs the search sized (`benchmarks/sizing_variants.py`) with
their measured times; each pair (faster, slower) must be estimated in that order. Why these: the
mla pairs are the loop-free 64- and 128-block programs that the model's former "no loop, one
block per SM: everything in series" rule priced 40-55% too high (`Hardware.noloop_serial`); the
layernorm pairs are the loop-4 program against a differently tiled and a longer-loop sizing,
which that rule's refit must not reorder.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlso_cli.ir import serialize
from mlso_cli.ir.spec import check
from mlso_cli.search.cost import program_cost

DATA = Path(__file__).resolve().parent / "data" / "cost_ranking"
MEASURED = json.loads((DATA / "measured.json").read_text())


def _cost(name: str) -> float:
    kg = serialize.loads((DATA / f"{name}.json").read_text())
    check(kg)
    return program_cost(kg).seconds


@pytest.mark.parametrize("faster,slower", MEASURED["pairs"])
def test_measured_order_is_the_estimated_order(faster, slower):
    us = MEASURED["us"]
    assert us[faster] < us[slower]  # the data itself
    assert _cost(faster) < _cost(slower), (
        f"{faster} measured {us[faster]} µs, {slower} {us[slower]} µs, "
        f"estimated {_cost(faster) * 1e6:.1f} and {_cost(slower) * 1e6:.1f}"
    )
