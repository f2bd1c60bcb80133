"""What a graph-defined kernel must compute, decided from its block graph alone: `analyse`.

Why separate from layout and emission: these facts (which values are materialised in shared
memory, which accumulators share a running max, which matmul or reduction is fused into its
accumulator, which group may run in registers, the dependency order) depend on nothing but the
(normalised) graph, and both the shared-memory plan and the emitted code read them. `analyse`
returns them as one frozen `Analysis`; the helpers below are functions of the graph and of the
facts decided before them, in the order `analyse` calls them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mlso_cli.codegen import synthetic
from mlso_cli.codegen.cfmt import numel
from mlso_cli.codegen.frozen import FrozenMap
from mlso_cli.codegen.normalise import normalise
from mlso_cli.codegen.schedule import schedule
from mlso_cli.codegen.scoreform import ScoreForm, score_form
from mlso_cli.codegen.stabilise import consumers_of, stabilisers
from mlso_cli.ir.graph import BlockGraph
from mlso_cli.ir.node import Node
from mlso_cli.ir.ops import ACCUMULATORS, REDUCE, DType, Op, Phase

if TYPE_CHECKING:
    from mlso_cli.codegen.blockstorage import SmemStorage

BLOCK_THREADS = 256
"""Threads of a graph-defined kernel's block outside the register path."""
FLASH_COLUMNS = 128
"""Value columns one warp keeps in registers on the register path (16 x 128 fp32: 64 registers)."""
FLASH_WARPS = 8
"""Most warps in a register-path block: 8 x 32 threads at up to 255 registers fit one SM's file."""
DIRECT_PRE_BYTES = 32 * 1024
"""A PRE tile this large or larger that only PRE reductions read is read in place, from global
memory (`Analysis.direct`), instead of being copied into shared memory first."""
MOMENT_PHASES = frozenset({Phase.PRE})
"""Phases whose sum / centred-square-sum pairs are folded in one walk (`Analysis.moments`).
PRE only: that is where the second walk was measured to cost (rows read from L2 by every
block). A LOOP pair (groupnorm_linear's group statistics) re-reads a shared-memory tile each
step; whether one walk pays there is not measured."""


def column_split(cols: int, strips: int) -> int | None:
    """Warps per 16-row strip so that each holds at most FLASH_COLUMNS value columns (a multiple
    of 8, the mma tile), or None when no split fits FLASH_WARPS warps."""
    for split in range(1, FLASH_WARPS // max(strips, 1) + 1):
        if cols % split == 0 and (cols // split) % 8 == 0 and cols // split <= FLASH_COLUMNS:
            return split
    return None


@dataclass(frozen=True)
class Moments:
    """A sum and the sum of squares about a centre derived from it, over the same values u:
    `first` = sum(u, axis); the second = sum((u - centre)^2, axis), centre an elementwise
    function of `first` alone, constant along the axis (e.g. the mean, first * 1/N)."""

    first: Node
    u: Node
    centre: Node


@dataclass(frozen=True)
class Group:
    """ACC_EXP_* accumulators sharing one score tensor s, hence one running max. The analysis
    leaves the buffers empty; the layout returns a copy with alpha and P (blocklayout.py)."""

    s: Node
    m: Node
    sums: tuple[Node, ...] = ()
    wsums: tuple[Node, ...] = ()
    alpha: str = ""
    """Shared-memory buffer of the per-row rescale factor exp(m - m')."""
    p: SmemStorage | None = None
    """P = exp(s - m'), staged for P @ v (unbacked on the register path)."""
    p_dtype: DType = DType.F32


@dataclass(frozen=True)
class RegisterCandidate:
    """The one group that may run its loop in registers (mlso::FlashRows), and how."""

    group: Group
    form: ScoreForm
    """The score's form: scaled matmul terms, a per-key factor (scoreform.py)."""
    split: int
    """Warps per 16-row strip, splitting the value columns (`column_split`)."""

    @property
    def strips(self) -> int:
        """16-row warp strips of the scores."""
        return self.group.s.shape[-2] // 16

    @property
    def width(self) -> int:
        """Value columns one warp holds (V's width over `split`)."""
        return self.group.wsums[0].shape[-1] // self.split

    @property
    def threads(self) -> int:
        return 32 * self.strips * self.split


@dataclass(frozen=True)
class Analysis:
    """The graph-only decisions of one block graph (normalise.normalise applied first)."""

    bg: BlockGraph
    nodes: tuple[Node, ...]
    consumers: FrozenMap[Node, tuple[Node, ...]]
    stab: FrozenMap[Node, Node]
    """Stabilised EXP -> the row max it is kept relative to."""
    iters: tuple[Node, ...]
    groups: FrozenMap[Node, Group]
    """Score s -> its online-softmax group."""
    group_of: FrozenMap[Node, Group]
    fused: FrozenMap[Node, Node]
    """MATMUL -> the ACC_SUM it is fused into."""
    fused_reduce: FrozenMap[Node, Node]
    """Reduction -> the ACC_SUM it is fused into."""
    register: RegisterCandidate | None
    """The register-path candidate (the layout may still fall back to shared memory)."""
    materialised: frozenset[Node]
    order: tuple[Node, ...]
    """Block nodes in dependency order (the passes' order)."""
    loop_iters: tuple[Node, ...]
    direct: frozenset[Node]
    """PRE tiles read in place from global memory (`direct_iters`)."""
    moments: FrozenMap[Node, Moments]
    """Second reductions computed with their first in one walk (`blockpass.reduce.pass_moments`)."""
    moment_firsts: frozenset[Node]

    @property
    def threads(self) -> int:
        """Threads per block: the register path's, else BLOCK_THREADS."""
        return self.register.threads if self.register is not None else BLOCK_THREADS

    def rows_aligned(self, g: Group) -> bool:
        """Whether g's weighted sums are row-aligned with its scores (one alpha per row)."""
        rows = g.m.shape[:-1]
        return all(acc.shape[:-1] == rows for acc in g.wsums)


def analyse(bg: BlockGraph) -> Analysis:
    """The graph-only decisions of `bg`, in dependency order of the decisions themselves."""
    bg = normalise(bg)
    nodes = tuple(bg.nodes())
    consumers = consumers_of(list(nodes))
    stab = stabilisers(list(nodes), consumers)
    iters = tuple(n for n in nodes if n.op is Op.ITER)
    groups = _groups(nodes)
    group_of = {a: g for g in groups.values() for a in g.sums + g.wsums}
    fused = {
        n.src[0]: n
        for n in nodes
        if n.op is Op.ACC_SUM and n.src[0].op is Op.MATMUL and consumers[n.src[0]] == [n]
    }
    fused_reduce = {
        n.src[0]: n
        for n in nodes
        if n.op is Op.ACC_SUM
        and n.src[0].op in REDUCE
        and isinstance(n.src[0].arg, int)
        and consumers[n.src[0]] == [n]
    }
    register = register_candidate(groups, consumers)
    materialised = frozenset(
        set(iters)
        | set(stab.values())
        | {n for n in nodes if (n.op in REDUCE and n not in fused_reduce) or n.op in ACCUMULATORS}
        | {n for n in nodes if n.op is Op.MATMUL and n not in fused}
        | {g.m for g in groups.values()}
    )
    order = tuple(schedule(bg.outputs, lambda n: deps(n, materialised, stab)))
    direct = frozenset() if register is not None else direct_iters(nodes, iters, materialised, stab)
    moments = find_moments(order, materialised, fused_reduce, stab)
    return Analysis(
        bg=bg,
        nodes=nodes,
        consumers=FrozenMap((n, tuple(cs)) for n, cs in consumers.items()),
        stab=FrozenMap(stab),
        iters=iters,
        groups=FrozenMap(groups),
        group_of=FrozenMap(group_of),
        fused=FrozenMap(fused),
        fused_reduce=FrozenMap(fused_reduce),
        register=register,
        materialised=materialised,
        order=order,
        loop_iters=tuple(n for n in iters if n.phase is Phase.LOOP),
        direct=direct,
        moments=FrozenMap(moments),
        moment_firsts=frozenset(m.first for m in moments.values()),
    )


BlockAnalysis = analyse
"""The name tests and older callers use: `BlockAnalysis(bg)` is `analyse(bg)`."""


def _groups(nodes: tuple[Node, ...]) -> dict[Node, Group]:
    """Score s -> the ACC_EXP_SUM / ACC_EXP_WSUM accumulators over it, in node order."""
    found: dict[Node, tuple[list[Node], list[Node]]] = {}
    for n in nodes:
        if n.op in (Op.ACC_EXP_SUM, Op.ACC_EXP_WSUM):
            sums, wsums = found.setdefault(n.src[0], ([], []))
            (sums if n.op is Op.ACC_EXP_SUM else wsums).append(n)
    return {
        s: Group(s, synthetic.running_max(s), tuple(sums), tuple(wsums))
        for s, (sums, wsums) in found.items()
    }


def register_candidate(
    groups: Mapping[Node, Group], consumers: Mapping[Node, list[Node]]
) -> RegisterCandidate | None:
    """The group whose loop runs in registers (mlso::FlashRows), if exactly one qualifies: s is
    a score form (scoreform.py: scaled matmuls, a per-key factor, two terms) used only by the
    group, one weighted sum over rows aligned with s, 16-row warp strips (16 <= rows <= 128), at
    most 128 keys per step. Value columns beyond one warp's register tile (FLASH_COLUMNS) are
    split over warps that share a strip (`column_split`), up to FLASH_WARPS warps in all."""
    found = []
    for g in groups.values():
        s = g.s
        form = score_form(s, consumers)
        if form is None or s.phase is not Phase.LOOP or len(g.wsums) != 1:
            continue
        if any(t.shape != s.shape for t in form.terms):
            continue
        w = g.wsums[0]
        rows, keys = s.shape[-2], s.shape[-1]
        if (
            numel(s.shape[:-2]) != 1
            or rows % 16
            or not 16 <= rows <= 128
            or keys % 16
            or keys > 128
        ):
            continue
        split = column_split(w.shape[-1], rows // 16)
        if split is None or w.shape[:-1] != g.m.shape[:-1] or w.src[1].phase is not Phase.LOOP:
            continue
        if not all(c in g.sums or c in g.wsums for c in consumers[s]):
            continue
        found.append(RegisterCandidate(g, form, split))
    return found[0] if len(found) == 1 else None


def deps(n: Node, materialised: frozenset[Node], stab: Mapping[Node, Node]) -> list[Node]:
    """The materialised values (and stabiliser maxima) n's inline evaluation reads; each
    shared subexpression is walked once (a DAG of reused values is not a tree)."""
    out: list[Node] = []
    seen: set[Node] = set()

    def walk(s: Node) -> None:
        if s in seen:
            return
        seen.add(s)
        if s in materialised:
            out.append(s)
            return
        if s in stab:
            out.append(stab[s])
        for t in s.src:
            walk(t)

    for s in n.src:
        walk(s)
    return out


def direct_iters(
    nodes: tuple[Node, ...],
    iters: tuple[Node, ...],
    materialised: frozenset[Node],
    stab: Mapping[Node, Node],
) -> frozenset[Node]:
    """PRE tiles read in place from global memory: at least DIRECT_PRE_BYTES, read only by
    PRE-phase reductions (through any elementwise chain); never on the register path (the
    caller's condition).

    Why: a whole feed (a LayerNorm's rows, every block's statistics before a split-K loop)
    is read by one or two reductions before the loop and never again, yet a copy in shared
    memory held 128 of the 227 KB of layernorm_linear's batch-8 block, which left the weight
    tiles two 64-row stages. Read in place (16-byte loads that hit L2 from the second block
    on), it costs no shared memory, and the loop's pipeline gets that memory instead."""
    readers: dict[Node, list[Node]] = {}
    for n in nodes:
        if (n in materialised and n.op is not Op.ITER) or n.op is Op.SAVE:
            for d in deps(n, materialised, stab):
                readers.setdefault(d, []).append(n)
    return frozenset(
        it
        for it in iters
        if it.phase is Phase.PRE
        and it.numel * it.dtype.itemsize >= DIRECT_PRE_BYTES
        and readers.get(it)
        and all(r.op in REDUCE and (r.phase or Phase.PRE) is Phase.PRE for r in readers[it])
    )


def find_moments(
    order: tuple[Node, ...],
    materialised: frozenset[Node],
    fused_reduce: Mapping[Node, Node],
    stab: Mapping[Node, Node],
) -> dict[Node, Moments]:
    """Pairs r1 = sum(u), r2 = sum((u - a)^2) over the same axis and phase, a a function of
    r1 alone (keepdims shape, so constant along the axis), computed in one walk over u:
    with a shift K (the row's first element) it folds r1, S1 = sum(u - K) and
    S2 = sum((u - K)^2), then r2 = S2 - 2 (a - K) S1 + N (a - K)^2, which is exact for any
    a (`blockpass.reduce.pass_moments`).

    Why: a LayerNorm's mean and variance read the rows twice, the second walk only after
    the first one's result. In layernorm_linear's batch-8 kernel every one of 128 blocks
    read its 16 x 4096 rows (128 KB, from L2) twice; the two passes cost 4.2 of the
    kernel's 20 µs on the H200. One walk reads them once.

    Only where both are stored, unfused, unscaled sums of a phase in MOMENT_PHASES (u reads
    ITER tiles only, through elementwise ops and views), and no node scheduled between them
    reads r1: r1 is then written where r2 is."""

    def plain_sum(n: Node) -> bool:
        # a stored REDUCE_SUM over one axis, computed by its own pass (not fused, no stabiliser)
        return (
            n.op is Op.REDUCE_SUM
            and isinstance(n.arg, int)
            and n in materialised
            and n not in fused_reduce
        )

    def leaves(x: Node) -> list[Node]:
        # the materialised values (and maxima) x's inline evaluation reads (x if materialised)
        if x in materialised:
            return [x]
        return deps(x, materialised, stab) + ([stab[x]] if x in stab else [])

    pos = {n: i for i, n in enumerate(order)}
    firsts = {
        (n.src[0], n.arg): n
        for n in reversed(order)
        if plain_sum(n)
        and (n.phase or Phase.PRE) in MOMENT_PHASES
        and all(d.op is Op.ITER for d in leaves(n.src[0]))
    }
    out: dict[Node, Moments] = {}
    for r2 in order:
        if not plain_sum(r2):
            continue
        centred = _centred(r2.src[0], materialised, stab)
        if centred is None or (centred[0], r2.arg) not in firsts:
            continue
        u, a = centred
        r1 = firsts[u, r2.arg]
        if (
            r1 in out
            or r1 in (m.first for m in out.values())
            or r1.shape != r2.shape
            or (r1.phase or Phase.PRE) is not (r2.phase or Phase.PRE)
            or a.shape != r1.shape
            or leaves(a) != [r1]
            or not pos[r1] < pos[r2]
            or any(r1 in deps(n, materialised, stab) for n in order[pos[r1] + 1 : pos[r2]])
        ):
            continue
        out[r2] = Moments(r1, u, a)
    return out


def _centred(
    x: Node, materialised: frozenset[Node], stab: Mapping[Node, Node]
) -> tuple[Node, Node] | None:
    """(u, a) when x = square(u - a) or (u - a) * (u - a), computed inline, u of x's shape."""
    if x in materialised or x in stab:
        return None
    squares = x.op is Op.SQUARE or (x.op is Op.MUL and x.src[0] == x.src[1])
    d = x.src[0]
    if not squares or d.op is not Op.SUB or d in materialised or d in stab:
        return None
    u, a = d.src
    return (u, a) if u.shape == d.shape else None
