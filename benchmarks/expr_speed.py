"""Cost of the search's pruning check (mlso_cli/search/expr.py), per tensor.

Why: the enumerator asks "is this candidate a subexpression of the target?" for every tensor it
builds, millions of times, so the check must stay in the microseconds. Three costs are reported
separately because the search pays them differently:
  - abstract: building a tensor's expression from its sources' (once per candidate node);
  - check, first: the first `admits` of a new expression (pattern key + lookup);
  - check, memo: `admits` of an expression already seen (the common case in a search that
    rebuilds the same subterms over and over: hash-consing makes them the same id).
Inputs: every kernel- and block-level tensor of every fixture (small and full shapes), then a
stream of random kernel-level candidates grown from each lifted region's inputs.

    python -m benchmarks.expr_speed [--random N] [--seed S]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from fractions import Fraction
from pathlib import Path

import onnx

from mlso_cli.frontend.lift import lift_model
from mlso_cli.ir import KernelGraph, Node, Op
from mlso_cli.ir import build as b
from mlso_cli.ir.shapes import ShapeError
from mlso_cli.search import terms as T
from mlso_cli.search.expr import ExprError, Target, abstract, abstract_graph
from models.build_models import SPECS
from tests.fixtures.ugraphs import FIXTURES, SMALL_FIXTURES

ROOT = Path(__file__).resolve().parent.parent
_clock = time.process_time
"""CPU time of this process: the machines this runs on are shared, and wall time there measures
the neighbours' load as much as the check."""


def _us(seconds: float, n: int) -> float:
    return 1e6 * seconds / max(n, 1)


def lifted(key: str, tmp: Path) -> KernelGraph:
    if "_bs" not in key:
        (kg,) = lift_model(str(ROOT / "models" / "small" / f"{key}.onnx"))
        return kg
    name, bs = key.rsplit("_bs", 1)
    path = ROOT / "models" / "bench" / f"{key}.onnx"
    if not path.exists():
        path = tmp / f"{key}.onnx"
        onnx.save(SPECS[name].build(int(bs), "float16"), str(path))
    (kg,) = lift_model(str(path))
    return kg


def fixture_row(key: str, fx: KernelGraph, target_kg: KernelGraph) -> dict[str, float]:
    t0 = _clock()
    target = Target.from_graph(target_kg)
    t1 = _clock()
    seen: list = []
    abstract_graph(fx, observe=lambda n, e: seen.append(e))
    t2 = _clock()
    ok = sum(target.admits(e) for e in seen)
    t3 = _clock()
    reps = 20
    for _ in range(reps):
        for e in seen:
            target.admits(e)
    t4 = _clock()
    return {
        "key": key,
        "tensors": len(seen),
        "admitted": ok,
        "patterns": target.size(),
        "build_ms": 1e3 * (t1 - t0),
        "abstract_us": _us(t2 - t1, len(seen)),
        "first_us": _us(t3 - t2, len(seen)),
        "memo_us": _us(t4 - t3, reps * len(seen)),
    }


# ---- random candidates -------------------------------------------------------------------------

_UNARY = (Op.EXP, Op.SQUARE, Op.RSQRT, Op.NEG, Op.SILU, Op.RECIPROCAL)
_BINARY = (Op.ADD, Op.SUB, Op.MUL, Op.DIV)


def _grow(rng: random.Random, pool: list[Node], consts: list[Node]) -> Node | None:
    kind = rng.choice(("unary", "binary", "binary", "matmul", "reduce", "transpose", "const"))
    a = rng.choice(pool)
    try:
        if kind == "unary":
            return b.unary(rng.choice(_UNARY), a)
        if kind == "binary":
            return b.binary(rng.choice(_BINARY), a, rng.choice(pool))
        if kind == "matmul":
            fits = [
                x for x in pool if len(x.shape) == len(a.shape) >= 2 and x.shape[-2] == a.shape[-1]
            ]
            return b.matmul(a, rng.choice(fits)) if fits else None
        if kind == "reduce":
            axes = [i for i, n in enumerate(a.shape) if n > 1]
            return b.reduce(Op.REDUCE_SUM, a, rng.choice(axes)) if axes else None
        if kind == "transpose" and len(a.shape) >= 2:
            perm = list(range(len(a.shape)))
            perm[-1], perm[-2] = perm[-2], perm[-1]
            return b.transpose(a, tuple(perm))
        if kind == "const" and consts:
            return b.mul(a, rng.choice(consts))
    except (ShapeError, AssertionError):
        return None
    return None


def random_row(key: str, target_kg: KernelGraph, count: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    target = Target.from_graph(target_kg)
    consts = [n for n in target_kg.nodes() if n.op is Op.CONST] + [b.const(Fraction(1, 2))]
    env: dict[Node, object] = {}
    for n in list(target_kg.inputs) + consts:
        env[n] = abstract(n, env)
    pool = list(target_kg.inputs)
    made: list[Node] = []
    t_abs = t_first = 0.0
    admitted = skipped = 0
    while len(made) < count:
        n = _grow(rng, pool, consts)
        if n is None or n in env:
            continue
        t0 = _clock()
        try:
            env[n] = abstract(n, env)
        except ExprError:
            skipped += 1
            continue
        if T.is_constant(env[n].poly):  # x - x, sums of constants: not a candidate worth timing
            skipped += 1
            continue
        t1 = _clock()
        ok = target.admits(env[n])
        t2 = _clock()
        t_abs += t1 - t0
        t_first += t2 - t1
        made.append(n)
        admitted += ok
        if ok or rng.random() < 0.1:  # grow from survivors, and a few losers to vary the stream
            pool.append(n)
    t3 = _clock()
    for n in made:
        target.admits(env[n])
    t4 = _clock()
    return {
        "key": key,
        "tensors": len(made),
        "admitted": admitted,
        "patterns": target.size(),
        "build_ms": 0.0,
        "abstract_us": _us(t_abs, len(made)),
        "first_us": _us(t_first, len(made)),
        "memo_us": _us(t4 - t3, len(made)),
        "skipped": skipped,
    }


def _table(title: str, rows: list[dict[str, float]]) -> None:
    print(f"\n{title}")
    print(
        f"{'graph':24s} {'tensors':>7s} {'admit':>6s} {'patterns':>8s} {'build ms':>9s} "
        f"{'abstract us':>11s} {'check us':>9s} {'memo us':>8s}"
    )
    for r in rows:
        print(
            f"{r['key']:24s} {r['tensors']:7d} {r['admitted']:6d} {r['patterns']:8d} {r['build_ms']:9.1f} "
            f"{r['abstract_us']:11.1f} {r['first_us']:9.1f} {r['memo_us']:8.2f}"
        )
    for col in ("abstract_us", "first_us", "memo_us"):
        vals = [r[col] for r in rows]
        print(f"  {col}: median {statistics.median(vals):.2f}, max {max(vals):.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--random", type=int, default=2000, help="random candidates per small region")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fixture_rows = [
            fixture_row(k, SMALL_FIXTURES[k](), lifted(k, Path(tmp)))
            for k in sorted(SMALL_FIXTURES)
        ]
        fixture_rows += [
            fixture_row(k, FIXTURES[k](), lifted(k, Path(tmp))) for k in sorted(FIXTURES)
        ]
        _table(
            "fixture tensors (kernel and block level) against their lifted targets", fixture_rows
        )
        rand_rows = [
            random_row(k, lifted(k, Path(tmp)), args.random, args.seed)
            for k in sorted(SMALL_FIXTURES)
        ]
        _table(
            f"{args.random} random non-constant kernel-level candidates per region (seed {args.seed})",
            rand_rows,
        )


if __name__ == "__main__":
    main()
