"""How `mlso::block_mma` deals one matmul's tensor-core work to a block's warps.

Why: code generation picks the strip width it instantiates the template with, and the search's
cost model prices the dependent mma.sync chains each warp then runs. Both read it here, and the
split and partial-sum rules mirror the template's `mma_ksplit` and `mma_ilp`
(kernels_templates/mlso_mma.cuh): change them together.
"""

from __future__ import annotations

from dataclasses import dataclass

MMA_M, MMA_N, MMA_K = 16, 8, 16
"""One mma.sync.m16n8k16."""
MMA_FLOPS = 2 * MMA_M * MMA_N * MMA_K


def _strips(batch: int, m: int, n: int, nb: int) -> int:
    """16 x 8*nb output strips of C(batch, m, n)."""
    return batch * -(-m // MMA_M) * (n // (MMA_N * nb))


def strip_width(batch: int, m: int, n: int, warps: int) -> int:
    """n8 tiles per warp strip (NB): the widest that still gives every warp a strip, else one."""
    cands = [nb for nb in (8, 4, 2, 1) if n % (MMA_N * nb) == 0]
    return next((nb for nb in cands if _strips(batch, m, n, nb) >= warps), cands[-1])


MIN_SLICE = 8
"""K-steps a slice of a split strip keeps at least (`MMA_MIN_SLICE`): adding a slice to C costs
a barrier, more than a shorter chain saves."""


def k_split(strips: int, warps: int, ksteps: int) -> int:
    """Warps that share one strip's K: a power of two dividing the k-steps, while every split
    strip still has a warp per slice and every slice MIN_SLICE k-steps (`mma_ksplit`)."""
    s = 1
    while strips * s * 2 <= warps and ksteps % (s * 2) == 0 and ksteps // (s * 2) >= MIN_SLICE:
        s *= 2
    return s


def partial_sums(nb: int, ksteps: int) -> int:
    """Independent partial sums per warp (`mma_ilp`): at most 8 accumulator tiles a thread."""
    if nb <= 2 and ksteps % 4 == 0:
        return 4
    return 2 if nb <= 4 and ksteps % 2 == 0 else 1


@dataclass(frozen=True)
class MmaWork:
    """One block_mma call: strips of 16 x 8*nb, each K shared by `ksplit` warps, each warp
    keeping `ilp` partial sums."""

    nb: int
    strips: int
    ksplit: int
    ilp: int
    chain_mmas: int
    """mma.sync a busy warp issues, in `ilp` * nb independent chains."""


def mma_work(batch: int, m: int, n: int, k: int, warps: int) -> MmaWork:
    """The work split of C(batch, m, n) += A(m, k) B(k, n) as block_mma runs it on `warps` warps
    (k a multiple of 16, n of 8: the template's shapes)."""
    nb = strip_width(batch, m, n, warps)
    strips = _strips(batch, m, n, nb)
    ksteps = -(-k // MMA_K)
    split = k_split(strips, warps, ksteps)
    ilp = partial_sums(nb, ksteps // split)
    per_warp = -(-strips // warps) if split == 1 else 1
    return MmaWork(nb, strips, split, ilp, per_warp * nb * (ksteps // split))
