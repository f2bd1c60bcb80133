"""An analytic cost model: DRAM bytes, FLOPs on the right unit, and kernel launches.

It ranks candidates and decides the never-slower rule when no GPU is there to measure. The
numbers are the H200's, measured (docs/benchmarks.md): 4.3 TB/s device copy, 790 TFLOP/s
bf16/fp16 on tensor cores; fp32 SIMT and launch latency are estimates.

Calibration (measured, or fitted to measurements) (benchmarks/RESULTS.md, "optimize --gpu"):
- ONNX Runtime pays about 6 µs per node in a `run` call (ntrans: 15 nodes, 86-107 µs measured).
- Every kernel pays at least one DRAM round trip (`pre_latency_s`) on top of its launch, and
  a kernel-level matmul one more per K-step, as a graph-defined kernel's loop does; so the
  model compares a chain of small kernels with one fused kernel by the same rules.
- Graph-defined kernels (fitted to 47 programs timed on the H200 on 2026-12-01: the 25 fixtures
  and the searched programs of each calibration; benchmarks/RESULTS.md, "cost model
  calibration"): DRAM bandwidth scales with the SMs a grid occupies; a loop step costs at least
  `step_latency_s`, or the block's share of bandwidth and of its SM's tensor cores at
  `mma_efficiency` (and at most `warp_flops` per warp), plus `smem_step_s` where its values pass
  through shared memory (all but the register-path online softmax); tiles codegen copies element
  by element pay a 16-byte transaction per element. Geometric RMS error 1.37x over the 47; the
  worst is a multi-kernel split combine (mla_bs1's 4-launch program: 12.7 µs modelled, 32 µs
  measured).
- A register-path kernel's loop-phase reductions (qknorm's per-key norm of K) are shared-memory
  passes in series with its register step: each adds `loop_pass_s` to the step's dependent chain
  (fitted 2026-12-02 after qknorm_gqa's 32-step batch-8 program ran 1.50x its fixture).
- With one resident block per SM, a loop step's tile loads and mma chain overlap only in part:
  `chain_exposed` of the shorter is added to the step (fitted 2026-12-02 after a layernorm
  program with a second matmul per step ran 1.36x the one-matmul program the model priced
  the same).
- Refit of 2026-12-03 (seventh session; benchmarks/RESULTS.md): 158 programs timed on the
  current code generator (25 fixtures, 31 searched programs, 102 sizing variants of 8 rows),
  scored by `benchmarks/cost_fit.py` on each row's regret (the measured time of the model's
  first pick over the row's fastest). A split combine now pays for reading its partials (they
  were not counted, so 32 splits cost what 16 did); `step_fixed_s` and `fill_exposed` are new;
  `mma_efficiency`, `warp_flops` and `chain_exposed` refitted. Worst regret 1.29 -> 1.11, pairs
  ranked the wrong way 287 -> 144 of 1047.
- Code generation's stand-alone kernel-level matmul (the lifted, unfused programs use it) reaches
  about 5% of DRAM bandwidth and 3.2 TFLOP/s on the benchmark shapes (rmsnorm_linear's lifted
  program: 246 / 349 / 499 µs at bs 1 / 8 / 16). Without these the model called those programs
  1.8x faster than ONNX Runtime where they are 4-7x slower, and the never-slower rule broke.
- Since library GEMMs (codegen/libgemm.py), a kernel-level matmul whose dtypes cuBLASLt takes
  is a library call, priced by `library_gemm_s` (the `library_*` constants below: estimates
  until calibrated on the H200), plus one elementwise kernel per operand codegen must stage.
  A bias or residual the GEMM adds as its epilogue is priced as part of that call: no pass of
  its own.
  The codegen matmul rates above still price the matmuls that stay generated.
- Independent elementwise kernels that codegen computes in one launch (codegen/siblings.py) are
  priced as one kernel: one launch and one round trip for the parts' bytes and element work,
  a tensor several parts read counted once.
- A row reduction computed in its row-wise reader's kernel (codegen/rowfuse.py) is one launch
  with two round trips (the row's loads, then the value's), the reduced value read from no
  memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import onnx

from mlso_cli.codegen.mmawork import MMA_FLOPS, MMA_K, MMA_M, MMA_N, mma_work
from mlso_cli.frontend.load import LoadedModel
from mlso_cli.frontend.partition import Region
from mlso_cli.frontend.report import _FREE_VIEWS, _nbytes, node_flops
from mlso_cli.ir import DType, KernelGraph, Node, Op, Phase
from mlso_cli.ir.ops import REDUCE, VIEW
from mlso_cli.ir.spec import tile_shape


@dataclass(frozen=True)
class Hardware:
    dram_bytes_per_s: float = 4.3e12
    tensor_flops: float = 790e12
    simt_flops: float = 60e12
    launch_s: float = 3.0e-6
    sms: int = 132
    ort_node_s: float = 6.0e-6
    """ONNX Runtime's cost per node in a run call (launch, allocation, dispatch), measured."""
    codegen_matmul_bw_fraction: float = 0.05
    codegen_matmul_flops: float = 3.2e12
    """Measured rates of codegen's kernel-level matmul (graph-defined kernels are not affected)."""
    library_tensor_flops: float = 650e12
    """cuBLASLt fp16/bf16 GEMM throughput (estimate, about 80% of the H200's dense peak)."""
    library_fp32_flops: float = 50e12
    """cuBLASLt fp32 GEMM throughput without TF32 (estimate)."""
    library_bytes_per_s: float = 4.0e12
    """DRAM bandwidth a library GEMM reaches (estimate)."""
    library_call_s: float = 4.0e-6
    """Fixed cost of one library GEMM call: launch, tail, and the small-tile inefficiency of a
    skinny GEMM (estimate; calibrate on the H200)."""
    smem_per_sm: int = 228 * 1024
    threads_per_sm: int = 2048
    step_latency_s: float = 0.6e-6
    """A for-loop step of a graph-defined kernel cannot take less: the tile's DRAM round trip
    with double buffering (fitted, benchmarks/RESULTS.md "cost model calibration")."""
    smem_step_s: float = 0.5e-6
    """What a loop step adds, on top of its transfer or compute time, when its values go through
    shared memory rather than staying in registers (every graph-defined kernel but the register-path online softmax): the staging,
    barriers and fp32 round trips of codegen's shared-memory passes (fitted, as above)."""
    fill_exposed: float = 1.0
    """Share of one step's shorter part (its tile loads, or its compute) that a kernel pays once
    per wave to fill its pipeline: the first stage's loads overlap nothing, and a loop-free
    kernel loads everything before it computes (fitted, 2026-12-03, seventh session: with the
    split-KV combine's reads counted, gqa bs1's loop-free 32-split program, 11.6 µs, had been
    ranked above 2- and 4-step 16-split ones, 9.9 and 10.3 µs)."""
    step_fixed_s: float = 0.2e-6
    """What every loop step adds on top of its longest part, register path or not: the wait on
    the step's stage, the barriers, and the loop's own bookkeeping, none of which the throughput
    and chain terms see (fitted, seventh session). Measured on the H200 at one grid: gqa bs8
    with 8, 16 and 32 steps ran 31.2, 32.7 and 40.2 µs; qknorm_real bs8 with 8 and 16 steps
    40.0 and 46.4 µs, where the model, bound by a throughput term, priced each set the same."""
    pre_latency_s: float = 1.5e-6
    """The PRE phase's loads and the POST phase's stores: one round trip each way."""
    mma_efficiency: float = 0.4
    """Fraction of tensor-core peak codegen's mma.sync chains reach in one SM: a loop step's
    matmul work is shared by the blocks resident on an SM at this rate. Refitted from 0.2 in the
    seventh session, after the fragment pipeline (`mlso::MmaFrags`) shortened every chain."""
    exp_elem_s: float = 160e-9
    """Per score element per SM thread slot and loop step of an online-softmax accumulator (exp,
    running max and rescale on the SIMT units), fitted."""
    smem_elem_s: float = 320e-9
    """Per element per SM thread slot and loop step of a loop-phase value that goes through shared memory
    (every graph-defined kernel but the register-path online softmax), fitted."""
    warp_flops: float = 0.7e12
    """What one warp's dependent mma.sync chain sustains: a block of few warps cannot use its
    SM's share. gqa at batch 8 with 2-warp blocks and 32 loop steps measured 73 µs, twice the
    4-warp fixture, where the SM share alone predicted the same time. Refitted from 0.2e12 in the
    seventh session: with fragments loaded a group ahead, a 4-warp gqa bs1 block (2, 4, 16)
    outran the 8-warp (2, 2, 32) one, 9.9 against 11.6 µs; `step_fixed_s` now prices the 32
    steps."""
    chain_exposed: float = 1.0
    """With one resident block per SM, the share of the shorter of a loop step's tile loads and
    its mma chain that the pipeline does not hide (fitted). Nothing else on the SM runs while
    the block's warps wait on their chain, and the next stage's loads are only issued between
    steps, so the two overlap in part, not fully as `max` assumes. Measured on the H200
    (benchmarks/RESULTS.md, 2026-12-02, third session): layernorm_linear's program that adds
    beta @ W as a second (1 x 1024) matmul per step ran 28.6 µs where the one-matmul program
    ran 21.1 (bs8: 52.1 against 39.8); the model had priced the first cheaper. Fitted on the
    66 + 7 programs of the earlier fits and the 74 of that call: wrong-way pairs 6, 7 and 20
    -> 6, 7 and 11, geometric error 1.387, 1.407, 1.370 -> 1.362, 1.386, 1.349. Refitted to
    0.5 (from 0.75) with the K-split template below: its chains are shorter, and the 80 programs
    timed with it rank best at 0.25-0.5."""
    partial_sum_gain: float = 0.5
    """How a warp's chain speeds up with its independent partial sums: ilp ** this (fitted).
    Measured on the H200 (benchmarks/RESULTS.md, 2026-12-02, fourth session): the partial sums
    alone took gated_mlp's program from 35.7 to 33.6 µs, the K split over idle warps to 30.1."""
    split_round_s: float = 0.3e-6
    """Each further slice of a K split over warps is added to C after a barrier (fitted on the
    80 programs timed with the split template: wrong-way pairs 18 -> 13)."""
    noloop_serial: float = 0.0
    """With one resident block per SM and no loop, the share of the shorter parts (loads, flops,
    mma chains) that runs in series with the longest. It was 1 (all in series), fitted when a
    loop-free layernorm program ran one warp's chain of 256 dependent mma.sync; `_mma_chain_s`
    now prices that chain itself. Refit on 88 programs timed at 183a98d: the two loop-free ones
    (mla_bs1 sizings, 11.9 and 11.3 µs) were estimated 18.5 and 14.9 µs, the worst ranking
    errors of the set; 0 takes wrong-way pairs from 65 to 47 of 297 (0.5: 58)."""
    loop_pass_s: float = 0.75e-6
    """Latency each loop-phase reduction adds to a loop step of a register-path kernel (fitted).
    The online softmax runs in registers, but a reduction over the step's tile (qknorm's per-key
    RMS norm of K) is still a shared-memory pass, and so is the pass that uses its result, each
    closed by a barrier, in series before the register step: a block waits on them and only
    other resident blocks hide them, so they lengthen the step's dependent chain (the mma-chain
    term), not the SM's throughput terms. Measured on the H200 (benchmarks/RESULTS.md, "batch 8
    and 16 after the refit", 2026-12-02): qknorm_gqa at batch 8 with 2 blocks per SM and 32 steps
    of 32 keys ran 68.5 µs, the fixture (4 blocks per SM, 8 steps of 64 keys) 45.8 µs: about
    1.9 µs a step where the model said 1.2 and priced the two the same. At batch 1 the qknorm
    fixtures ran 18.2 µs where gqa's, same grid and tiles without the in-loop norm, ran 15.6.
    Fitted to the refit's 66 programs and the 7 batch-8/16 searched programs of that table: the
    optimum, 0.8 µs, ties qknorm_gqa_bs1's fixture with a shared-memory program measured 2x
    slower; 0.75 keeps a margin. Over the 73: wrong-way pairs 7 -> 6, geometric RMS error
    1.41 -> 1.40 (over the 66: 6 -> 6, 1.392 -> 1.387); the 32-step program now costs 1.38x
    the fixture (measured 1.50x)."""


H200 = Hardware()


@dataclass(frozen=True)
class Cost:
    seconds: float
    dram_bytes: int
    flops: int
    launches: int

    @property
    def us(self) -> float:
        return self.seconds * 1e6


def _kernel_time(hw: Hardware, nbytes: int, flops: int, tensor: bool) -> float:
    return (
        max(nbytes / hw.dram_bytes_per_s, flops / (hw.tensor_flops if tensor else hw.simt_flops))
        + hw.launch_s
    )


def onnx_region_cost(loaded: LoadedModel, region: Region, hw: Hardware = H200) -> Cost:
    """What ONNX Runtime pays for the region unfused: one kernel per non-view node."""
    total = 0.0
    nbytes = flops = launches = 0
    nodes = loaded.graph.node
    for i in region.nodes:
        n: onnx.NodeProto = nodes[i]
        if n.op_type in _FREE_VIEWS:
            continue
        b = sum(_nbytes(loaded, x) for x in list(n.input) + list(n.output) if x)
        f = node_flops(loaded, n)
        half = loaded.dtypes.get(n.input[0]) in (
            onnx.TensorProto.FLOAT16,
            onnx.TensorProto.BFLOAT16,
        )
        tensor = n.op_type in ("MatMul", "Gemm", "Attention") and half
        total += _kernel_time(hw, b, f, tensor) - hw.launch_s + hw.ort_node_s
        nbytes, flops, launches = nbytes + b, flops + f, launches + 1
    return Cost(total, nbytes, flops, launches)


def _bytes(n: Node) -> int:
    return n.numel * n.dtype.itemsize


def _matmul_flops(n: Node) -> int:
    return 2 * n.numel * n.src[0].shape[-1]


def program_cost(kg: KernelGraph, hw: Hardware = H200) -> Cost:
    """Cost of a μGraph as code generation emits it: one term per kernel of its lowering plan
    (codegen/plan.py), so launches are counted as codegen launches them. Why the plan: a split
    combine's REDUCE_SUMs over the partials are fused into the division's kernel in one program
    and run as kernels of their own in another (mla_bs1: 4 launches where the model counted 3)."""
    from mlso_cli.codegen.plan import plan  # lazily: codegen imports ir

    total = 0.0
    nbytes = flops = launches = 0
    kernels = plan(kg, "sm_90").kernels
    if any(k.kind == "gemm" for k in kernels):
        from mlso_cli.codegen.libgemm import epilogue_adds

        # An ADD that a library GEMM computes as its bias or residual epilogue costs nothing more:
        # codegen emits no kernel for it (the lowering plan still lists one where it is a root).
        # A residual's read is not priced apart: library_gemm_s counts C at 4 bytes an element,
        # which for a 16-bit C is its write plus the residual's read (an fp32 one is unpriced).
        done = epilogue_adds(kg.nodes(), list(kg.inputs), list(kg.outputs))
        kernels = tuple(k for k in kernels if k.root not in done)
    materialised = {r for k in kernels for r in k.roots}
    computed = {p.root for k in kernels for p in k.parts or (k,) if p.kind != "stage"}
    """What the other kernels wrote: a staging kernel reads it, or the producers it fuses."""
    for k in kernels:
        if k.kind == "siblings":
            b, f = _siblings_traffic(k.roots, materialised)
            total += _kernel_time(hw, b, f, False) + hw.pre_latency_s
            nbytes, flops, launches = nbytes + b, flops + f, launches + 1
            continue
        if k.kind == "row":
            b, f = _row_traffic(k, materialised, computed)
            total += _kernel_time(hw, b, f, False) + len(k.parts) * hw.pre_latency_s
            nbytes, flops, launches = nbytes + b, flops + f, launches + 1
            continue
        n = k.root
        assert n is not None
        if n.op is Op.GRAPH_DEF:
            b, f = _block_graph_traffic(n)
            tensor = any(s.dtype is not DType.F32 for s in n.src)
            t = max(_kernel_time(hw, b, f, tensor), block_graph_time(n, b, f, tensor, hw))
        else:
            b = sum(_bytes(s) for s in _kernel_reads(n, materialised)) + _bytes(n)
            f = _matmul_flops(n) if n.op is Op.MATMUL else n.numel
            tensor = n.op is Op.MATMUL and n.src[0].dtype is not DType.F32
            if k.kind == "gemm":
                total += library_gemm_s(n, hw)
                nbytes, flops, launches = nbytes + b, flops + f, launches + 1
                continue
            if k.kind == "stage":  # a library GEMM's operand written in its own dtype
                reads = [n] if n in computed else _kernel_reads(n, computed)
                b = sum(_bytes(s) for s in reads) + _bytes(n)
                t = _kernel_time(hw, b, n.numel, False) + hw.pre_latency_s
            elif n.op is Op.MATMUL:
                t = (
                    max(
                        b / (hw.dram_bytes_per_s * hw.codegen_matmul_bw_fraction),
                        f / hw.codegen_matmul_flops,
                        hw.pre_latency_s + _matmul_steps(n) * (hw.step_latency_s + hw.smem_step_s),
                    )
                    + hw.launch_s
                )
            else:
                t = _kernel_time(hw, b, f, tensor) + hw.pre_latency_s
        total += t
        nbytes, flops, launches = nbytes + b, flops + f, launches + 1
    return Cost(total, nbytes, flops, launches)


def _siblings_traffic(roots: tuple[Node, ...], materialised: set) -> tuple[int, int]:
    """(bytes, flops) of one launch computing several independent elementwise kernels
    (codegen/siblings.py): each part's writes and element work, and every tensor the parts read
    counted once (the sibling kernels of a layer read slices of one GEMM result). Priced as one
    kernel: one launch and one round trip, the parts' work sharing the grid."""
    reads = {s for r in roots for s in _kernel_reads(r, materialised)}
    return sum(_bytes(s) for s in reads) + sum(_bytes(r) for r in roots), sum(
        r.numel for r in roots
    )


def _row_traffic(k, materialised: set, computed: set) -> tuple[int, int]:
    """(bytes, flops) of a row kernel (codegen/rowfuse.py): the reductions' reads and the
    value's (a staged operand's as a "stage" kernel's), each tensor once, the reduced values not
    among them (registers), and every result written. Its time pays a round trip per part, the
    row's loads before each reduction and the value's after them, but one launch."""
    *reds, val = k.parts
    rs, v = [p.root for p in reds], val.root
    own = computed - {v} if val.kind == "stage" else materialised
    reads = set(_kernel_reads(v, own - set(rs)))
    for r in rs:
        reads |= set(_kernel_reads(r, materialised))
    reads -= set(rs)
    flops = sum(r.src[0].numel for r in rs) + v.numel
    return sum(_bytes(s) for s in reads) + sum(_bytes(r) for r in rs) + _bytes(v), flops


def library_gemm_s(n: Node, hw: Hardware = H200) -> float:
    """One cuBLASLt call computing matmul n from operands in memory: the larger of its FLOPs and
    its bytes (A, B read once, C written once) at the library's rates, plus the fixed call cost."""
    a, b = n.src
    rate = hw.library_fp32_flops if a.dtype is DType.F32 else hw.library_tensor_flops
    moved = _bytes(a) + _bytes(b) + n.numel * 4
    return max(_matmul_flops(n) / rate, moved / hw.library_bytes_per_s) + hw.library_call_s


def _kernel_reads(root: Node, materialised: set) -> list[Node]:
    """The tensors a kernel-level kernel reads from memory: its sources, looking through the
    producers codegen fuses into it (elementwise ops, and reductions over a split's partials)
    down to values another kernel materialised or the program's inputs."""
    out: list[Node] = []
    seen: set[Node] = set()
    stack = list(root.src)
    while stack:
        s = stack.pop()
        if s in seen or s.op is Op.CONST:
            continue
        seen.add(s)
        if s.op is Op.PROJ and s.src[0] in materialised:
            out.append(s)  # one output of a graph-defined kernel (a split's partials)
        elif s in materialised or s.op is Op.INPUT or not s.src:
            out.append(s)
        else:
            stack.extend(s.src)
    return out


def _matmul_steps(n: Node) -> int:
    """K-steps of codegen's kernel-level matmul: it stages K in tiles of 32 (tensor cores) or 16
    (fp32 SIMT), and each step is a DRAM round trip, as a graph-defined kernel's loop step is.
    Why: without it a chain of small kernels looked cheaper than one fused kernel that loops."""
    k = n.src[0].shape[-1]
    tk = 16 if n.src[0].dtype is DType.F32 else 32
    return -(-k // tk)


def block_graph_time(gd: Node, nbytes: int, flops: int, tensor: bool, hw: Hardware = H200) -> float:
    """Latency-aware time of a graph-defined kernel: blocks run in waves of what fits on the SMs
    (shared memory and threads, from the lowering plan's layout), and each block's PRE phase and
    each loop step cost at least a round trip, or the block's share of the bandwidth and of its
    SM's tensor cores, whichever is longer.

    Why: the throughput bound alone is blind to parallelism, so it ranks one huge block (no
    re-reads of replicated tiles) above a grid that fills the GPU, which is backwards. DRAM
    bandwidth scales with the SMs a grid occupies: measured on the H200, a 64-block rmsnorm_linear
    program ran 39 µs where a 128-block one ran 27 µs (benchmarks/RESULTS.md, "cost model
    calibration"); without that term the model ranked the 64-block program 1.5x faster."""
    from mlso_cli.codegen.blocklayout import smem_layout  # lazily: codegen imports ir

    bg = gd.arg
    layout = smem_layout(bg, "sm_90")  # the H200 this model describes
    blocks = bg.block_count()
    threads = max(layout.threads, 32)
    per_sm = max(
        1, min(hw.smem_per_sm // (max(layout.smem, 1) + 1024), hw.threads_per_sm // threads)
    )
    concurrent = min(blocks, hw.sms * per_sm)
    waves = -(-blocks // (hw.sms * per_sm))
    sms_used = min(hw.sms, blocks)
    share_bw = hw.dram_bytes_per_s * sms_used / hw.sms / concurrent
    unit = hw.tensor_flops * hw.mma_efficiency if tensor else hw.simt_flops
    share_flops = unit * sms_used / hw.sms / concurrent
    if tensor:
        share_flops = min(share_flops, threads // 32 * hw.warp_flops)
    per_block_bytes, per_block_flops = (nbytes + _element_path_penalty(gd)) / blocks, flops / blocks
    steps = max(bg.loop, 1)
    chain = _mma_chain_s(gd, threads // 32, hw, layout.register_path) / steps if tensor else 0.0
    if layout.register_path:
        # the loop's shared-memory passes outside the register step are in series with it
        chain += _loop_reductions(bg) * hw.loop_pass_s
    parts = (
        per_block_bytes / steps / share_bw,
        per_block_flops / steps / share_flops,
        chain,
    )
    if steps == 1 and per_sm == 1:
        # one resident block per SM and no loop: no pipeline stage overlaps its tile loads with
        # its compute, only the warps' own interleaving (`noloop_serial`)
        step = max(hw.step_latency_s, max(parts) + hw.noloop_serial * (sum(parts) - max(parts)))
    elif per_sm == 1:
        # a loop, but no other resident block: the stages hide only part of the chain
        step = max(hw.step_latency_s, *parts) + hw.chain_exposed * min(parts[0], parts[2])
    else:
        step = max(hw.step_latency_s, *parts)
    # SIMT and shared-memory work per step is shared by the blocks resident on one SM: charge
    # it per SM (elements over the SM's thread slots), not per block, or many small blocks look
    # free next to a few large ones doing the same work (gqa at batch 8: 64- against 128-key
    # steps, measured 37 against 32 µs)
    score, passed = _loop_elements(bg)
    resident = concurrent / sms_used
    step += score * resident / hw.threads_per_sm * hw.exp_elem_s
    step += hw.step_fixed_s
    if not layout.register_path:
        step += hw.smem_step_s + passed * resident / hw.threads_per_sm * hw.smem_elem_s
    # the pipeline's fill: the first stage's loads wait with nothing to overlap them (a loop-free
    # kernel loads everything, then computes)
    fill = hw.fill_exposed * min(parts[0], max(parts[1], parts[2]))
    return waves * (hw.pre_latency_s + steps * step + fill) + hw.launch_s


def graph_def_floor(read_bytes: int, blocks: int, loop: int, hw: Hardware = H200) -> float:
    """A lower bound on `program_cost` of any program with a graph-defined kernel of `blocks`
    blocks and `loop` steps whose input tiles move `read_bytes` over the whole grid (the sum of
    `_input_reads`' figures), whatever its block graph, layout and other kernels.

    Why: sizing (select.choose_dims) prices thousands of instances of a structure, each laid out
    by code generation first, and keeps the cheapest; an instance whose floor is above the
    cheapest found cannot enter, so it need not be built. The floor is what every branch of
    `block_graph_time` pays at least, from the tiles alone: one wave (the PRE round trip and
    the launch), and per loop step the step latency or the block's bytes at its largest share
    of the bandwidth (an SM's, `share_bw` <= dram / sms), plus the fixed step cost. The kernel
    costs at least its own DRAM time too (`_kernel_time`), and every other kernel a program
    has costs more than nothing."""
    steps = max(loop, 1)
    per_step = read_bytes / blocks / steps / (hw.dram_bytes_per_s / hw.sms)
    waves = hw.pre_latency_s + steps * (max(hw.step_latency_s, per_step) + hw.step_fixed_s)
    return max(waves, read_bytes / hw.dram_bytes_per_s) + hw.launch_s


def _loop_elements(bg) -> tuple[int, int]:
    """(score elements an online-softmax accumulator takes per step, elements of the other
    loop-phase values computed per step) of one block: the per-step SIMT and shared-memory work
    the flop and byte terms miss."""
    score = passed = 0
    for n in bg.nodes():
        if n.op in (Op.ACC_EXP_SUM, Op.ACC_EXP_WSUM):
            score = max(score, n.src[0].numel)
        elif n.phase is Phase.LOOP and n.op not in VIEW and n.op not in (Op.ITER, Op.CONST):
            passed += n.numel
    return score, passed


def _loop_reductions(bg) -> int:
    """Loop-phase reductions of a block graph: each is a shared-memory pass over the step's tile
    (and one more for the values computed from its result) that a register-path kernel runs
    outside its register step (`Hardware.loop_pass_s`)."""
    return sum(1 for n in bg.nodes() if n.phase is Phase.LOOP and n.op in REDUCE)


def _mma_chain_s(gd: Node, warps: int, hw: Hardware, register_path: bool = False) -> float:
    """Time of one block's tensor-core work when it is bound by the mma.sync chains: each matmul
    as `mlso::block_mma` deals it to the warps (codegen/mmawork.py: whole m16n8k16 tiles, a 2-row
    operand still costing 16 rows; strips of n8 tiles; a strip's K shared by idle warps), each
    busy warp issuing its mma.sync at `warp_flops`, sped up by its independent partial sums.
    Why: the flop count alone misses both. A block that multiplies 2 rows by a 4096 x 8 weight
    tile has one output tile; before the template split K it was one warp running 256 dependent
    mma steps (measured: layernorm_linear's loop-free program, 16 µs per wave of such blocks,
    where the flop share said 3 µs). Loop-phase matmuls count once per step."""
    bg = gd.arg
    total = 0.0
    for n in bg.nodes():
        if n.op is not Op.MATMUL and n.op is not Op.ACC_EXP_WSUM:
            continue
        *batch, m, cols = n.shape
        k = n.src[0].shape[-1]
        times = bg.loop if (n.phase is Phase.LOOP or n.op is Op.ACC_EXP_WSUM) else 1
        if register_path or n.op is Op.ACC_EXP_WSUM or cols % MMA_N:
            # the online softmax (its register path runs every matmul of the kernel): a warp per
            # 16-row strip, no K split
            tiles = math.prod(batch) * -(-m // MMA_M) * -(-cols // MMA_N)
            mmas = -(-tiles // max(1, min(warps, tiles))) * -(-k // MMA_K)
            total += times * mmas * MMA_FLOPS / hw.warp_flops
            continue
        w = mma_work(math.prod(batch), m, cols, k, warps)
        rate = hw.warp_flops * w.ilp**hw.partial_sum_gain
        total += times * (w.chain_mmas * MMA_FLOPS / rate + (w.ksplit - 1) * hw.split_round_s)
    return total


def _input_reads(gd: Node):
    """(source, tile shape, bytes read over the whole grid) for each input of a graph-defined
    kernel: a tile is read once per block, and once per loop step when the loop walks it."""
    bg = gd.arg
    blocks = bg.block_count()
    for im, src in zip(bg.inputs, gd.src):
        tile = tile_shape(src.shape, im, bg.grid, bg.loop)
        steps = bg.loop if im.fmap is not None else 1
        yield src, tile, math.prod(tile) * src.dtype.itemsize * steps * blocks


def _block_graph_traffic(gd: Node) -> tuple[int, int]:
    bg = gd.arg
    blocks = bg.block_count()
    read = sum(nbytes for _, _, nbytes in _input_reads(gd))
    written = sum(_bytes(p) for p in _saves(gd))
    flops = 0
    for n in bg.nodes():
        if n.op is Op.MATMUL or n.op is Op.ACC_EXP_WSUM:
            per = 2 * n.numel * n.src[0].shape[-1]
            flops += (
                per * blocks * (bg.loop if n.phase is Phase.LOOP or n.op is Op.ACC_EXP_WSUM else 1)
            )
        elif n.op not in VIEW and n.op not in (Op.ITER, Op.SAVE, Op.CONST):
            flops += n.numel * blocks
    return read + written, flops


DRAM_BURST = 64
"""Bytes DRAM moves per access (two 32-byte sectors): a strided tile row narrower than this
costs as much as this."""


def _element_path_penalty(gd: Node) -> int:
    """Extra bytes to charge for input tiles that DRAM or codegen's copies move inefficiently.
    - Tiles codegen cannot copy in 16-byte chunks (a tile row or a source row that is not a
      multiple of 16 bytes): it loads those one element at a time, synchronously, so each element
      costs about a 16-byte transaction. Measured on the H200: an rmsnorm_linear program with
      12-column weight tiles ran 136 µs where the model said 27 µs (benchmarks/RESULTS.md, "cost
      model calibration").
    - Strided tiles whose rows are narrower than a DRAM burst (an 8-column fp16 weight tile: 16
      bytes of every 8 KB row) pay the whole burst per row. Measured: layernorm_linear's program
      with such tiles moved its weight at about a quarter of DRAM bandwidth."""
    extra = 0
    for src, tile, nbytes in _input_reads(gd):
        vec = max(1, 16 // src.dtype.itemsize)
        if not (tile and tile[-1] % vec == 0 and src.shape[-1] % vec == 0):
            extra += nbytes * (vec - 1)
            continue
        row = tile[-1] * src.dtype.itemsize
        if len(tile) >= 2 and tile[-1] < src.shape[-1] and row < DRAM_BURST:
            extra += nbytes * (DRAM_BURST // row - 1)
    return extra


def _saves(gd: Node) -> list[Node]:
    from mlso_cli.ir import build as b

    return b.graph_def(gd.src, gd.arg)
