"""Time the finite-field equivalence check on the benchmark programs (CPU).

Why: the check gates the search (DESIGN.md, "Speed of the check"). This measures one trial (draw a
field, random inputs, fingerprint both programs) and the full check to 2^-60, for each benchmark
of BENCHMARKS.md as an unfused reference against a fused block-graph candidate, at the benchmark
shapes and at reduced shapes (each dim cut 8-64x) that the search verifies structures at.

    .venv/bin/python benchmarks/verify_speed.py [--only gqa] [--full-only | --reduced-only]

Prints a markdown table.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlso_cli.ir.graph import KernelGraph  # noqa: E402
from mlso_cli.ir.ops import DType  # noqa: E402
from mlso_cli.verify.degree import analyse  # noqa: E402
from mlso_cli.verify.equivalence import check_equivalent, trial_bound  # noqa: E402
from mlso_cli.verify.field import Field  # noqa: E402
from mlso_cli.verify.fieldrun import run_field  # noqa: E402
from tests.fixtures import examples as ex  # noqa: E402

F16 = DType.F16
Pair = tuple[KernelGraph, KernelGraph]


def _cases() -> list[tuple[str, str, str, Callable[[], Pair]]]:
    """(name, size, shape text, builder) for full and reduced shapes."""
    out = []
    for bs in (1, 8, 16):
        g = 2 * bs
        out.append(
            (
                f"gqa bs{bs}",
                "full",
                f"Q({g},256,64) K({g},64,4096) V({g},4096,64); grid ({g},4,8) loop 8",
                lambda g=g: ex.gqa_pair(g, 256, 64, 4096, rows=4, splits=8, loop=8, dtype=F16),
            )
        )
        r = max(1, g // 8)
        out.append(
            (
                f"gqa bs{bs}",
                "reduced",
                f"Q({r},32,8) K({r},8,64) V({r},64,8); grid ({r},2,2) loop 2",
                lambda r=r: ex.gqa_pair(r, 32, 8, 64, rows=2, splits=2, loop=2, dtype=F16),
            )
        )
    for bs in (1, 8, 16):
        g = 2 * bs
        out.append(
            (
                f"rmsnorm_linear bs{bs}",
                "full",
                f"X({g},4096) W(4096,6144); grid 96 loop 64",
                lambda g=g: ex.rmsnorm_linear_pair(g, 4096, 6144, cols=96, loop=64, dtype=F16),
            )
        )
        r = max(1, g // 8)
        out.append(
            (
                f"rmsnorm_linear bs{bs}",
                "reduced",
                f"X({r},512) W(512,96); grid 3 loop 8",
                lambda r=r: ex.rmsnorm_linear_pair(r, 512, 96, cols=3, loop=8, dtype=F16),
            )
        )
    out.append(
        (
            "lora bs1",
            "full",
            "X(16,256) W(256,4096) A(256,16) B(16,4096); grid 64 loop 4",
            lambda: ex.lora_pair(16, 256, 4096, 16, cols=64, loop=4, dtype=F16),
        )
    )
    out.append(
        (
            "lora bs1",
            "reduced",
            "X(2,32) W(32,64) A(32,2) B(2,64); grid 2 loop 2",
            lambda: ex.lora_pair(2, 32, 64, 2, cols=2, loop=2, dtype=F16),
        )
    )
    out.append(
        (
            "gated_mlp bs1",
            "full",
            "X(8,4096) W1,W2(4096,4096); grid 64 loop 64",
            lambda: ex.gated_mlp_pair(8, 4096, 4096, cols=64, loop=64, dtype=F16),
        )
    )
    out.append(
        (
            "gated_mlp bs1",
            "reduced",
            "X(1,512) W1,W2(512,64); grid 2 loop 8",
            lambda: ex.gated_mlp_pair(1, 512, 64, cols=2, loop=8, dtype=F16),
        )
    )
    for bs in (1, 8, 16):
        out.append(
            (
                f"ntrans bs{bs}",
                "full",
                f"H,X,alpha({bs},4096); grid {bs}",
                lambda bs=bs: ex.ntrans_pair(bs, 4096, bs, dtype=F16),
            )
        )
        r = max(1, bs // 8)
        out.append(
            (
                f"ntrans bs{bs}",
                "reduced",
                f"H,X,alpha({r},512); grid {r}",
                lambda r=r: ex.ntrans_pair(r, 512, r, dtype=F16),
            )
        )
    return out


def one_trial(a: KernelGraph, c: KernelGraph, seed: int) -> tuple[float, float]:
    """Seconds for one trial (field draw, inputs, both fingerprints) and its per-trial bound."""
    rng = np.random.default_rng(seed)
    t = time.perf_counter()
    fld = Field.draw(rng)
    xs = [fld.random(n.shape, rng) for n in a.inputs]
    oa, oc = run_field(a, xs, fld), run_field(c, xs, fld)
    assert all(x.equal(y) for x, y in zip(oa, oc))
    return time.perf_counter() - t, trial_bound(analyse(a), analyse(c), fld)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="run benchmarks whose name contains this")
    ap.add_argument("--full-only", action="store_true")
    ap.add_argument("--reduced-only", action="store_true")
    args = ap.parse_args()
    print(
        "| benchmark | shapes | shape set | one trial (s) | per-trial bound | full check (s) | trials | bound |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, size, shapes, make in _cases():
        if (
            args.only not in name
            or (args.full_only and size != "full")
            or (args.reduced_only and size != "reduced")
        ):
            continue
        a, c = make()
        t1, eps = one_trial(a, c, seed=0)
        t = time.perf_counter()
        v = check_equivalent(a, c, seed=1)
        tf = time.perf_counter() - t
        assert v.equivalent, v.detail
        print(
            f"| {name} | {shapes} | {size} | {t1:.3f} | 2^{np.log2(eps):.1f} | {tf:.3f} | {v.trials} | "
            f"2^{np.log2(v.bound):.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
