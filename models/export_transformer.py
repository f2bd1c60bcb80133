"""Export a tiny LLaMA-style decoder stack with the real PyTorch ONNX exporter.

Why: the hand-written graphs in ``build_models.py`` show what mlso's lifter must handle in
principle; this file shows what it meets in practice. ``torch.onnx.export`` (the dynamo-based
exporter, torch 2.13 + onnxscript) decides how RMSNorm, GQA's repeat_kv, rotary embeddings,
the causal mask, softmax and SwiGLU come out, with dynamic batch and sequence dims that a user
must fix with ``--input-shape``. The result, ``models/transformer_tiny.onnx``, is committed so
that tests never need torch.

The model: 2 decoder layers, hidden 64, 4 query heads and 2 KV heads (GQA via repeat_kv),
head dim 16, RMSNorm written as ``x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w``,
rotary embeddings (rotate-half form, tables sliced to the sequence length), a causal mask
applied with ``masked_fill(-inf)`` (an ONNX Where), softmax in fp32, a SwiGLU MLP
``(silu(x@Wg) * (x@Wu)) @ Wd`` with intermediate size 128, residuals, and a final RMSNorm.
Input ``hidden`` is (batch, seq, 64), fp32; both dims are dynamic. Weights are initializers
drawn from ``torch.manual_seed(0)``.

torch is a dev-only tool here. The exact commands used to produce the committed file::

    .venv/bin/pip install torch==2.13.0 onnxscript   # onnxscript 0.7.2
    .venv/bin/python -m models.export_transformer   # from the repository root

(options: ``--out PATH``). The script lowers the IR version to <= 11 if the exporter wrote a
higher one, checks the model with onnx.checker (full_check), runs it in ONNX Runtime on the
CPU at batch 1, seq 16 and prints the max error against the torch model, and prints the op
census.
"""

from __future__ import annotations

import argparse
import collections
import math
import sys
import warnings
from pathlib import Path

import numpy as np
import onnx

HIDDEN = 64
N_HEADS = 4
N_KV_HEADS = 2
HEAD_DIM = 16
INTERMEDIATE = 128
N_LAYERS = 2
MAX_POS = 256
EPS = 1e-6
ROPE_THETA = 10000.0
SEED = 0
MAX_IR = 11  # ONNX Runtime 1.31 accepts IR <= 13; keep to what the rest of mlso writes.

DEFAULT_OUT = Path(__file__).resolve().parent / "transformer_tiny.onnx"


def _build_torch_model():  # -> torch.nn.Module; torch is imported lazily (dev-only dep)
    """Define and instantiate the decoder stack. Classes live inside so that importing this
    module does not need torch."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    class RMSNorm(nn.Module):
        def __init__(self, dim: int, eps: float = EPS) -> None:
            super().__init__()
            self.eps = eps
            # Not all ones, so that a dropped weight would show up as an error.
            self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(dim))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
        return torch.cat((-x2, x1), dim=-1)

    def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
        b, h, s, d = x.shape
        return x[:, :, None, :, :].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj = nn.Linear(HIDDEN, N_HEADS * HEAD_DIM, bias=False)
            self.k_proj = nn.Linear(HIDDEN, N_KV_HEADS * HEAD_DIM, bias=False)
            self.v_proj = nn.Linear(HIDDEN, N_KV_HEADS * HEAD_DIM, bias=False)
            self.o_proj = nn.Linear(N_HEADS * HEAD_DIM, HIDDEN, bias=False)

        def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            b, s, _ = x.shape
            q = self.q_proj(x).view(b, s, N_HEADS, HEAD_DIM).transpose(1, 2)
            k = self.k_proj(x).view(b, s, N_KV_HEADS, HEAD_DIM).transpose(1, 2)
            v = self.v_proj(x).view(b, s, N_KV_HEADS, HEAD_DIM).transpose(1, 2)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            k = repeat_kv(k, N_HEADS // N_KV_HEADS)
            v = repeat_kv(v, N_HEADS // N_KV_HEADS)
            scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(HEAD_DIM)
            causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            scores = scores.masked_fill(~causal, float("-inf"))
            probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            out = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, N_HEADS * HEAD_DIM)
            return self.o_proj(out)

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_proj = nn.Linear(HIDDEN, INTERMEDIATE, bias=False)
            self.up_proj = nn.Linear(HIDDEN, INTERMEDIATE, bias=False)
            self.down_proj = nn.Linear(INTERMEDIATE, HIDDEN, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    class DecoderLayer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.input_layernorm = RMSNorm(HIDDEN)
            self.self_attn = Attention()
            self.post_attention_layernorm = RMSNorm(HIDDEN)
            self.mlp = MLP()

        def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            x = x + self.self_attn(self.input_layernorm(x), cos, sin)
            return x + self.mlp(self.post_attention_layernorm(x))

    class TinyDecoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(DecoderLayer() for _ in range(N_LAYERS))
            self.norm = RMSNorm(HIDDEN)
            inv_freq = 1.0 / ROPE_THETA ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
            freqs = torch.outer(torch.arange(MAX_POS).float(), inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            self.register_buffer("rope_cos", emb.cos(), persistent=False)
            self.register_buffer("rope_sin", emb.sin(), persistent=False)

        def forward(self, hidden: torch.Tensor) -> torch.Tensor:
            s = hidden.shape[1]
            cos, sin = self.rope_cos[:s], self.rope_sin[:s]
            x = hidden
            for layer in self.layers:
                x = layer(x, cos, sin)
            return self.norm(x)

    torch.manual_seed(SEED)
    return TinyDecoder().eval()


def export(out: Path = DEFAULT_OUT) -> onnx.ModelProto:
    """Export, fix the IR version, check, run in ORT against torch, and write ``out``."""
    import onnxruntime as ort
    import torch

    model = _build_torch_model()
    example = torch.randn(2, 16, HIDDEN)
    batch = torch.export.Dim("batch", min=1, max=64)
    seq = torch.export.Dim("seq", min=2, max=MAX_POS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            model,
            (example,),
            dynamo=True,
            input_names=["hidden"],
            output_names=["output"],
            dynamic_shapes={"hidden": {0: batch, 1: seq}},
            external_data=False,
        )
    proto = program.model_proto
    print(
        f"exporter wrote IR {proto.ir_version}, opsets "
        f"{[(o.domain or 'ai.onnx', o.version) for o in proto.opset_import]}"
    )
    if proto.ir_version > MAX_IR:
        proto.ir_version = MAX_IR
    onnx.checker.check_model(proto, full_check=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(proto, str(out))

    dims = [d.dim_param or d.dim_value for d in proto.graph.input[0].type.tensor_type.shape.dim]
    print(f"input {proto.graph.input[0].name}: {dims}")
    x = torch.randn(1, 16, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(x).numpy()
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    (got,) = sess.run(None, {"hidden": x.numpy()})
    err = float(np.max(np.abs(got - expected)))
    print(f"ORT CPU vs torch, batch 1 seq 16: max abs error {err:.3e}")
    if not err < 1e-4:
        raise SystemExit(f"exported model disagrees with torch: {err}")
    census = collections.Counter(n.op_type for n in proto.graph.node)
    print(f"{out}: {out.stat().st_size} bytes, {len(proto.graph.node)} nodes")
    for op, n in sorted(census.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"  {op:24s} {n}")
    return proto


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    export(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
