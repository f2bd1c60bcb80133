"""What a graph-defined kernel must compute, decided from its block graph alone.

Why separate from layout and emission: these facts (which values are materialised in shared
memory, which accumulators share a running max, which matmul or reduction is fused into its
accumulator, which group may run in registers, the dependency order) depend on nothing but the
(normalised) graph, and both the shared-memory plan and the emitted code read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlso_cli.codegen import synthetic
from mlso_cli.codegen.cfmt import Names, numel
from mlso_cli.codegen.normalise import normalise
from mlso_cli.codegen.scale import Storage
from mlso_cli.codegen.schedule import schedule
from mlso_cli.codegen.scoreform import ScoreForm, score_form
from mlso_cli.codegen.stabilise import consumers_of, stabilisers
from mlso_cli.ir.graph import BlockGraph
from mlso_cli.ir.node import Node
from mlso_cli.ir.ops import ACCUMULATORS, REDUCE, DType, Op, Phase

BLOCK_THREADS = 256
"""Threads of a graph-defined kernel's block outside the register path."""
FLASH_COLUMNS = 128
"""Value columns one warp keeps in registers on the register path (16 x 128 fp32: 64 registers)."""
FLASH_WARPS = 8
"""Most warps in a register-path block: 8 x 32 threads at up to 255 registers fit one SM's file."""
DIRECT_PRE_BYTES = 32 * 1024
"""A PRE tile this large or larger that only PRE reductions read is read in place, from global
memory (`BlockAnalysis.direct`), instead of being copied into shared memory first."""
MOMENT_PHASES = frozenset({Phase.PRE})
"""Phases whose sum / centred-square-sum pairs are folded in one walk (`BlockAnalysis.moments`).
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


@dataclass
class Group:
    """ACC_EXP_* accumulators sharing one score tensor s, hence one running max."""

    s: Node
    m: Node
    sums: list[Node] = field(default_factory=list)
    wsums: list[Node] = field(default_factory=list)
    alpha: str = ""
    p: Storage | None = None
    p_dtype: DType = DType.F32


class BlockAnalysis:
    """The graph-only decisions of one block graph (normalise.normalise applied first)."""

    def __init__(self, bg: BlockGraph) -> None:
        self.bg: BlockGraph = normalise(bg)
        self.names = Names()
        self.nodes = self.bg.nodes()
        self.consumers = consumers_of(self.nodes)
        self.stab = stabilisers(self.nodes, self.consumers)
        self.iters = [n for n in self.nodes if n.op is Op.ITER]
        self.groups: dict[Node, Group] = {}
        for n in self.nodes:
            if n.op in (Op.ACC_EXP_SUM, Op.ACC_EXP_WSUM):
                g = self.groups.setdefault(
                    n.src[0], Group(n.src[0], synthetic.running_max(n.src[0]))
                )
                (g.sums if n.op is Op.ACC_EXP_SUM else g.wsums).append(n)
        self.group_of = {a: g for g in self.groups.values() for a in g.sums + g.wsums}
        self.fused: dict[Node, Node] = {}
        for n in self.nodes:
            if n.op is Op.ACC_SUM and n.src[0].op is Op.MATMUL and self.consumers[n.src[0]] == [n]:
                self.fused[n.src[0]] = n
        self.fused_reduce: dict[Node, Node] = {}
        for n in self.nodes:
            r = n.src[0] if n.op is Op.ACC_SUM else None
            if (
                r is not None
                and r.op in REDUCE
                and isinstance(r.arg, int)
                and self.consumers[r] == [n]
            ):
                self.fused_reduce[r] = n
        self.flash_form: ScoreForm | None = None
        self.flash_split = 1
        self.flash = self._flash_group()
        self.nt = 32 * self.flash_strips * self.flash_split if self.flash else BLOCK_THREADS
        self.nw = self.nt // 32
        self.materialised: set[Node] = set(self.iters) | set(self.stab.values())
        self.materialised |= {
            n
            for n in self.nodes
            if (n.op in REDUCE and n not in self.fused_reduce) or n.op in ACCUMULATORS
        }
        self.materialised |= {n for n in self.nodes if n.op is Op.MATMUL and n not in self.fused}
        self.materialised |= {g.m for g in self.groups.values()}
        self.order = self._schedule()
        self.loop_iters = [n for n in self.iters if n.phase is Phase.LOOP]
        self.direct: frozenset[Node] = self._direct_iters()
        self.moments: dict[Node, Moments] = self._moments()
        """Second reductions computed with their first in one walk (`blockpass.reduce.pass_moments`)."""
        self.moment_firsts: frozenset[Node] = frozenset(m.first for m in self.moments.values())

    def _direct_iters(self) -> frozenset[Node]:
        """PRE tiles read in place from global memory: at least DIRECT_PRE_BYTES, read only by
        PRE-phase reductions (through any elementwise chain), outside the register path.

        Why: a whole feed (a LayerNorm's rows, every block's statistics before a split-K loop)
        is read by one or two reductions before the loop and never again, yet a copy in shared
        memory held 128 of the 227 KB of layernorm_linear's batch-8 block, which left the weight
        tiles two 64-row stages. Read in place (16-byte loads that hit L2 from the second block
        on), it costs no shared memory, and the loop's pipeline gets that memory instead."""
        if self.flash is not None:
            return frozenset()
        readers: dict[Node, list[Node]] = {}
        for n in self.nodes:
            if (n in self.materialised and n.op is not Op.ITER) or n.op is Op.SAVE:
                for d in self._deps(n):
                    readers.setdefault(d, []).append(n)
        return frozenset(
            it
            for it in self.iters
            if it.phase is Phase.PRE
            and it.numel * it.dtype.itemsize >= DIRECT_PRE_BYTES
            and readers.get(it)
            and all(r.op in REDUCE and (r.phase or Phase.PRE) is Phase.PRE for r in readers[it])
        )

    def _moments(self) -> dict[Node, Moments]:
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
        pos = {n: i for i, n in enumerate(self.order)}
        firsts = {
            (n.src[0], n.arg): n
            for n in reversed(self.order)
            if self._plain_sum(n)
            and (n.phase or Phase.PRE) in MOMENT_PHASES
            and all(d.op is Op.ITER for d in self._leaves(n.src[0]))
        }
        out: dict[Node, Moments] = {}
        for r2 in self.order:
            if not self._plain_sum(r2):
                continue
            centred = self._centred(r2.src[0])
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
                or self._leaves(a) != [r1]
                or not pos[r1] < pos[r2]
                or any(r1 in self._deps(n) for n in self.order[pos[r1] + 1 : pos[r2]])
            ):
                continue
            out[r2] = Moments(r1, u, a)
        return out

    def _plain_sum(self, n: Node) -> bool:
        """A stored REDUCE_SUM over one axis, computed by its own pass (not fused into an
        accumulator, not a stabiliser)."""
        return (
            n.op is Op.REDUCE_SUM
            and isinstance(n.arg, int)
            and n in self.materialised
            and n not in self.fused_reduce
        )

    def _centred(self, x: Node) -> tuple[Node, Node] | None:
        """(u, a) when x = square(u - a) or (u - a) * (u - a), computed inline, u of x's shape."""
        if x in self.materialised or x in self.stab:
            return None
        squares = x.op is Op.SQUARE or (x.op is Op.MUL and x.src[0] == x.src[1])
        d = x.src[0]
        if not squares or d.op is not Op.SUB or d in self.materialised or d in self.stab:
            return None
        u, a = d.src
        return (u, a) if u.shape == d.shape else None

    def _leaves(self, x: Node) -> list[Node]:
        """The materialised values (and stabiliser maxima) x's inline evaluation reads (x itself
        when it is materialised)."""
        if x in self.materialised:
            return [x]
        return self._deps(x) + ([self.stab[x]] if x in self.stab else [])

    @property
    def flash_strips(self) -> int:
        """16-row warp strips of the register-path group's scores."""
        return self.flash.s.shape[-2] // 16

    @property
    def flash_width(self) -> int:
        """Value columns one register-path warp holds (V's width over `flash_split`)."""
        return self.flash.wsums[0].shape[-1] // self.flash_split

    def _flash_group(self) -> Group | None:
        """The group whose loop runs in registers (mlso::FlashRows), if one qualifies: s is a
        score form (scoreform.py: scaled matmuls, a per-key factor, two terms) used only by the group, one weighted sum over rows aligned with s,
        16-row warp strips (16 <= rows <= 128), at most 128 keys per step. Value columns beyond one
        warp's register tile (FLASH_COLUMNS) are split over warps that share a strip
        (`flash_split`), up to FLASH_WARPS warps in all."""
        found = []
        for g in self.groups.values():
            s = g.s
            form = score_form(s, self.consumers)
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
            if not all(c in g.sums or c in g.wsums for c in self.consumers[s]):
                continue
            found.append((g, form, split))
        if len(found) != 1:
            return None
        _, self.flash_form, self.flash_split = found[0]
        return found[0][0]

    def _deps(self, n: Node) -> list[Node]:
        """The materialised values (and stabiliser maxima) n's inline evaluation reads; each
        shared subexpression is walked once (a DAG of reused values is not a tree)."""
        out: list[Node] = []
        seen: set[Node] = set()

        def walk(s: Node) -> None:
            if s in seen:
                return
            seen.add(s)
            if s in self.materialised:
                out.append(s)
                return
            if s in self.stab:
                out.append(self.stab[s])
            for t in s.src:
                walk(t)

        for s in n.src:
            walk(s)
        return out

    def _schedule(self) -> list[Node]:
        return schedule(self.bg.outputs, self._deps)

    def _rows_aligned(self, g: Group) -> bool:
        rows = g.m.shape[:-1]
        return all(acc.shape[:-1] == rows for acc in g.wsums)
