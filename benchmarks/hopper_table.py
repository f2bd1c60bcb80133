"""Issue 33's table: mlso's searched programs against torch peers in one process, on one GPU.

For every benchmark row (models/build_models.py SPECS, every batch size) and every real-width
subgraph of models/realwidth.py (issue 33's classes: norm + linear + activation, gated MLPs with
and without the down projection, a norm with several projections, latent and long-KV decode
attention), in one process on the GPU machine:

- **mlso**: the faster of two candidates, as `mlso optimize --gpu` chooses between them by
  timing: the program the search chose on the CPU machine (`benchmarks/searched_programs/
  <row>.json`, real-width ones under `realwidth/`; `searched µs`) and the row's library baseline
  (its lifted program, cuBLASLt GEMMs plus generated kernels for the rest, built with the lifted
  constants as optimize builds it; `library baseline µs`); `chosen` says which. Each compiled by
  codegen (nvcc, cached: carry a cache filled by `compile` below) and timed by the launcher
  (`Program.time`: CUDA-graph replay of 200 runs, median of 5, input sets rotated out of L2 by
  `launcher.operand_sets`); the two candidates' outputs are compared (`candidates_rel` in the
  JSON) and the chosen one's is compared with the peers';
- **peers** on the same shapes: torch eager; SDPA on 4-D tensors for the attention rows (K in
  the (heads, keys, dim) layout SDPA reads, laid out once outside the timing, as a model that
  calls SDPA stores its cache; MLA's latent cache concatenated with its rope keys, the layout
  vLLM keeps); torch.compile of the eager function (default mode) where it fits the call
  (`--compile`, a per-row compile timeout and a deadline for the whole run). Each peer is timed
  by CUDA-graph replay over as many operand sets as the launcher rotates, with the events
  recorded on the stream `graph.replay()` runs on, and its output is compared with mlso's on the
  same inputs: a peer that disagrees (norm-wise relative difference over 5%) is not a peer;
- **floor** = max(DRAM bytes at the card's peak, matmul FLOPs at 790 TFLOP/s, 2 µs for one
  replayed launch), as docs/benchmarks.md's targets, with the DRAM peak by device name (H100
  SXM 3.35 TB/s, H200 4.8 TB/s); bytes: every graph input and initializer read once and every
  output written once; FLOPs: 2·M·N·K over the MatMul/Gemm nodes. A peer faster than 90% of the
  floor is a broken measurement: it is dropped, and the row says so;
- **target** = max(best peer / 1.5, floor / 0.9); `% DRAM` and `% tensor` are the bytes and
  matmul FLOPs over mlso's time against the same two peaks.

Rows are printed as they are measured (first pass: mlso, eager, SDPA for every row; second
pass: torch.compile per row until the deadline, each row printed again with it), and the JSON
(--json) is rewritten after every row, so a run cut at the device's limit keeps what it measured.
`--record` appends one record per row to benchmarks/results/hopper_rows.json at the end; `record
FILE --machine TEXT` appends a saved JSON's rows (a run that was cut before its end).

    python3 benchmarks/hopper_table.py run --json OUT.json --record [--compile] [--rows GLOB,...]
    python3 benchmarks/hopper_table.py compile       # fill MLSO_CACHE_DIR's nvcc cache (CPU)
    python3 benchmarks/hopper_table.py list          # rows, bytes, FLOPs and floors (CPU)
    python3 benchmarks/hopper_table.py record OUT.json --machine "NVIDIA H200 (device machine)"

Without a CUDA GPU (or without torch), `run` prints that it skipped and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import json
import math
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.peers_inprocess import graph_time_us  # noqa: E402
from models.build_models import EPS_NORM, EPS_RMS, SPECS, _f32, _mla_scale  # noqa: E402
from models.realwidth import CLASSES, REALWIDTH  # noqa: E402

PROGRAMS = ROOT / "benchmarks" / "searched_programs"
TABLE = "hopper_rows"

TENSOR_FLOPS = 790e12
"""fp16 tensor-core rate of the floor and of `% tensor`: docs/benchmarks.md's measured H200 figure
(the cost model's Hardware.tensor_flops), not the 989 TFLOP/s datasheet peak of H100/H200 SXM."""
LAUNCH_FLOOR_US = 2.0
"""About one replayed launch (docs/benchmarks.md, Targets)."""
DRAM_PEAKS: tuple[tuple[str, float], ...] = (
    ("H200", 4.8e12),
    ("H100 PCIe", 2.0e12),
    ("H100 NVL", 3.9e12),
    ("H100", 3.35e12),
)
"""Datasheet DRAM bandwidth by the first substring of the device name that matches."""
PEER_FLOOR_FRACTION = 0.9
"""A peer time under this share of the floor is a broken measurement: dropped."""
AGREE_REL = 0.05
"""A peer whose output differs from mlso's by more than this (norm-wise) computes something else."""
PEERS = ("eager", "sdpa", "compile")
PEER_LABEL = {"eager": "torch eager", "sdpa": "SDPA", "compile": "torch.compile"}


# --------------------------------------------------------------------------------------
# rows
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    name: str
    """The program's file stem: <spec>_bs<bs> or a models/realwidth.py name."""
    cls: str
    """"benchmark" or a key of models.realwidth.CLASSES."""
    family: str
    """Which peers (a key of PEER_FAMILIES)."""
    build: Callable[[], onnx.ModelProto]

    @property
    def program(self) -> Path:
        folder = PROGRAMS if self.cls == "benchmark" else PROGRAMS / "realwidth"
        return folder / f"{self.name}.json"


FAMILY_OF_REALWIDTH = {
    "rms_linear_silu_t8_h4096_n14336": "rms_linear_silu",
    "ln_linear_gelu_t8_h1024_n4096": "ln_linear_gelu",
    "swiglu_t8_h4096_f14336": "gated_mlp",
    "swiglu_down_t8_h2048_f8192": "swiglu_down",
    "rms_qkv_t8_h2048_q2048_kv512": "rms_qkv",
    "mla_decode_b1_h128_kv8192": "mla",
    "gqa_decode_b1_h32_kvh8_d128_kv32768": "gqa_decode",
}


def rows() -> list[Row]:
    """Every row in run order: the benchmark rows at batch 1, the real-width subgraphs, then the
    benchmark rows at their larger batch sizes (a deadline cuts the least asked-for last)."""

    def spec_row(name: str, bs: int) -> Row:
        return Row(f"{name}_bs{bs}", "benchmark", name, lambda: SPECS[name].build(bs, "float16"))

    first = [spec_row(n, 1) for n, s in SPECS.items() if 1 in s.batch_sizes]
    real = [Row(r.name, r.cls, FAMILY_OF_REALWIDTH[r.name], r.build) for r in REALWIDTH.values()]
    rest = [spec_row(n, bs) for n, s in SPECS.items() for bs in s.batch_sizes if bs != 1]
    return first + real + rest


def select(all_rows: list[Row], globs: str) -> list[Row]:
    pats = [p.strip() for p in globs.split(",") if p.strip()]
    if not pats:
        return all_rows
    return [r for r in all_rows if any(fnmatch.fnmatch(r.name, p) for p in pats)]


# --------------------------------------------------------------------------------------
# arithmetic (tested on the CPU)
# --------------------------------------------------------------------------------------


def model_cost(model: onnx.ModelProto) -> tuple[int, int]:
    """(DRAM bytes, matmul FLOPs) of one run: every graph input and initializer read once, every
    output written once; 2·M·N·K for each MatMul/Gemm (the tensor-core work)."""
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    g = inferred.graph
    types: dict[str, onnx.TypeProto.Tensor] = {}
    for vi in [*g.input, *g.value_info, *g.output]:
        types[vi.name] = vi.type.tensor_type

    def shape(name: str) -> tuple[int, ...]:
        return tuple(d.dim_value for d in types[name].shape.dim)

    def nbytes(name: str) -> int:
        size = onnx.helper.tensor_dtype_to_np_dtype(types[name].elem_type).itemsize
        return int(np.prod(shape(name), dtype=np.int64)) * size

    total = sum(nbytes(vi.name) for vi in g.input) + sum(nbytes(vi.name) for vi in g.output)
    total += sum(numpy_helper.to_array(t).nbytes for t in g.initializer)
    flops = 0
    for node in g.node:
        if node.op_type not in ("MatMul", "Gemm"):
            continue
        out = shape(node.output[0])
        a = shape(node.input[0])
        trans_a = any(x.name == "transA" and x.i for x in node.attribute)
        k = a[0] if node.op_type == "Gemm" and trans_a else a[-1]
        flops += 2 * int(np.prod(out, dtype=np.int64)) * k
    return total, flops


def dram_peak(device: str) -> float:
    """Datasheet DRAM bytes/s of a device by name; ValueError for a card not in DRAM_PEAKS."""
    for key, peak in DRAM_PEAKS:
        if key.lower() in device.lower():
            return peak
    raise ValueError(f"no DRAM peak known for {device!r} (known: {[k for k, _ in DRAM_PEAKS]})")


def floor_us(nbytes: int, flops: int, dram_bps: float, tensor_flops: float = TENSOR_FLOPS) -> float:
    """max(DRAM time, tensor time, one replayed launch), microseconds."""
    return max(nbytes / dram_bps * 1e6, flops / tensor_flops * 1e6, LAUNCH_FLOOR_US)


def target_us(best_peer_us: float | None, floor: float) -> float:
    """max(best peer / 1.5, floor / 0.9); the floor term alone without a peer."""
    by_floor = floor / 0.9
    return by_floor if best_peer_us is None else max(best_peer_us / 1.5, by_floor)


def percent_of_peak(amount: float, us: float, peak_per_s: float) -> float:
    """What `amount` (bytes or FLOPs) done in `us` microseconds is, in % of `peak_per_s`."""
    return 100.0 * amount / (us * 1e-6) / peak_per_s


def usable_peers(
    peers: dict[str, float], floor: float, disagree: set[str] | frozenset[str] = frozenset()
) -> tuple[dict[str, float], list[str]]:
    """The peer times the target may use, and a note for each one it may not: under 90% of the
    floor (a broken measurement) or computing something else (its output disagrees)."""
    kept: dict[str, float] = {}
    notes: list[str] = []
    for name, us in peers.items():
        if us < PEER_FLOOR_FRACTION * floor:
            notes.append(
                f"{PEER_LABEL.get(name, name)} {us:.2f} µs dropped: under "
                f"{PEER_FLOOR_FRACTION:.0%} of the {floor:.2f} µs floor"
            )
        elif name in disagree:
            notes.append(f"{PEER_LABEL.get(name, name)} {us:.2f} µs dropped: output disagrees")
        else:
            kept[name] = us
    return kept, notes


def summarise(res: dict[str, Any]) -> dict[str, Any]:
    """Fill a measured row's derived figures (floor, best peer, target, percentages) in place."""
    fl = floor_us(
        res["bytes"], res["flops"], res["dram_bps"], res.get("tensor_flops", TENSOR_FLOPS)
    )
    disagree = set(res.get("disagree", []))
    pre: list[str] = []
    if disagree and disagree >= set(res.get("agree", {})):
        # every peer compared differs from mlso: the suspect is mlso's output, not the peers
        worst = max(res["agree"].values())
        pre.append(f"mlso's output differs from every peer (up to {worst:.2g}): peers kept")
        disagree = set()
    kept, notes = usable_peers(res.get("peers_us", {}), fl, disagree)
    notes = pre + notes
    best = min(kept.items(), key=lambda kv: kv[1]) if kept else None
    res["floor_us"] = fl
    res["best_peer"] = best[0] if best else None
    res["best_peer_us"] = best[1] if best else None
    res["target_us"] = target_us(best[1] if best else None, fl)
    res["dropped"] = notes
    us = res.get("mlso_us")
    if us:
        res["vs_target"] = us / res["target_us"]
        res["pct_dram"] = percent_of_peak(res["bytes"], us, res["dram_bps"])
        res["pct_tensor"] = percent_of_peak(res["flops"], us, res.get("tensor_flops", TENSOR_FLOPS))
    return res


def _r(x: float | None, nd: int = 2) -> float | None:
    return None if x is None else round(float(x), nd)


def _sig(x: float | None) -> str | None:
    return None if x is None else f"{x:.1e}"


def figures(res: dict[str, Any]) -> dict[str, Any]:
    """A row's record figures (benchmarks/results/hopper_rows.json): None where not measured."""
    peers = res.get("peers_us", {})
    best = res.get("best_peer")
    notes = [*res.get("dropped", []), *res.get("notes", [])]
    if res.get("error"):
        notes.insert(0, f"mlso: {res['error']}")
    return {
        "class": "benchmark row" if res["cls"] == "benchmark" else CLASSES[res["cls"]],
        "mlso µs": _r(res.get("mlso_us")),
        "launches": res.get("launches"),
        "searched µs": _r(res.get("searched_us")),
        "library baseline µs": _r(res.get("baseline_us")),
        "chosen": res.get("mlso_pick"),
        "torch eager µs": _r(peers.get("eager")),
        "SDPA µs": _r(peers.get("sdpa")),
        "torch.compile µs": _r(peers.get("compile")),
        "best peer": f"{PEER_LABEL[best]} {res['best_peer_us']:.2f}" if best else None,
        "floor µs": _r(res.get("floor_us")),
        "target µs": _r(res.get("target_us")),
        "mlso / target": _r(res.get("vs_target")),
        "% DRAM": _r(res.get("pct_dram"), 1),
        "% tensor": _r(res.get("pct_tensor"), 1),
        "mlso vs eager": _sig(res.get("agree", {}).get("eager")),
        "MB": _r(res["bytes"] / 1e6, 1),
        "GFLOP": _r(res["flops"] / 1e9, 3),
        "notes": "; ".join(notes) or "",
    }


HEAD = [
    "row",
    "class",
    "mlso µs",
    "launches",
    "searched µs",
    "library baseline µs",
    "chosen",
    "torch eager µs",
    "SDPA µs",
    "torch.compile µs",
    "best peer",
    "floor µs",
    "target µs",
    "mlso / target",
    "% DRAM",
    "% tensor",
    "mlso vs eager",
    "notes",
]


def markdown_head() -> str:
    return "| " + " | ".join(HEAD) + " |\n|" + "---|" * len(HEAD)


def markdown_row(res: dict[str, Any]) -> str:
    figs = figures(res)

    def cell(v: Any) -> str:
        if v is None:
            return "—"
        return str(v).replace("|", "/")

    return "| " + " | ".join([res["name"], *(cell(figs[k]) for k in HEAD[1:])]) + " |"


# --------------------------------------------------------------------------------------
# peers (torch; GPU only)
# --------------------------------------------------------------------------------------


def _rms(torch: Any, x: Any, w: Any, eps: float = EPS_RMS) -> Any:
    """LlamaRMSNorm: in fp32, back to the input dtype, times the weight."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


Peer = tuple[Callable[[dict[str, Any]], dict[str, Any]], Callable[[dict[str, Any]], Any]]
"""(prepare, fn): prepare lays a set of inputs out once, outside the timing; fn is timed."""


def _same(d: dict[str, Any]) -> dict[str, Any]:
    return d


def peer_family(torch: Any, family: str) -> dict[str, Peer]:
    """The eager function (also what torch.compile compiles) and, for attention, SDPA on 4-D
    tensors, for one family of rows; inputs by the ONNX graph's names."""
    F = torch.nn.functional
    sdpa = F.scaled_dot_product_attention
    sm = torch.softmax

    if family == "gqa":
        return {
            "eager": (_same, lambda d: sm(d["Q"] @ d["K"], -1) @ d["V"]),
            "sdpa": (
                lambda d: {
                    "q": d["Q"][None],
                    "k": d["K"].transpose(1, 2).contiguous()[None],
                    "v": d["V"][None],
                },
                lambda d: sdpa(d["q"], d["k"], d["v"], scale=1.0)[0],
            ),
        }
    if family == "qknorm_gqa":
        return {
            "eager": (
                _same,
                lambda d: (
                    sm(_rms(torch, d["Q"], d["gamma_q"]) @ d["K"], -1)
                    @ _rms(torch, d["V"], d["gamma_v"])
                ),
            ),
            "sdpa": (
                lambda d: {**d, "kt": d["K"].transpose(1, 2).contiguous()},
                lambda d: sdpa(
                    _rms(torch, d["Q"], d["gamma_q"])[None],
                    d["kt"][None],
                    _rms(torch, d["V"], d["gamma_v"])[None],
                    scale=1.0,
                )[0],
            ),
        }
    if family == "qknorm_real":
        eps = _f32(EPS_RMS)
        return {
            "eager": (
                _same,
                lambda d: (
                    sm(
                        _rms(torch, d["Q"], d["gamma_q"], eps)
                        @ _rms(torch, d["K"].transpose(1, 2), d["gamma_k"], eps).transpose(1, 2),
                        -1,
                    )
                    @ d["V"]
                ),
            ),
            "sdpa": (
                lambda d: {**d, "kt": d["K"].transpose(1, 2).contiguous()},
                lambda d: sdpa(
                    _rms(torch, d["Q"], d["gamma_q"], eps)[None],
                    _rms(torch, d["kt"], d["gamma_k"], eps)[None],
                    d["V"][None],
                    scale=1.0,
                )[0],
            ),
        }
    if family == "rmsnorm_linear":
        return {"eager": (_same, lambda d: _rms(torch, d["X"], d["gamma"]) @ d["W"])}
    if family == "lora":
        return {"eager": (_same, lambda d: d["X"] @ d["W"] + (d["X"] @ d["A"]) @ d["B"])}
    if family == "gated_mlp":
        return {"eager": (_same, lambda d: F.silu(d["X"] @ d["W1"]) * (d["X"] @ d["W2"]))}
    if family == "swiglu_down":
        return {
            "eager": (_same, lambda d: (F.silu(d["X"] @ d["W1"]) * (d["X"] @ d["W2"])) @ d["W3"])
        }
    if family == "ntrans":
        return {
            "eager": (
                _same,
                lambda d: _rms(
                    torch,
                    _rms(torch, d["H"], d["gamma_h"]) + d["X"] * d["alpha"] + d["X"],
                    d["gamma_o"],
                ),
            )
        }
    if family == "mla":

        def mla_eager(d: dict[str, Any]) -> Any:
            scale = float(np.float16(_mla_scale(d["K_pe"].shape[-1])))
            c = d["C"]
            s = (d["Q_nope"] @ c.transpose(1, 2) + d["Q_pe"] @ d["K_pe"].transpose(1, 2)) * scale
            return sm(s, -1) @ c

        def mla_prepare(d: dict[str, Any]) -> dict[str, Any]:
            kc = torch.cat([d["C"], d["K_pe"]], -1)  # (b, t, r + p): the cache SDPA reads
            r = d["C"].shape[-1]
            return {**d, "k": kc[:, None], "v": kc[:, None, :, :r]}

        def mla_sdpa(d: dict[str, Any]) -> Any:
            # the heads are the queries of one token: they share every key and value
            q = torch.cat([d["Q_nope"], d["Q_pe"]], -1)[:, None]
            scale = 1.0 / math.sqrt(3 * d["K_pe"].shape[-1])
            return sdpa(q, d["k"], d["v"], scale=scale)[:, 0]

        return {"eager": (_same, mla_eager), "sdpa": (mla_prepare, mla_sdpa)}
    if family == "layernorm_linear":
        return {
            "eager": (
                _same,
                lambda d: (
                    F.layer_norm(d["X"], d["X"].shape[-1:], d["gamma"], d["beta"], EPS_NORM)
                    @ d["W"]
                ),
            )
        }
    if family == "groupnorm_linear":
        # in_scale / in_bias are torch.onnx's unit InstanceNormalization parameters (ones, zeros)
        return {
            "eager": (
                _same,
                lambda d: (
                    F.group_norm(d["X"], d["in_scale"].shape[0], d["gamma"], d["beta"], EPS_NORM)
                    @ d["W"]
                ),
            )
        }
    if family == "batchnorm_linear":
        return {
            "eager": (
                _same,
                lambda d: F.linear(
                    F.batch_norm(
                        d["X"],
                        d["bn_mean"],
                        d["bn_var"],
                        d["bn_scale"],
                        d["bn_bias"],
                        False,
                        0.0,
                        EPS_NORM,
                    ),
                    d["W"],
                ),
            )
        }
    if family == "rms_linear_silu":
        return {"eager": (_same, lambda d: F.silu(_rms(torch, d["X"], d["gamma"]) @ d["W"]))}
    if family == "ln_linear_gelu":
        return {
            "eager": (
                _same,
                lambda d: F.gelu(
                    torch.addmm(
                        d["bias"],
                        F.layer_norm(d["X"], d["X"].shape[-1:], d["gamma"], d["beta"], EPS_NORM),
                        d["W"],
                    )
                ),
            )
        }
    if family == "rms_qkv":

        def qkv(d: dict[str, Any]) -> Any:
            xn = _rms(torch, d["X"], d["gamma"])
            return xn @ d["Wq"], xn @ d["Wk"], xn @ d["Wv"]

        return {"eager": (_same, qkv)}
    if family == "gqa_decode":

        def grouped(d: dict[str, Any]) -> Any:
            b, h, _, dh = d["Q"].shape
            kvh = d["K"].shape[1]
            return d["Q"].reshape(b, kvh, h // kvh, dh)  # a KV head's query heads as its queries

        def dec_eager(d: dict[str, Any]) -> Any:
            q = grouped(d)
            s = (q @ d["K"].transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
            return (sm(s, -1) @ d["V"]).reshape(d["Q"].shape)

        def dec_sdpa(d: dict[str, Any]) -> Any:
            q = grouped(d)
            return sdpa(q, d["K"], d["V"], scale=1.0 / math.sqrt(q.shape[-1])).reshape(d["Q"].shape)

        return {"eager": (_same, dec_eager), "sdpa": (_same, dec_sdpa)}
    raise KeyError(f"no peers for family {family!r}")


# --------------------------------------------------------------------------------------
# GPU measurement
# --------------------------------------------------------------------------------------


class _Timeout(Exception):
    pass


@contextlib.contextmanager
def _alarm(seconds: float) -> Iterator[None]:
    """Raise _Timeout in this (main) thread after `seconds` (torch.compile's per-row limit)."""

    def fire(*_: Any) -> None:
        raise _Timeout(f"over {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _rel(a: Any, b: Any) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _outputs(out: Any) -> list[Any]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


_NP = {"float16": np.float16, "bfloat16": np.float32, "float32": np.float32}
"""Upload dtype of a lifted constant by the program input's dtype (bf16 constants are not lifted
by these rows)."""


def baseline_program(model: onnx.ModelProto) -> tuple[Any, dict[str, np.ndarray]] | None:
    """The row's library baseline: the lifted program of its one region (cuBLASLt GEMMs plus
    generated kernels for the rest, the candidate `optimize --gpu` times beside the searched
    ones) and its lifted constants; None when lifting makes more or fewer than one region."""
    import tempfile

    from mlso_cli.frontend.analyse import analyse
    from mlso_cli.frontend.load import load_model

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "row.onnx"
        onnx.save(model, str(path))
        lifted = analyse(load_model(str(path), {})).lifted
    if len(lifted) != 1:
        return None
    return lifted[0].graph, dict(lifted[0].extra_inputs)


class Measurer:
    """One process's GPU state: torch, the device's peaks, and the per-row measurements."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        self.torch = torch
        self.args = args
        torch.cuda.init()
        self.device = torch.cuda.get_device_name(0)
        self.dram_bps = dram_peak(self.device)

    def inputs(self, model: onnx.ModelProto, seed: int) -> dict[str, Any]:
        """Graph inputs random normal fp16 (a variance uniform in [0.5, 1.5)), weights given as
        graph inputs ("W..." of two or more dims, models/realwidth.py) scaled by 1/sqrt(fan-in)
        as a trained layer's are, initializers as the model holds them, all on the GPU. Why the
        scale: unit weights overflowed fp16 in swiglu_down (an 8192-long down projection of
        ~2000-sized SwiGLU values), in mlso and every peer alike, and no output could be
        compared (the twenty-eighth session's H100 run)."""
        torch = self.torch
        gen = torch.Generator(device="cuda").manual_seed(seed)
        out: dict[str, Any] = {}
        for vi in model.graph.input:
            shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
            if "var" in vi.name:
                t = torch.rand(shape, generator=gen, device="cuda") + 0.5
            else:
                t = torch.randn(shape, generator=gen, device="cuda")
                if vi.name.startswith("W") and len(shape) >= 2:
                    t = t / math.sqrt(shape[-2])
            out[vi.name] = t.half()
        for init in model.graph.initializer:
            arr = numpy_helper.to_array(init)
            if arr.dtype == np.float16:
                out[init.name] = torch.from_numpy(arr.copy()).cuda()
        return out

    def measure(self, row: Row) -> dict[str, Any]:
        """First pass: mlso, eager, SDPA; the row dict (summarised)."""
        from mlso_cli.ir import serialize
        from mlso_cli.runtime.launcher import operand_sets

        torch = self.torch
        model = row.build()
        nbytes, flops = model_cost(model)
        res: dict[str, Any] = {
            "name": row.name,
            "cls": row.cls,
            "family": row.family,
            "bytes": nbytes,
            "flops": flops,
            "dram_bps": self.dram_bps,
            "tensor_flops": TENSOR_FLOPS,
            "peers_us": {},
            "agree": {},
            "disagree": [],
            "notes": [],
        }
        base = self.inputs(model, seed=0)
        in_bytes = sum(t.numel() * t.element_size() for t in base.values())
        sets = [base] + [
            {k: v.clone() for k, v in base.items()} for _ in range(operand_sets(in_bytes) - 1)
        ]
        res["peer_sets"] = len(sets)
        mlso_out: list[np.ndarray] | None = None
        timed: dict[str, tuple[float, int, list[np.ndarray]]] = {}
        try:
            kg = serialize.loads(row.program.read_text())
            timed["searched"] = self._time_program(res, kg, None, base, model, "compile_s")
        except Exception as exc:  # the baseline and the peers are still measured
            res["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            traceback.print_exc()
        try:
            lifted = baseline_program(model)
            if lifted is None:
                res["notes"].append("no library baseline: the model is not one region")
            else:
                kg_b, consts = lifted
                timed["baseline"] = self._time_program(res, kg_b, consts, base, model, None)
        except Exception as exc:
            res["notes"].append(f"library baseline failed: {type(exc).__name__}: {str(exc)[:120]}")
            traceback.print_exc()
        for which, (us, launches, _) in timed.items():
            res[f"{which}_us"] = us
            res[f"{which}_launches"] = launches
        if timed:
            pick = min(timed, key=lambda k: timed[k][0])
            res["mlso_pick"] = pick
            res["mlso_us"], res["launches"], mlso_out = timed[pick]
            if "error" in res:  # the baseline stands in: the row says what failed
                res["notes"].insert(0, f"searched program failed: {res.pop('error')}")
            if len(timed) == 2:
                a, b = (timed[k][2] for k in ("searched", "baseline"))
                res["candidates_rel"] = max(_rel(x, y) for x, y in zip(a, b))
        for name, (prepare, fn) in peer_family(torch, row.family).items():
            self._peer(res, name, [prepare(s) for s in sets], fn, mlso_out)
        res["_sets"] = sets  # for the compile pass; dropped before JSON
        res["_mlso_out"] = mlso_out
        return summarise(res)

    def _time_program(
        self,
        res: dict[str, Any],
        kg: Any,
        constants: dict[str, np.ndarray] | None,
        base: dict[str, Any],
        model: onnx.ModelProto,
        compile_key: str | None,
    ) -> tuple[float, int, list[np.ndarray]]:
        """(median µs, launches, outputs in the model's order) of one mlso program: compiled
        (with the region's lifted constants, as optimize builds it), timed by the launcher, run
        once on the base inputs. Lifted constants the model does not hold are uploaded."""
        from mlso_cli.codegen import compile_program
        from mlso_cli.runtime.launcher import Program

        torch = self.torch
        t0 = time.time()
        cp = compile_program(kg, constants=constants)
        if compile_key:
            res[compile_key] = round(time.time() - t0, 2)
        feeds = dict(base)
        for n, name in zip(kg.inputs, kg.input_names):
            if name not in feeds and constants and name in constants:
                arr = np.ascontiguousarray(np.asarray(constants[name]).astype(_NP[n.dtype.value]))
                feeds[name] = torch.from_numpy(arr).cuda()
        missing = [n for n in kg.input_names if n not in feeds]
        if missing:
            raise ValueError(f"program inputs {missing} are not in the model")
        with Program(cp.fatbin, cp.plan, device=0) as prog:
            t = prog.time(warmup=10, repeats=self.args.repeats, iters=self.args.iters)
            res["mlso_method"] = t.method
            res["mlso_sets"] = t.rotated_sets
            torch.cuda.synchronize()
            outs = prog.run([feeds[n].data_ptr() for n in kg.input_names])
            got = dict(zip(kg.output_names, outs))
            if t.note:
                res["notes"].append(t.note)
        return t.median_us, len(cp.plan["launches"]), [got[o.name] for o in model.graph.output]

    def _peer(
        self,
        res: dict[str, Any],
        name: str,
        prepared: list[dict[str, Any]],
        fn: Callable[[dict[str, Any]], Any],
        mlso_out: list[np.ndarray] | None,
    ) -> None:
        torch = self.torch
        try:
            with torch.no_grad():
                if mlso_out is not None:
                    outs = _outputs(fn(prepared[0]))
                    torch.cuda.synchronize()
                    rel = max(_rel(o.float().cpu().numpy(), m) for o, m in zip(outs, mlso_out))
                    res["agree"][name] = rel
                    if not rel <= AGREE_REL:
                        res["disagree"].append(name)
                calls = [lambda d=d: fn(d) for d in prepared]
                us, wall = graph_time_us(torch, calls, self.args.iters, self.args.repeats)
            if us < 0.7 * wall:
                res["notes"].append(
                    f"{PEER_LABEL[name]}: events {us:.2f} µs against {wall:.2f} µs wall per call"
                )
            res["peers_us"][name] = us
        except Exception as exc:
            res["notes"].append(
                f"{PEER_LABEL[name]} failed: {type(exc).__name__}: {str(exc)[:120]}"
            )
            traceback.print_exc()

    def add_compile(self, res: dict[str, Any], timeout_s: float) -> None:
        """Second pass: torch.compile of the eager function, compiled under a time limit."""
        torch = self.torch
        _, eager = peer_family(torch, res["family"])["eager"]
        names = list(res["_sets"][0])

        def positional(*ts: Any) -> Any:
            return eager(dict(zip(names, ts)))

        compiled = torch.compile(positional, dynamic=False)
        sets = res["_sets"]
        try:
            t0 = time.time()
            with _alarm(timeout_s), torch.no_grad():
                compiled(*sets[0].values())
                torch.cuda.synchronize()
            res["compile_peer_s"] = round(time.time() - t0, 1)
        except _Timeout as exc:
            res["notes"].append(f"torch.compile not timed: compiling took {exc}")
            with contextlib.suppress(Exception):
                torch._dynamo.reset()
            return
        except Exception as exc:
            res["notes"].append(f"torch.compile failed: {type(exc).__name__}: {str(exc)[:120]}")
            return
        self._peer(
            res,
            "compile",
            [dict(s) for s in sets],
            lambda d: compiled(*d.values()),
            res["_mlso_out"],
        )
        summarise(res)


def _public(res: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in res.items() if not k.startswith("_")}


def _write(path: Path | None, device: str, results: list[dict[str, Any]]) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"device": device, "results": [_public(r) for r in results]}
    path.write_text(json.dumps(body, indent=1, default=str) + "\n")


def record(results: list[dict[str, Any]], machine: str) -> Path:
    from benchmarks import results_table

    return results_table.append(TABLE, [(r["name"], figures(r)) for r in results], machine)


def compile_baseline(row: Row) -> None:
    """nvcc-compile the row's library baseline into the cache, as `_time_program` builds it."""
    from mlso_cli.codegen import compile_program

    lifted = baseline_program(row.build())
    if lifted is not None:
        compile_program(lifted[0], constants=lifted[1])


def _compile_one(name: str) -> tuple[str, float, str]:
    """Generate and nvcc-compile one row's program into the cache: (name, seconds, error)."""
    from mlso_cli.codegen import compile_program
    from mlso_cli.ir import serialize

    row = next(r for r in rows() if r.name == name)
    t0 = time.time()
    try:
        compile_program(serialize.loads(row.program.read_text()))
        compile_baseline(row)
        return name, time.time() - t0, ""
    except Exception as exc:
        return name, time.time() - t0, f"{type(exc).__name__}: {str(exc)[:200]}"


def prebuild(names: list[str], jobs: int) -> None:
    """Compile every row's program in `jobs` processes before anything touches the GPU (a
    carried cache makes each one a lookup; a miss costs nvcc seconds that the rows then do not
    pay one after another). Failures are reported here and again when the row is measured."""
    import concurrent.futures as cf
    import multiprocessing as mp

    t0 = time.time()
    with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("fork")) as pool:
        for name, secs, err in pool.map(_compile_one, names):
            if err or secs > 5:
                print(f"prebuild {name}: {secs:.1f} s {err}", file=sys.stderr, flush=True)
    print(
        f"prebuild: {len(names)} programs in {time.time() - t0:.1f} s", file=sys.stderr, flush=True
    )


def cmd_run(args: argparse.Namespace) -> int:
    start = time.monotonic()
    try:
        import torch
    except ImportError as exc:
        print(f"hopper_table: skipped, torch is not importable ({exc})", file=sys.stderr)
        return 0
    if not torch.cuda.is_available():
        print(
            "hopper_table: skipped, no CUDA device (torch.cuda.is_available() is False)",
            file=sys.stderr,
        )
        return 0
    todo = select(rows(), args.rows)
    if args.prebuild_jobs > 0:
        prebuild([r.name for r in todo], args.prebuild_jobs)
    m = Measurer(args)
    machine = args.machine or f"{m.device} (device machine), torch {torch.__version__}"
    print(
        f"{m.device}: DRAM peak {m.dram_bps / 1e12:.2f} TB/s, tensor {TENSOR_FLOPS / 1e12:.0f} TFLOP/s; {len(todo)} rows",
        flush=True,
    )
    print(markdown_head(), flush=True)
    results: list[dict[str, Any]] = []
    for row in todo:
        if time.monotonic() - start > args.deadline_s:
            print(
                f"| {row.name} | not measured: past the {args.deadline_s:.0f} s deadline |",
                flush=True,
            )
            continue
        try:
            res = m.measure(row)
        except Exception as exc:  # the model or its inputs: the other rows still run
            traceback.print_exc()
            print(f"| {row.name} | FAILED: {type(exc).__name__}: {str(exc)[:160]} |", flush=True)
            continue
        results.append(res)
        print(markdown_row(res), flush=True)
        _write(args.json, m.device, results)
    if args.compile:
        print("\ntorch.compile pass\n\n" + markdown_head(), flush=True)
        for res in results:
            left = args.deadline_s - (time.monotonic() - start)
            if left < min(args.compile_timeout_s, 20.0):
                res["notes"].append("torch.compile not run: the run's deadline")
                continue
            m.add_compile(res, min(args.compile_timeout_s, left))
            print(markdown_row(res), flush=True)
            _write(args.json, m.device, results)
        _write(args.json, m.device, results)
    print(f"\n{m.device}, {time.strftime('%Y-%m-%d')}\n\n{markdown_head()}")
    for res in results:
        print(markdown_row(res))
    if args.record and results:
        print(f"recorded: {record(results, machine)}", file=sys.stderr)
    return 1 if any(r.get("error") for r in results) else 0


# --------------------------------------------------------------------------------------
# CPU commands
# --------------------------------------------------------------------------------------


def cmd_compile(args: argparse.Namespace) -> int:
    """Generate and nvcc-compile every row's program into MLSO_CACHE_DIR (no GPU needed)."""
    from mlso_cli.codegen import compile_program
    from mlso_cli.ir import serialize

    bad = 0
    for row in select(rows(), args.rows):
        t0 = time.time()
        try:
            compile_program(serialize.loads(row.program.read_text()))
            compile_baseline(row)
            print(f"{row.name}: compiled in {time.time() - t0:.1f} s", flush=True)
        except Exception as exc:
            bad += 1
            print(f"{row.name}: FAILED {type(exc).__name__}: {exc}", flush=True)
    return 1 if bad else 0


def cmd_list(args: argparse.Namespace) -> int:
    dram = dram_peak(args.device)
    print(
        f"| row | class | program | MB | GFLOP | floor µs on {args.device} |\n|---|---|---|---|---|---|"
    )
    for row in select(rows(), args.rows):
        nbytes, flops = model_cost(row.build())
        present = "yes" if row.program.is_file() else "MISSING"
        cls = "benchmark row" if row.cls == "benchmark" else CLASSES[row.cls]
        print(
            f"| {row.name} | {cls} | {present} | {nbytes / 1e6:.1f} | {flops / 1e9:.3f} | "
            f"{floor_us(nbytes, flops, dram):.2f} |"
        )
    return 0


def cmd_record(args: argparse.Namespace) -> int:
    data = json.loads(args.file.read_text())
    results = [summarise(r) for r in data["results"]]
    print(f"recorded {len(results)} rows: {record(results, args.machine)}")
    return 0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="measure on the GPU")
    run.add_argument("--rows", default="", help="comma-separated names or globs (default: all)")
    run.add_argument("--json", type=Path, default=None, help="rewrite this JSON after every row")
    run.add_argument("--record", action="store_true", help="append records at the end")
    run.add_argument("--machine", default="", help="the records' machine (default: device, torch)")
    run.add_argument("--compile", action="store_true", help="also time torch.compile per row")
    run.add_argument("--compile-timeout-s", type=float, default=60.0)
    run.add_argument(
        "--deadline-s",
        type=float,
        default=480.0,
        help="start no row, and no compile, past this many seconds from the start",
    )
    run.add_argument(
        "--prebuild-jobs",
        type=int,
        default=8,
        help="compile the programs in this many processes first (0: each when measured)",
    )
    run.add_argument("--repeats", type=int, default=5)
    run.add_argument("--iters", type=int, default=200)
    comp = sub.add_parser("compile", help="fill the nvcc cache (MLSO_CACHE_DIR) on a CPU machine")
    comp.add_argument("--rows", default="")
    lst = sub.add_parser("list", help="rows, bytes, FLOPs and floors (no GPU)")
    lst.add_argument("--rows", default="")
    lst.add_argument("--device", default="NVIDIA H200", help="device name for the DRAM peak")
    rec = sub.add_parser("record", help="append the records of a saved --json file")
    rec.add_argument("file", type=Path)
    rec.add_argument("--machine", required=True)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    return {"run": cmd_run, "compile": cmd_compile, "list": cmd_list, "record": cmd_record}[
        args.cmd
    ](args)


if __name__ == "__main__":
    sys.exit(main())
