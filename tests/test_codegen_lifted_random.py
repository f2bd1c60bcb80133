"""Random lifted (kernel-level) attention cores and norms through codegen: the row chains of
codegen/rowfuse.py and the grouped-head GEMMs of codegen/gqafold.py on shapes and spellings
nobody wrote by hand.

Why: tests/graphgen.py draws graph-defined kernels, what the search writes; a region's library
baseline is its lifted program, every op a kernel-level op, and real exports spell it in many
ways: repeat_kv over 1, 2 or 4 query heads per KV head, a scale multiplied or divided in before
or after a cast, a tanh softcap, a 0/1 mask multiplied into exp, rows shorter or longer than a
warp's stride, the output handed on as [seq, heads * d]; LayerNorm and RMSNorm read by a GEMM
or written out. Each draw is checked by the spec checker, lowered with library GEMMs on, run on
the host emulator and compared with the float64 interpreter within its dtype's tolerance, and
its plan is checked for the decisions the draw must get (a chained row kernel, a GEMM per KV
group). A few seeds run in `make test`; more under `-m slow`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from fractions import Fraction

import pytest

from mlso_cli.codegen import generate
from mlso_cli.codegen.plan import plan
from mlso_cli.codegen.rowfuse import ROW_LEN
from mlso_cli.ir import DType, KernelGraph, Op, check
from mlso_cli.ir import build as b
from tests import test_codegen_graphs as T
from tests.helpers import fresh_cache

F16, BF16, F32 = DType.F16, DType.BF16, DType.F32


@pytest.fixture(scope="module", autouse=True)
def _cache_dir(tmp_path_factory):
    with fresh_cache(tmp_path_factory):
        yield


@dataclass(frozen=True)
class Drawn:
    name: str
    kg: KernelGraph
    chain: bool
    """The draw must get a row kernel with two or more reductions."""
    group_rows: int
    """R > 1: the score GEMM must run per KV group with R * queries rows."""


def _repeated(x, r: int):
    _, g, s, d = x.shape
    five = b.broadcast_to(b.reshape(x, (1, g, 1, s, d)), (1, g, r, s, d))
    return b.reshape(five, (1, g * r, s, d))


def lifted_attention(rng: random.Random) -> Drawn:
    """softmax(scores) @ V as an exporter writes it, one spelling drawn per choice."""
    dt = rng.choice([F16, BF16, F32])
    kv, r = rng.choice([1, 2]), rng.choice([1, 2, 4])
    heads, s, n, d = (
        kv * r,
        rng.choice([4, 8, 12]),
        rng.choice([16, 32, 40, 64]),
        rng.choice([8, 16]),
    )
    tags = [dt.value, f"kv{kv}", f"r{r}", f"s{s}", f"n{n}", f"d{d}"]
    q = b.input_(0, (1, heads, s, d), dt)
    k, v = b.input_(1, (1, kv, n, d), dt), b.input_(2, (1, kv, n, d), dt)
    ins, names = [q, k, v], ["Q", "K", "V"]
    kk = _repeated(k, r) if r > 1 else k
    x = b.matmul(q, b.transpose(kk, (0, 1, 3, 2)))
    scale = Fraction(1, 4)
    where = rng.choice(["before_cast", "after_cast", "div", "none"])
    tags.append(f"scale_{where}")
    if where == "before_cast":
        x = b.mul(x, b.const(scale, dt))
    x = b.cast(x, F32)
    if where == "after_cast":
        x = b.mul(x, b.const(scale))
    elif where == "div":
        x = b.div(x, b.const(4))
    if rng.random() < 0.3:
        tags.append("softcap")
        x = b.mul(b.unary(Op.TANH, b.div(x, b.const(3))), b.const(3))
    e = b.unary(Op.EXP, x)
    if rng.random() < 0.5:
        tags.append("mask")
        ins.append(b.input_(3, (s, n), dt))
        names.append("mask")
        e = b.mul(e, b.cast(ins[-1], F32))
    p = b.cast(b.div(e, b.reduce(Op.REDUCE_SUM, e, 3)), dt)
    o = b.matmul(p, _repeated(v, r) if r > 1 else v)
    if rng.random() < 0.5:
        tags.append("heads_out")
        o = b.reshape(b.transpose(o, (0, 2, 1, 3)), (1, s, heads * d))
    kg = check(b.kernel_graph(ins, [o], names, ["O"]))
    chain = ROW_LEN[0] <= n <= ROW_LEN[1]
    return Drawn(f"attention[{','.join(tags)}]", kg, chain, r)


def lifted_norm(rng: random.Random) -> Drawn:
    """LayerNorm or RMSNorm over rows, written out or read by a library GEMM."""
    dt = rng.choice([F16, BF16, F32])
    rows, n = rng.choice([3, 8, 24]), rng.choice([32, 96, 600])
    kind, reader = rng.choice(["layer", "rms"]), rng.choice(["out", "gemm"])
    tags = [dt.value, f"rows{rows}", f"n{n}", kind, reader]
    x, w = b.input_(0, (rows, n), dt), b.input_(1, (n,), dt)
    xf = b.cast(x, F32)
    if kind == "layer":
        c = b.sub(xf, b.reduce(Op.REDUCE_MEAN, xf, 1))
        y = b.mul(
            c,
            b.unary(
                Op.RSQRT,
                b.add(b.reduce(Op.REDUCE_MEAN, b.mul(c, c), 1), b.const(Fraction(1, 10**5))),
            ),
        )
    else:
        ms = b.reduce(Op.REDUCE_MEAN, b.mul(xf, xf), 1)
        y = b.mul(xf, b.unary(Op.RSQRT, b.add(ms, b.const(Fraction(1, 10**6)))))
    y = b.cast(b.mul(y, b.cast(w, F32)), dt)
    ins, names = [x, w], ["x", "w"]
    if reader == "gemm":
        ins.append(b.input_(2, (n, 16), dt))
        names.append("W")
        y = b.matmul(y, ins[-1])
    kg = check(b.kernel_graph(ins, [y], names, ["y"]))
    return Drawn(f"norm[{','.join(tags)}]", kg, kind == "layer", 1)


def draws(seed: int, count: int) -> list[Drawn]:
    rng = random.Random(seed)
    makers = [lifted_attention, lifted_attention, lifted_norm]
    return [makers[i % len(makers)](rng) for i in range(count)]


def _check(drawn: Drawn) -> None:
    kinds = plan(drawn.kg).kernels
    rows = [k for k in kinds if k.kind == "row"]
    if drawn.chain:
        assert any(len(k.parts) >= 3 for k in rows), (drawn.name, [k.kind for k in kinds])
    if drawn.group_rows > 1:
        gemms = [x for x in generate(drawn.kg).plan["launches"] if x.get("kind") == "gemm"]
        q = drawn.kg.inputs[0].shape
        assert gemms[0]["m"] == drawn.group_rows * q[-2], drawn.name
    T.assert_emulated_matches(drawn.name.replace("[", "_").replace("]", ""), drawn.kg)


@pytest.mark.parametrize("drawn", draws(11, 6), ids=lambda d: d.name)
def test_random_lifted_programs_match_the_interpreter(drawn):
    _check(drawn)


@pytest.mark.slow
@pytest.mark.parametrize("drawn", draws(2026, 36), ids=lambda d: d.name)
def test_more_random_lifted_programs_match_the_interpreter(drawn):
    _check(drawn)
