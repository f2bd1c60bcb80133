"""`BlockBuilder` with an arch's shared-memory budget: ir.builder.BlockBuilder, whose ops also
answer to code generation's layout.

Why here: the search and the test generators want an op refused the moment its block would not
fit, but the byte count is code generation's (blocklayout.smem_layout), and ir/ imports nothing
from codegen. This subclass fills the IR builder's two hooks: `_admit` (refuse an op over budget)
and `_block_extra` (the layout and budget problems of the finished graph, codegen.budget).

Shared memory: `smem()` is the byte count budget.block_smem reports (the one code generation
allocates, blocklayout.smem_layout). A graph being built has open values, which nothing reads
and no SAVE writes yet. Each open pre- or post-loop value gets a temporary fp32 SAVE so that the
layout can be computed; an open loop tile (ITER) is costed through a loop sum of its row sums (a
small accumulator: code generation fuses the row sum into it); any other open loop value is not
costed until an accumulator reads it, because its storage depends on the accumulator (a score
that the online softmax keeps in registers takes no shared memory). Once every value reaches a
SAVE the figure is block_smem of the finished graph, exactly. With `budget=True` an op whose
figure would exceed the arch's budget is refused. A figure before that point can exceed the
finished one (an open value stored for its temporary SAVE that the finished graph fuses), so
the search, whose recipes are judged whole, builds with budget=False: then `finish` leaves the
budget out too (a structure checked at reduced shapes is sized later, and budget.check holds
each sized instance to the budget); the layout must still be plannable. Figures are computed
only when asked or checked, cached per set of roots (and smem_layout caches per block graph).
"""

from __future__ import annotations

from collections.abc import Sequence

from mlso_cli.codegen import budget as arch_check
from mlso_cli.codegen.arch import SMEM_BUDGET
from mlso_cli.codegen.errors import CodegenError
from mlso_cli.ir import build as b
from mlso_cli.ir import builder
from mlso_cli.ir.builder import SPEC_RULES, BuildError
from mlso_cli.ir.graph import PARTIAL, BlockGraph, InputMap, OutputMap
from mlso_cli.ir.node import Node
from mlso_cli.ir.ops import DType, Op, Phase

__all__ = ["SPEC_RULES", "BlockBuilder", "BuildError"]


class BlockBuilder(builder.BlockBuilder):
    """One block graph under construction over kernel tensors `srcs` read through `inputs`,
    held to the IR's rules and to `arch`'s shared memory (with `budget`)."""

    def __init__(
        self,
        grid: Sequence[int],
        loop: int,
        inputs: Sequence[InputMap],
        srcs: Sequence[Node],
        arch: str = "sm_90",
        *,
        budget: bool = True,
    ) -> None:
        if arch not in SMEM_BUDGET:
            raise BuildError(f"block graph: unknown arch {arch}; known: {sorted(SMEM_BUDGET)}")
        super().__init__(grid, loop, inputs, srcs)
        self.arch = arch
        self.budget = budget
        self._smem: dict[tuple[Node, ...], int] = {}

    def smem(self) -> int:
        """Bytes of shared memory the graph built so far needs (see the module docstring)."""
        if self._done is not None:
            return arch_check.block_smem(self._done, self.srcs, self.arch)
        return self._figure("smem", self._roots(None))

    # ---- the IR builder's hooks -------------------------------------------------------------

    def _admit(self, name: str, node: Node) -> None:
        if self.budget and node.op is not Op.CONST and node not in self._nodes:
            need = self._figure(name, self._roots(node))
            if need > SMEM_BUDGET[self.arch]:
                raise BuildError(
                    f"{name}: the block would need {need} bytes of shared memory; "
                    f"{self.arch} has {SMEM_BUDGET[self.arch]}"
                )

    def _block_extra(self, bg: BlockGraph, srcs: tuple[Node, ...]) -> list[str]:
        return arch_check.layout_problems(bg, self.arch, self.budget)

    # ---- figures ----------------------------------------------------------------------------

    def _roots(self, extra: Node | None) -> tuple[Node, ...]:
        """The SAVEs so far, then every open value (no op reads it, no SAVE writes it),
        as if `extra` had been added."""
        saves = list(self._saves)
        nodes = list(self._nodes)
        used = self._used
        if extra is not None:
            used = used | set(extra.src)
            if extra.op is Op.SAVE:
                saves.append(extra)
            elif extra not in self._nodes:
                nodes.append(extra)
        return tuple(saves) + tuple(n for n in nodes if n not in used and n.op is not Op.CONST)

    def _figure(self, name: str, roots: tuple[Node, ...]) -> int:
        hit = self._smem.get(roots)
        if hit is not None:
            return hit
        saves = [r for r in roots if r.op is Op.SAVE]
        omap = builder.pad3([PARTIAL if g > 1 else None for g in self.grid], None)
        for r in roots[len(saves) :]:
            x = r
            if r.phase is Phase.LOOP:
                if r.op is not Op.ITER:
                    continue  # costed once an accumulator reads it: how depends on the accumulator
                x = b.accumulate(Op.ACC_SUM, b.reduce(Op.REDUCE_SUM, r, -1) if r.shape else r)
            saves.append(
                Node(Op.SAVE, (x,), OutputMap(len(saves), omap), x.shape, DType.F32, x.phase)
            )
        bg = b.block_graph(self.grid, self.loop, self.inputs, saves)
        try:
            need = arch_check.block_smem(bg, self.srcs, self.arch)
        except CodegenError as exc:
            raise BuildError(
                f"{name}: code generation cannot lay this block graph out: {exc}"
            ) from exc
        self._smem[roots] = need
        return need
