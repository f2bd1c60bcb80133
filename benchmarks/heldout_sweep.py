"""The search on HELD-OUT subgraphs: variants of the benchmark models that nobody tuned for.

Each model below is a small-to-moderate fp16 ONNX graph with static shapes, written with
onnx.helper in the conventions of models/build_models.py (big matrices as graph inputs, norm
parameters and biases as initializers), but spelled or shaped differently from anything in
SPECS: LayerNorm + GELU(Erf), RMSNorm + ReLU, GeGLU, gated MLP with biases, SwiGLU with its
down projection, attention with a transposed K and a 1/sqrt(d) scale, attention with an
additive mask, multi-query attention through a Reshape, LoRA with a scaling constant, and a
norm + linear over a 3-D input.

For each one this runs, in a subprocess, one model after another (as a user would)::

    python -m mlso_cli.cli optimize MODEL --dry-run --json --jobs 1 --no-cache --budget S

with a fresh MLSO_CACHE_DIR, and also ``mlso inspect MODEL --json`` (fast) to list the nodes
that no region took. It collects rc, wall seconds and, per region, the program's kernels,
estimate_us vs onnx_estimate_us, packaged, states, verified, search_s and notes.

    .venv/bin/python -m benchmarks.heldout_sweep [--only NAME] [--budget S] [--out FILE.json]
        [--mlso-root DIR] [--keep-models DIR] [--build-only] [--table-from FILE.json]

--mlso-root runs mlso from another checkout: the search is edited in this work tree while a
sweep runs for half an hour, so a sweep that must measure one commit runs from a snapshot
(``git archive HEAD | tar -x -C DIR``).

Prints a Markdown table on stdout and, with --out, saves every row as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from models.build_models import (  # noqa: E402
    EPS_NORM,
    EPS_RMS,
    OPSET,
    _f32,
    _Graph,
    _rms_mul_recip,
    _rms_pow_div,
)

#: seconds for one model's optimize subprocess (all its regions together)
TIMEOUT_S = 420.0
#: --budget per region, in seconds
BUDGET_S = 300.0

F16 = onnx.TensorProto.FLOAT16


# --------------------------------------------------------------------------------------
# spelling helpers
# --------------------------------------------------------------------------------------


def _gelu_erf(g: _Graph, x: str, out: str | None = None) -> str:
    """0.5 * x * (1 + Erf(x / sqrt(2))), as torch.onnx writes nn.GELU() (exact form)."""
    e = g.op("Erf", g.op("Div", x, g.scalar_const(f"sqrt2_{g._count}", math.sqrt(2.0))))
    one_plus = g.op("Add", e, g.scalar_const(f"one_{g._count}", 1.0))
    half = g.scalar_const(f"half_{g._count}", 0.5)
    return g.op("Mul", g.op("Mul", x, one_plus), half, out=out)


def _silu(g: _Graph, x: str) -> str:
    return g.op("Mul", x, g.op("Sigmoid", x))


# --------------------------------------------------------------------------------------
# the held-out models
# --------------------------------------------------------------------------------------


def ln_gelu(g: _Graph) -> str:
    """1. O = GELU_erf(LayerNormalization(X; gamma, beta)·W); X(8,2048) W(2048,2048)."""
    rows, h, n = 8, 2048, 2048
    x = g.input("X", (rows, h))
    w = g.input("W", (h, n))
    y = g.op(
        "LayerNormalization",
        x,
        g.param("gamma", (h,), "scale"),
        g.param("beta", (h,), "shift"),
        axis=-1,
        epsilon=_f32(EPS_NORM),
    )
    _gelu_erf(g, g.op("MatMul", y, w), out="O")
    g.output("O", (rows, n))
    return "LayerNormalization + MatMul + GELU(Erf)"


def rms_relu(g: _Graph) -> str:
    """2. O = ReLU(RMSNorm_pow_div(X)·W); X(4,4096) W(4096,4096)."""
    rows, h, n = 4, 4096, 4096
    x = g.input("X", (rows, h))
    w = g.input("W", (h, n))
    axes = g.ints("axes_last", [-1])
    two = g.scalar_const("two", 2.0)
    eps = g.scalar_const("eps", EPS_RMS)
    xn = _rms_pow_div(g, x, g.param("gamma", (h,), "scale"), axes, two, eps)
    g.op("Relu", g.op("MatMul", xn, w), out="O")
    g.output("O", (rows, n))
    return "RMSNorm(Pow/ReduceMean/Sqrt/Div) + MatMul + Relu"


def geglu(g: _Graph) -> str:
    """3. O = GELU_erf(X·W1) ⊙ (X·W2); X(8,2048) W1,W2(2048,4096)."""
    rows, h, f = 8, 2048, 4096
    x = g.input("X", (rows, h))
    w1 = g.input("W1", (h, f))
    w2 = g.input("W2", (h, f))
    gate = _gelu_erf(g, g.op("MatMul", x, w1))
    g.op("Mul", gate, g.op("MatMul", x, w2), out="O")
    g.output("O", (rows, f))
    return "GeGLU: GELU(Erf)(X·W1) * X·W2"


def gated_mlp_bias(g: _Graph) -> str:
    """4. O = SiLU(X·W1 + b1) ⊙ (X·W2 + b2); X(8,2048) W1,W2(2048,4096), b as initializers."""
    rows, h, f = 8, 2048, 4096
    x = g.input("X", (rows, h))
    w1 = g.input("W1", (h, f))
    w2 = g.input("W2", (h, f))
    gate = g.op("Add", g.op("MatMul", x, w1), g.param("b1", (f,), "shift"))
    up = g.op("Add", g.op("MatMul", x, w2), g.param("b2", (f,), "shift"))
    g.op("Mul", _silu(g, gate), up, out="O")
    g.output("O", (rows, f))
    return "gated MLP with biases: SiLU(X·W1+b1) * (X·W2+b2)"


def swiglu_down(g: _Graph) -> str:
    """5. O = (SiLU(X·W1) ⊙ (X·W2))·W3; X(4,2048) W1,W2(2048,4096) W3(4096,2048)."""
    rows, h, f = 4, 2048, 4096
    x = g.input("X", (rows, h))
    w1 = g.input("W1", (h, f))
    w2 = g.input("W2", (h, f))
    w3 = g.input("W3", (f, h))
    hid = g.op("Mul", _silu(g, g.op("MatMul", x, w1)), g.op("MatMul", x, w2))
    g.op("MatMul", hid, w3, out="O")
    g.output("O", (rows, h))
    return "SwiGLU MLP with down projection: (SiLU(X·W1)*(X·W2))·W3"


def attn_ktrans(g: _Graph) -> str:
    """6. O = Softmax(Q·Transpose(K) * 1/sqrt(d))·V; Q(4,128,64) K,V(4,1024,64)."""
    gr, q, d, n = 4, 128, 64, 1024
    qi = g.input("Q", (gr, q, d))
    k = g.input("K", (gr, n, d))
    v = g.input("V", (gr, n, d))
    s = g.op("MatMul", qi, g.op("Transpose", k, perm=[0, 2, 1]))
    s = g.op("Mul", s, g.scalar_init("scale", 1.0 / math.sqrt(d)))
    g.op("MatMul", g.op("Softmax", s, axis=-1), v, out="O")
    g.output("O", (gr, q, d))
    return "attention, K as (g,n,d) -> Transpose -> MatMul, Mul(1/sqrt(d)), Softmax"


def attn_mask(g: _Graph) -> str:
    """7. O = Softmax(Q·K + M)·V; Q(4,128,64) K(4,64,1024) V(4,1024,64) M(1,128,1024) input."""
    gr, q, d, n = 4, 128, 64, 1024
    qi = g.input("Q", (gr, q, d))
    k = g.input("K", (gr, d, n))
    v = g.input("V", (gr, n, d))
    m = g.input("M", (1, q, n))
    s = g.op("Add", g.op("MatMul", qi, k), m)
    g.op("MatMul", g.op("Softmax", s, axis=-1), v, out="O")
    g.output("O", (gr, q, d))
    return "attention with additive mask input M(1,q,n) broadcast over groups, Add before Softmax"


def mqa(g: _Graph) -> str:
    """8. Multi-query attention: Q(2,8,16,64) -> Reshape (2,128,64); one KV head K(2,64,1024),
    V(2,1024,64) shared by the 8 query heads; scale 1/sqrt(64); O reshaped back to (2,8,16,64)."""
    b, heads, q, d, n = 2, 8, 16, 64, 1024
    qi = g.input("Q", (b, heads, q, d))
    k = g.input("K", (b, d, n))
    v = g.input("V", (b, n, d))
    qf = g.op("Reshape", qi, g.ints("q_flat", [b, heads * q, d]))
    s = g.op("Mul", g.op("MatMul", qf, k), g.scalar_init("scale", 1.0 / math.sqrt(d)))
    o = g.op("MatMul", g.op("Softmax", s, axis=-1), v)
    g.op("Reshape", o, g.ints("o_shape", [b, heads, q, d]), out="O")
    g.output("O", (b, heads, q, d))
    return "MQA: 8 query heads Reshape'd onto 1 KV head, scale Mul, Softmax"


def lora_scaled(g: _Graph) -> str:
    """9. O = X·W + s * ((X·A)·B), s = 2.0 (alpha/r) as an initializer; X(16,1024)
    W(1024,4096) A(1024,16) B(16,4096)."""
    rows, k, r, n = 16, 1024, 16, 4096
    x = g.input("X", (rows, k))
    w = g.input("W", (k, n))
    a = g.input("A", (k, r))
    b = g.input("B", (r, n))
    low = g.op("MatMul", g.op("MatMul", x, a), b)
    scaled = g.op("Mul", low, g.scalar_init("lora_scale", 2.0))
    g.op("Add", g.op("MatMul", x, w), scaled, out="O")
    g.output("O", (rows, n))
    return "LoRA with scaling: X·W + s*(X·A)·B"


def norm3d_linear(g: _Graph) -> str:
    """10. O = RMSNorm_mul_recip(X)·W over the last dim of X(2,8,2048); W(2048,2048)."""
    b, t, h, n = 2, 8, 2048, 2048
    x = g.input("X", (b, t, h))
    w = g.input("W", (h, n))
    axes = g.ints("axes_last", [-1])
    eps = g.scalar_init("eps", EPS_RMS)
    xn = _rms_mul_recip(g, x, g.param("gamma", (h,), "scale"), axes, eps)
    g.op("MatMul", xn, w, out="O")
    g.output("O", (b, t, n))
    return "RMSNorm(Mul/Reciprocal) over last dim of 3-D X(b,t,h) + MatMul"


def causal_gqa_prefill(g: _Graph) -> str:
    """11. Prefill attention as a decoder export writes it once its mask is folded: Q(1,14,128,64),
    K,V(1,2,128,64) repeated to 14 heads (Unsqueeze/Expand/Reshape), scale Mul, an additive
    causal mask constant (1,1,128,128) of 0/-inf, Softmax, MatMul (Qwen2.5-0.5B's heads)."""
    h, kvh, s, d = 14, 2, 128, 64
    q = g.input("Q", (1, h, s, d))
    kv = [g.input(n, (1, kvh, s, d)) for n in ("K", "V")]
    rep = []
    for name, x in zip("kv", kv, strict=True):
        u = g.op("Unsqueeze", x, g.ints(f"{name}_axis", [2]))
        e = g.op("Expand", u, g.ints(f"{name}_expand", [1, kvh, h // kvh, s, d]))
        rep.append(g.op("Reshape", e, g.ints(f"{name}_heads", [1, h, s, d])))
    kt = g.op("Transpose", rep[0], perm=[0, 1, 3, 2])
    sc = g.op("Mul", g.op("MatMul", q, kt), g.scalar_init("scale", 1.0 / math.sqrt(d)))
    mask = np.triu(np.full((s, s), -np.inf, dtype=np.float32), 1).reshape(1, 1, s, s)
    g.inits.append(numpy_helper.from_array(mask.astype(g.np_dtype), "causal_mask"))
    p = g.op("Softmax", g.op("Add", sc, "causal_mask"), axis=-1)
    g.op("MatMul", p, rep[1], out="O")
    g.output("O", (1, h, s, d))
    return "causal GQA prefill, 14 heads on 2 KV heads, seq 128, additive constant causal mask"


MODELS: dict[str, Callable[[_Graph], str]] = {
    f.__name__: f
    for f in (
        ln_gelu,
        rms_relu,
        geglu,
        gated_mlp_bias,
        swiglu_down,
        attn_ktrans,
        attn_mask,
        mqa,
        lora_scaled,
        norm3d_linear,
        causal_gqa_prefill,
    )
}


def build(name: str) -> tuple[onnx.ModelProto, str]:
    g = _Graph(F16)
    what = MODELS[name](g)
    model = g.model(f"heldout_{name}", OPSET, f"mlso held-out sweep model {name}: {what}")
    onnx.checker.check_model(model, full_check=True)
    return model, what


# --------------------------------------------------------------------------------------
# running
# --------------------------------------------------------------------------------------

REGION_KEYS = (
    "region",
    "label",
    "kernels",
    "estimate_us",
    "onnx_estimate_us",
    "packaged",
    "searched",
    "partial",
    "states",
    "pruned",
    "verified",
    "candidates",
    "search_s",
    "why",
    "notes",
)


def _tail(text: str, n: int = 15) -> list[str]:
    return text.strip().splitlines()[-n:]


def run_model(
    name: str, budget: float, timeout: float, keep: Path | None, mlso_root: Path = ROOT
) -> dict:
    model, what = build(name)
    res: dict = {"name": name, "what": what, "nodes": len(model.graph.node)}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{name}.onnx"
        onnx.save(model, str(path))
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            onnx.save(model, str(keep / f"{name}.onnx"))
        env = {
            **os.environ,
            "MLSO_CACHE_DIR": str(Path(tmp) / "cache"),
            "PYTHONPATH": str(mlso_root),
        }
        base = [sys.executable, "-m", "mlso_cli.cli"]

        # inspect first (cheap): which nodes no region took
        try:
            r = subprocess.run(
                [*base, "inspect", str(path), "--json"],
                capture_output=True,
                text=True,
                timeout=120,
                cwd=mlso_root,
                env=env,
            )
            rows = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
            res["inspect_rc"] = r.returncode
            res["left_out"] = [
                {k: v for k, v in x.items() if k != "type"}
                for x in rows
                if x.get("type") == "left_out"
            ]
            res["inspect_regions"] = sum(x.get("type") == "region" for x in rows)
            if r.returncode != 0:
                res["inspect_stderr"] = _tail(r.stderr)
        except subprocess.TimeoutExpired:
            res["inspect_rc"] = "timeout"

        cmd = [
            *base,
            "optimize",
            str(path),
            "--dry-run",
            "--json",
            "--jobs",
            "1",
            "--no-cache",
            "--budget",
            str(budget),
        ]
        t0 = time.monotonic()
        try:
            r = subprocess.run(
                cmd, capture_output=True, text=True, timeout=timeout, cwd=mlso_root, env=env
            )
        except subprocess.TimeoutExpired as e:
            res.update(rc="timeout", wall_s=round(time.monotonic() - t0, 1), regions=[])
            err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
            res["stderr_tail"] = _tail(err)
            return res
        res["rc"] = r.returncode
        res["wall_s"] = round(time.monotonic() - t0, 1)
    rows = []
    for line in r.stdout.splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    res["regions"] = [{k: x.get(k) for k in REGION_KEYS} for x in rows if x.get("type") == "region"]
    res["summary"] = next((x for x in rows if x.get("type") == "summary"), None)
    if r.returncode != 0 or not res["regions"]:
        res["stderr_tail"] = _tail(r.stderr)
    return res


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def table(results: list[dict]) -> str:
    head = (
        "| model | rc | wall s | region | label | kernels | est µs | onnx µs | ratio | "
        "packaged | states | verified | search s | partial | left out | notes |"
    )
    lines = [head, "|" + "---|" * 16]
    for res in results:
        # Constant nodes are always "left out" (the regions read their values): not a finding
        left_out = [x for x in res.get("left_out", []) if x.get("category") != "constant"]
        left = ",".join(f"{x.get('op_type')}({x.get('category')})" for x in left_out) or "-"
        regions = res.get("regions") or [{}]
        for i, g in enumerate(regions):
            first = i == 0
            est, onnx_us = g.get("estimate_us"), g.get("onnx_estimate_us")
            ratio = f"{est / onnx_us:.2f}" if est and onnx_us else "-"
            notes = "; ".join(g.get("notes") or [])
            why = g.get("why")
            if why and not g.get("packaged"):
                notes = f"why: {why}; {notes}" if notes else f"why: {why}"
            if not g and res.get("stderr_tail"):
                notes = "stderr: " + " / ".join(res["stderr_tail"][-2:])
            notes = notes.replace("|", "/")[:300]
            lines.append(
                f"| {res['name'] if first else ''} | {res.get('rc') if first else ''} | "
                f"{res.get('wall_s', '-') if first else ''} | {g.get('region', '-')} | "
                f"{(g.get('label') or '-')[:40]} | {g.get('kernels', '-')} | {_fmt(est)} | "
                f"{_fmt(onnx_us)} | {ratio} | {g.get('packaged', '-')} | {g.get('states', '-')} | "
                f"{g.get('verified', '-')} | {_fmt(g.get('search_s'))} | {g.get('partial', '-')} | "
                f"{left if first else ''} | {notes} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", action="append", default=[], help=f"model names: {', '.join(MODELS)}")
    ap.add_argument("--budget", type=float, default=BUDGET_S, help="search budget per region, s")
    ap.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per model")
    ap.add_argument("--out", type=Path, default=None, help="write every row as JSON here")
    ap.add_argument("--keep-models", type=Path, default=None, help="also save the .onnx files here")
    ap.add_argument(
        "--mlso-root",
        type=Path,
        default=ROOT,
        help="run mlso_cli from this checkout (e.g. a `git archive` snapshot, so that edits in "
        "progress in this work tree do not leak into a long sweep); default: this repo",
    )
    ap.add_argument("--build-only", action="store_true", help="build and check the models only")
    ap.add_argument(
        "--table-from", type=Path, default=None, help="print the table of a saved --out JSON"
    )
    args = ap.parse_args()
    if args.table_from:
        print(table(json.loads(args.table_from.read_text())))
        return
    unknown = [n for n in args.only if n not in MODELS]
    if unknown:
        ap.error(f"unknown model(s) {unknown}; choose from {list(MODELS)}")
    names = [n for n in MODELS if not args.only or n in args.only]
    if args.build_only:
        for n in names:
            model, what = build(n)
            if args.keep_models:
                args.keep_models.mkdir(parents=True, exist_ok=True)
                onnx.save(model, str(args.keep_models / f"{n}.onnx"))
            print(f"{n}: {len(model.graph.node)} nodes, {what}")
        return
    results = []
    for n in names:
        res = run_model(n, args.budget, args.timeout, args.keep_models, args.mlso_root.resolve())
        results.append(res)
        print(table([res]).split("\n", 2)[2], file=sys.stderr, flush=True)
        if args.out:  # rewrite after every model: a sweep cut short keeps what it has
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
