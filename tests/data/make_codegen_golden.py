"""Record (or check) sha256 of generated source and plans for every graph the tests build.

Why: code generation is being restructured (decide, then print) and must print byte-identical
source for every current program. This script is the safety net's recorder: it walks the test
graphs (tests/test_codegen_graphs.py GRAPHS, tests/fixtures/ugraphs FIXTURES and SMALL_FIXTURES,
tests/test_codegen_stabilise.py CASES, tests/test_libgemm.py GRAPHS, split-KV partials reduced by
kernel-level reductions (`combines`: the combine kept scaled or unscaled, a max over partials),
and seeded random graphs from tests/graphgen.py), and for each, with library GEMMs on and off, hashes
`generate(kg).source`, the launch plan `generate(kg).plan` and the lowering plan
`codegen.plan.plan(kg).to_json()`.

    python tests/data/make_codegen_golden.py          # rewrite tests/data/codegen_golden.json
    python tests/data/make_codegen_golden.py --check  # compare, print the differing names

tests/test_codegen_golden.py checks the same table.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GOLDEN = Path(__file__).with_name("codegen_golden.json")
RANDOM_SEED = 20261205
RANDOM_SMALL = 200
RANDOM_LARGE = 100


def graphs() -> Iterator[tuple[str, Callable]]:
    """(name, builder) for every graph in the table, in a fixed order."""
    from tests import graphgen
    from tests import test_codegen_graphs as T
    from tests import test_codegen_stabilise as S
    from tests import test_libgemm as L
    from tests.fixtures import ugraphs

    for k, f in T.GRAPHS.items():
        yield f"graph_{k}", f
    for k, f in ugraphs.FIXTURES.items():
        yield f"fixture_{k}", f
    for k, f in ugraphs.SMALL_FIXTURES.items():
        yield f"small_{k}", f
    for k, (f, dt) in S.CASES.items():
        yield f"stabilise_{k}", (lambda f=f, dt=dt: f(dt))
    for k, f in L.GRAPHS.items():
        yield f"libgemm_{k}", f
    for k, f in combines().items():
        yield f"combine_{k}", f
    for i, g in enumerate(graphgen.seeded(RANDOM_SEED, RANDOM_SMALL, small=True)):
        yield f"random_small_{i:03d}_{g.name}", (lambda kg=g.kg: kg)
    for i, g in enumerate(graphgen.seeded(RANDOM_SEED + 1, RANDOM_LARGE, small=False)):
        yield f"random_large_{i:03d}_{g.name}", (lambda kg=g.kg: kg)


def combines() -> dict[str, Callable]:
    """Split-KV attention partials reduced at kernel level (the partial axis longer than
    lower.INLINE_REDUCE_MAX_LEN, or a reduction that is an output): the combine whose result
    stays relative to the combined maxima (a scratch read by another kernel), the combine
    unscaled into an output, a max over partials (exact values), a mean of partials."""
    from fractions import Fraction

    from mlso_cli.ir import PARTIAL, DType, Op
    from mlso_cli.ir import build as b
    from tests import test_codegen_graphs as T

    def build(splits: int, n: int, kind: str, dt: DType):
        q, k, v = (
            b.input_(0, (2, 32, 16), dt),
            b.input_(1, (2, 16, n), dt),
            b.input_(2, (2, n, 16), dt),
        )
        blk = T._Blk((2, 2, splits), 2)
        bq, bk, bv = blk.it(q, (0, 1, None)), blk.it(k, (0, None, 2), 2), blk.it(v, (0, None, 1), 1)
        s = b.mul(b.matmul(bq, bk), b.const(Fraction(1, 4)))
        f32 = DType.F32
        num = b.save(b.accumulate(Op.ACC_EXP_WSUM, s, bv), 0, (0, 1, PARTIAL), f32)
        den = b.save(b.accumulate(Op.ACC_EXP_SUM, s), 1, (0, 1, PARTIAL), f32)
        pnum, pden = blk.launch([num, den])
        sn, sd = b.reduce(Op.REDUCE_SUM, pnum, 0), b.reduce(Op.REDUCE_SUM, pden, 0)
        outs = {
            "scaled": [b.div(sn, sd), sn],
            "unscaled": [sn],
            "max": [b.reduce(Op.REDUCE_MAX, pnum, 0)],
            "mean": [b.div(sn, sd), b.reduce(Op.REDUCE_MEAN, pden, 0)],
        }[kind]
        return b.kernel_graph([q, k, v], outs)

    return {
        f"{splits}_{kind}_{dt.value}": (lambda a=(splits, n, kind, dt): build(*a))
        for splits, n in ((128, 2048), (2, 128))
        for kind in ("scaled", "unscaled", "max", "mean")
        for dt in (DType.F16, DType.F32)
    }


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _canon(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def record(kg) -> dict[str, str]:
    """sha256 of source, launch plan and lowering plan, library GEMMs on ("lib") and off."""
    from mlso_cli import knobs
    from mlso_cli.codegen import generate
    from mlso_cli.codegen.plan import plan
    from tests.test_codegen_graphs import constants

    out: dict[str, str] = {}
    old = os.environ.get("MLSO_LIBRARY_GEMM")
    try:
        for tag, value in (("lib", "1"), ("nolib", "0")):
            os.environ["MLSO_LIBRARY_GEMM"] = value
            knobs.cache_clear()  # the knob is read once per process otherwise
            gp = generate(kg, constants=constants(kg))  # masks as the packager hands them
            out[f"{tag}_source"] = _sha(gp.source)
            out[f"{tag}_plan"] = _sha(_canon(gp.plan))
            out[f"{tag}_lowering"] = _sha(_canon(plan(kg).to_json()))
    finally:
        if old is None:
            os.environ.pop("MLSO_LIBRARY_GEMM", None)
        else:
            os.environ["MLSO_LIBRARY_GEMM"] = old
        knobs.cache_clear()
    return out


def table() -> dict[str, dict[str, str]]:
    return {name: record(build()) for name, build in graphs()}


def main(argv: list[str]) -> int:
    now = table()
    if "--check" in argv:
        want = json.loads(GOLDEN.read_text())
        bad = sorted(k for k in set(want) | set(now) if want.get(k) != now.get(k))
        for k in bad:
            print("differs:", k)
        print(f"{len(now) - len(bad)}/{len(now)} graphs identical")
        return 1 if bad else 0
    GOLDEN.write_text(json.dumps(now, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(now)} graphs to {GOLDEN}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
