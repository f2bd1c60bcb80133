"""The register path of a graph-defined kernel's online softmax: `register_path` decides whether
the analysis' candidate group (blockanalysis.register_candidate) still qualifies once its
matmuls are planned, and with which buffers and warp split.

Why its own module: the candidate is a fact of the graph, but whether mlso::FlashRows can run
it depends on the layout's matmul plans (every score term and P @ v on tensor cores, in P's
16-bit type, unscaled) and takes buffers of its own (split warps' partial scores, per-key
factors); the printer (blockpass/flash.py) reads the frozen `RegisterPath` only.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlso_cli.codegen.blockanalysis import Group, RegisterCandidate
from mlso_cli.codegen.blockmatmul import Operand, direct_operand, mma_ok
from mlso_cli.codegen.blockstorage import Draft, alloc
from mlso_cli.codegen.cfmt import numel
from mlso_cli.codegen.scoreform import ScoreForm
from mlso_cli.ir.node import Node
from mlso_cli.ir.ops import DType, Op


@dataclass(frozen=True)
class RegisterPath:
    """The online softmax of one group run in registers (mlso::FlashRows)."""

    group: Group
    form: ScoreForm
    """The score's form: scaled matmul terms, a per-key factor (scoreform.py)."""
    strips: int
    """16-row warp strips of the scores."""
    split: int
    """Warps per strip, splitting the value columns (blockanalysis.column_split)."""
    width: int
    """Value columns one warp holds."""
    ksplit: int
    """Warps per strip that also split the score's depth (partial scores meet in `red`)."""
    v: tuple[Operand, bool]
    """The weighted operand and whether it is k-major."""
    f: Node | None
    """A per-key factor of the weighted operand, put on P's columns (x * f read as x)."""
    fbuf: str | None
    kbuf: str | None
    """Shared-memory buffer of the scores' per-key factor."""
    red: str | None
    """Shared-memory buffer where split warps add partial scores."""
    alias: Node | None
    """The weighted sum kept in the loop tiles' memory (flushed after the loop)."""
    single: bool
    """One unscaled score term and no per-key factor: FlashRows::step (else step2)."""


def scaled_v(d: Draft, v: Node, dtype: DType) -> tuple[Operand, bool, Node] | None:
    """v = x * f with f one factor per key (row of v) and x a 16-bit tile in shared memory: the
    register pass then reads x as stored and puts f on P's columns (no staged copy of x * f)."""
    if v.op is not Op.MUL:
        return None
    keys = v.shape[-2]
    for x, f in (v.src, v.src[::-1]):
        if (
            x.shape != v.shape
            or f.shape[-1] != 1
            or len(f.shape) != len(v.shape)
            or numel(f.shape) != keys
        ):
            continue
        if f.shape[-2] != keys:
            continue
        op = direct_operand(d, x)
        if op is None or op.dtype != dtype:
            continue
        ok, kmajor = mma_ok(op, "B")
        if ok:
            return op, kmajor, f
    return None


def register_path(
    d: Draft, cand: RegisterCandidate, g: Group, alias: Node | None
) -> RegisterPath | None:
    """The register path of the candidate (g: its group as laid out, with P), or None when its
    plans do not allow it: every score term and P @ v on tensor cores in P's type, the terms
    not accumulating, 16-row aligned and unscaled. Allocates (in this order) the split warps'
    partial scores, the scores' per-key factors and the weighted operand's per-key factors."""
    plans = d.plans
    wp = plans.get(g.wsums[0])
    if wp is None or wp.kind != "mma":
        return None
    form = cand.form
    for t in form.terms:
        sp = plans.get(t)
        if not (
            sp is not None
            and sp.kind == "mma"
            and not sp.accumulate
            and sp.dtype == wp.dtype == g.p_dtype
            and sp.a.shape[-2] % 16 == 0
            and d.storage[t].scale is None
        ):
            return None
    sp = plans[form.terms[0]]
    keys = g.s.shape[-1]
    ksplit, red, kbuf, f, fbuf = 1, None, None, None, None
    split = cand.split
    if split > 1 and all(plans[t].a.shape[-1] % (16 * split) == 0 for t in form.terms):
        # warps sharing a strip split the score's depth too; partial scores meet in shared memory
        ksplit = split
        red = alloc(d, "float", d.names.new("ps"), cand.strips * split * 16 * keys * 4)
    if form.key_factor is not None:
        kbuf = alloc(d, "float", d.names.new("ks"), keys * 4)
    scaled = scaled_v(d, g.wsums[0].src[1], sp.dtype)
    if scaled is not None:
        f = scaled[2]
        fbuf = alloc(d, "float", d.names.new("vs"), keys * 4)
    single = len(form.terms) == 1 and form.scale == 1 and kbuf is None
    return RegisterPath(
        g,
        form,
        cand.strips,
        split,
        cand.width,
        ksplit,
        (wp.b, wp.b_kmajor),
        f,
        fbuf,
        kbuf,
        red,
        alias,
        single,
    )
