"""Real-width subgraphs for issue 33's table (benchmarks/hopper_table.py), built without torch.

Why: the benchmark set (models/build_models.py SPECS) is Mirage's shapes. Issue 33's table also
asks for subgraphs at the widths of real checkpoints, one or more in each of these classes:
norm + linear + activation, gated MLPs with and without the down projection, a norm feeding
several projections, and latent and long-KV decode attention. Each builder below writes one
fp16 ONNX graph in the conventions of build_models.py (activations, weights and KV caches as
graph inputs; norm parameters and biases as initializers) and spells its math the way exporters
do (RMSNorm as torch.onnx writes it, SiLU as x·Sigmoid(x), GELU with Erf, GQA's KV heads repeated
by Unsqueeze/Expand/Reshape). Names say the shapes: t = tokens, h = hidden, n/f = output or
intermediate width, q/kv = projection widths, b = batch, kvh = KV heads, kv = cached tokens.

    python -m models.realwidth [--out DIR]     # writes DIR/<name>.onnx (default: print a list)
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import onnx

from models.build_models import (
    EPS_NORM,
    EPS_RMS,
    OPSET,
    _f32,
    _Graph,
    _mla_scale,
    _rms_pow_recip,
)

F16 = onnx.TensorProto.FLOAT16


def _silu(g: _Graph, x: str) -> str:
    return g.op("Mul", x, g.op("Sigmoid", x))


def _gelu_erf(g: _Graph, x: str, out: str | None = None) -> str:
    """0.5 * x * (1 + Erf(x / sqrt(2))), as torch.onnx writes nn.GELU()."""
    e = g.op("Erf", g.op("Div", x, g.scalar_const(f"sqrt2_{g._count}", math.sqrt(2.0))))
    one_plus = g.op("Add", e, g.scalar_const(f"one_{g._count}", 1.0))
    return g.op("Mul", g.op("Mul", x, one_plus), g.scalar_const(f"half_{g._count}", 0.5), out=out)


def _rms(g: _Graph, x: str, h: int) -> str:
    """LlamaRMSNorm as torch.onnx writes it: x * Reciprocal(Sqrt(eps + mean(x^2))) * gamma."""
    axes = g.ints("axes_last", [-1])
    two = g.scalar_const("two", 2.0)
    eps = g.scalar_const("eps", EPS_RMS)
    return _rms_pow_recip(g, x, g.param("gamma", (h,), "scale"), axes, two, eps)


@dataclass(frozen=True)
class RealWidth:
    """One real-width subgraph: its class in issue 33's list, what it is, and its builder."""

    name: str
    cls: str
    what: str
    graph: Callable[[_Graph], None]

    def build(self) -> onnx.ModelProto:
        g = _Graph(F16)
        self.graph(g)
        model = g.model(self.name, OPSET, f"mlso real-width subgraph {self.name}: {self.what}")
        onnx.checker.check_model(model, full_check=True)
        return model


def _rms_linear_silu(t: int, h: int, n: int) -> Callable[[_Graph], None]:
    def graph(g: _Graph) -> None:
        x = g.input("X", (t, h))
        w = g.input("W", (h, n))
        z = g.op("MatMul", _rms(g, x, h), w)
        g.op("Mul", z, g.op("Sigmoid", z), out="O")
        g.output("O", (t, n))

    return graph


def _ln_linear_gelu(t: int, h: int, n: int) -> Callable[[_Graph], None]:
    def graph(g: _Graph) -> None:
        x = g.input("X", (t, h))
        w = g.input("W", (h, n))
        y = g.op(
            "LayerNormalization",
            x,
            g.param("gamma", (h,), "scale"),
            g.param("beta", (h,), "shift"),
            axis=-1,
            epsilon=_f32(EPS_NORM),
        )
        z = g.op("Add", g.op("MatMul", y, w), g.param("bias", (n,), "shift"))
        _gelu_erf(g, z, out="O")
        g.output("O", (t, n))

    return graph


def _swiglu(t: int, h: int, f: int) -> Callable[[_Graph], None]:
    def graph(g: _Graph) -> None:
        x = g.input("X", (t, h))
        w1 = g.input("W1", (h, f))
        w2 = g.input("W2", (h, f))
        g.op("Mul", _silu(g, g.op("MatMul", x, w1)), g.op("MatMul", x, w2), out="O")
        g.output("O", (t, f))

    return graph


def _swiglu_down(t: int, h: int, f: int) -> Callable[[_Graph], None]:
    def graph(g: _Graph) -> None:
        x = g.input("X", (t, h))
        w1 = g.input("W1", (h, f))
        w2 = g.input("W2", (h, f))
        w3 = g.input("W3", (f, h))
        hid = g.op("Mul", _silu(g, g.op("MatMul", x, w1)), g.op("MatMul", x, w2))
        g.op("MatMul", hid, w3, out="O")
        g.output("O", (t, h))

    return graph


def _rms_qkv(t: int, h: int, q: int, kv: int) -> Callable[[_Graph], None]:
    def graph(g: _Graph) -> None:
        x = g.input("X", (t, h))
        ws = {"Q": g.input("Wq", (h, q)), "K": g.input("Wk", (h, kv)), "V": g.input("Wv", (h, kv))}
        xn = _rms(g, x, h)
        for out, w in ws.items():
            g.op("MatMul", xn, w, out=out)
            g.output(out, (t, q if out == "Q" else kv))

    return graph


def _mla_decode(b: int, heads: int, r: int, p: int, t: int) -> Callable[[_Graph], None]:
    """Absorbed MLA decode as models/build_models.py's mla row, at other widths."""

    def graph(g: _Graph) -> None:
        q_nope = g.input("Q_nope", (b, heads, r))
        q_pe = g.input("Q_pe", (b, heads, p))
        c = g.input("C", (b, t, r))
        k_pe = g.input("K_pe", (b, t, p))
        s_nope = g.op("MatMul", q_nope, g.op("Transpose", c, perm=[0, 2, 1]))
        s_pe = g.op("MatMul", q_pe, g.op("Transpose", k_pe, perm=[0, 2, 1]))
        s = g.op("Mul", g.op("Add", s_nope, s_pe), g.scalar_init("scale", _mla_scale(p)))
        g.op("MatMul", g.op("Softmax", s, axis=-1), c, out="O")
        g.output("O", (b, heads, r))

    return graph


def _gqa_decode(b: int, heads: int, kvh: int, d: int, t: int) -> Callable[[_Graph], None]:
    """One query token per head against a KV cache of t tokens, KV heads repeated to the query
    heads as a decoder export writes it (Unsqueeze, Expand, Reshape), scale 1/sqrt(d)."""

    def graph(g: _Graph) -> None:
        q = g.input("Q", (b, heads, 1, d))
        kv = [g.input(n, (b, kvh, t, d)) for n in ("K", "V")]
        rep = []
        for name, x in zip("kv", kv, strict=True):
            u = g.op("Unsqueeze", x, g.ints(f"{name}_axis", [2]))
            e = g.op("Expand", u, g.ints(f"{name}_expand", [b, kvh, heads // kvh, t, d]))
            rep.append(g.op("Reshape", e, g.ints(f"{name}_heads", [b, heads, t, d])))
        kt = g.op("Transpose", rep[0], perm=[0, 1, 3, 2])
        s = g.op("Mul", g.op("MatMul", q, kt), g.scalar_init("scale", 1.0 / math.sqrt(d)))
        g.op("MatMul", g.op("Softmax", s, axis=-1), rep[1], out="O")
        g.output("O", (b, heads, 1, d))

    return graph


CLASSES: dict[str, str] = {
    "norm+linear+activation": "norm + linear + activation",
    "gated_mlp": "gated MLP without down projection",
    "gated_mlp_down": "gated MLP with down projection",
    "norm+projections": "a norm with several projections",
    "latent_decode": "latent (MLA) decode attention",
    "long_kv_decode": "long-KV decode attention",
}
"""Issue 33's classes of real-width subgraphs (key: the `cls` of a RealWidth)."""

REALWIDTH: dict[str, RealWidth] = {
    r.name: r
    for r in [
        RealWidth(
            "rms_linear_silu_t8_h4096_n14336",
            "norm+linear+activation",
            "SiLU(RMSNorm(X)·γ·W), Llama-3-8B's gate projection: X(8,4096) W(4096,14336)",
            _rms_linear_silu(8, 4096, 14336),
        ),
        RealWidth(
            "ln_linear_gelu_t8_h1024_n4096",
            "norm+linear+activation",
            "GELU(LayerNorm(X)·W + b), gpt2-medium's MLP up projection: X(8,1024) W(1024,4096)",
            _ln_linear_gelu(8, 1024, 4096),
        ),
        RealWidth(
            "swiglu_t8_h4096_f14336",
            "gated_mlp",
            "SiLU(X·W1) ⊙ (X·W2), Llama-3-8B's gate/up: X(8,4096) W1,W2(4096,14336)",
            _swiglu(8, 4096, 14336),
        ),
        RealWidth(
            "swiglu_down_t8_h2048_f8192",
            "gated_mlp_down",
            "(SiLU(X·W1) ⊙ (X·W2))·W3, Llama-3.2-1B's MLP: X(8,2048) W1,W2(2048,8192) "
            "W3(8192,2048)",
            _swiglu_down(8, 2048, 8192),
        ),
        RealWidth(
            "rms_qkv_t8_h2048_q2048_kv512",
            "norm+projections",
            "RMSNorm(X)·γ then ·Wq, ·Wk, ·Wv (three outputs), Llama-3.2-1B: X(8,2048) "
            "Wq(2048,2048) Wk,Wv(2048,512)",
            _rms_qkv(8, 2048, 2048, 512),
        ),
        RealWidth(
            "mla_decode_b1_h128_kv8192",
            "latent_decode",
            "absorbed MLA decode at DeepSeek-V3's 128 heads: Q_nope(1,128,512) Q_pe(1,128,64) "
            "C(1,8192,512) K_pe(1,8192,64), s = 1/√192",
            _mla_decode(1, 128, 512, 64, 8192),
        ),
        RealWidth(
            "gqa_decode_b1_h32_kvh8_d128_kv32768",
            "long_kv_decode",
            "GQA decode, Llama-3-8B heads at a 32K cache: Q(1,32,1,128) K,V(1,8,32768,128) "
            "repeated to 32 heads, s = 1/√128",
            _gqa_decode(1, 32, 8, 128, 32768),
        ),
    ]
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="write <name>.onnx files here")
    args = ap.parse_args(argv)
    for r in REALWIDTH.values():
        model = r.build()
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            onnx.save(model, str(args.out / f"{r.name}.onnx"))
        print(f"{r.name}: {CLASSES[r.cls]}; {len(model.graph.node)} nodes; {r.what}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
