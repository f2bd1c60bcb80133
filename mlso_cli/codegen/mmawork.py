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


ROUND_MMAS = 16
"""What one more round of strips costs a warp, in mma.sync of its chain: the strip's fragment
pipeline starts again, and its partial sums and accumulator update run again."""
SPLIT_MMAS = 8
"""What one more K slice costs, in mma.sync: a barrier and an accumulator update."""


def strip_width(batch: int, m: int, n: int, k: int, warps: int) -> int:
    """n8 tiles per warp strip (NB): the width whose busiest warp finishes first, counting its
    mma.sync (rounds of strips times NB times its K slice's k-steps), ROUND_MMAS per round and
    SPLIT_MMAS per extra K slice; on a tie, the narrower strip.

    Why rounds count: at equal mma counts, a warp that runs two strips one after the other pays
    each strip's fragment loads, partial sums and accumulator update twice, and the block waits
    for it. Measured on the H200 (benchmarks/RESULTS.md, ninth session), same program, only NB
    changed: rmsnorm_linear bs16's 16 x 96 x 256 step ran 39.0 us with NB = 1 (12 strips: two
    rounds on 8 warps), 34.2 with NB = 2 (6 strips, one round), 37.3 with NB = 4 (3 strips, K
    split in two); groupnorm_linear bs8 (16 x 32 x 512) 39.4, 40.6 and 42.3 with NB = 1, 2, 4
    (2, 4 and 4 K slices, the same mma count). The weights order both rows as measured."""
    ksteps = -(-k // MMA_K)

    def price(nb: int) -> int:
        strips = _strips(batch, m, n, nb)
        split = k_split(strips, warps, ksteps)
        rounds = -(-strips // warps) if split == 1 else 1
        return rounds * (nb * (ksteps // split) + ROUND_MMAS) + (split - 1) * SPLIT_MMAS

    return min((nb for nb in (1, 2, 4, 8) if n % (MMA_N * nb) == 0), key=price, default=1)


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
    nb = strip_width(batch, m, n, k, warps)
    strips = _strips(batch, m, n, nb)
    ksteps = -(-k // MMA_K)
    split = k_split(strips, warps, ksteps)
    ilp = partial_sums(nb, ksteps // split)
    per_warp = -(-strips // warps) if split == 1 else 1
    return MmaWork(nb, strips, split, ilp, per_warp * nb * (ksteps // split))
