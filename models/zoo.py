"""A model zoo of Hugging Face ``transformers`` decoders exported to ONNX, built by ``make zoo``.

Why: the hand-written graphs in ``build_models.py`` and the one hand-written torch decoder in
``export_transformer.py`` show what mlso must handle in principle; the graphs users bring come
from ``transformers`` modelling code run through ``torch.onnx.export``, and each family writes
its norms, rotary embeddings, masks, GQA and MLPs a little differently. The zoo holds several
families, each at two sizes, in fp32 and fp16, so that tests (CPU) can partition and optimize
real exported graphs and benchmarks (GPU) can compare ``mlso optimize`` with ONNX Runtime's
transformer optimizer on layers of a real model's width.

Sizes (the family table below gives the numbers):

* ``tiny``: 2 decoder layers, hidden 256, 4 query heads of 64, vocab 128, intermediate 384
  (GPT-2: 512) -- small enough that its fp32 file stays under 5 MB and can be committed.
* ``real``: 1 decoder layer at the width of a named real checkpoint (hidden, heads, KV heads,
  head dim, intermediate, norms, rotary settings), vocab 2048 so that the embedding and LM head
  do not dwarf the layer. One layer because the widest (Mistral-7B, Phi-3-mini) are 450-900 MB
  a layer in fp32; the layer-to-layer pattern (residual Add into the next RMSNorm) still appears
  once, into the final norm, and ``tiny`` has two layers.

Every model: random weights from ``torch.manual_seed`` (the Hugging Face hub is not reachable
and is never needed), with every 1-D parameter (norm weights, biases) moved off its
initial value so that an export that dropped one shows in the parity check; eager attention
(``attn_implementation="eager"``: explicit MatMul/Softmax/MatMul with an additive mask, the
pattern ONNX Runtime's optimizer and mlso's lifter both look for); no KV cache; input
``input_ids`` (int64, dims ``batch``, ``seq``, both dynamic), output ``logits``
(``batch``, ``seq``, vocab). fp16 models are the fp32 modules cast with ``.to(float16)`` and
exported in fp16 (what an fp16 GPU export writes: transformers' norms and softmax upcast to
fp32, so the graph carries Cast nodes).

Export: ``torch.onnx.export(dynamo=True)`` (torch 2.13 + onnxscript 0.7.2, opset 20, the same
path ``export_transformer.py`` used), IR lowered to <= 11, node metadata other than
``namespace`` dropped (``stack_trace`` holds this machine's paths, which would make the file's
hash depend on where the venv lives; the rest repeats ``namespace`` and costs 0.1 MB of a tiny
file's 5 MB), ``onnx.checker`` with full_check, then ONNX Runtime (CPU) against the
torch module at batch 1, seq 32.

Commands (torch lives only in ``.venv-zoo``, never in ``.venv``; ``make zoo`` runs ``build``,
``inspect`` and ``check``; ``freeze`` is run by hand)::

    .venv-zoo/bin/python -m models.zoo build     # export + parity -> models/zoo/, MANIFEST.json
    .venv/bin/python -m models.zoo inspect       # mlso inspect on each file -> MANIFEST.json
    .venv/bin/python -m models.zoo check         # compare models/zoo/ with the committed manifest
    .venv/bin/python -m models.zoo freeze        # (once, by hand) write models/zoo_manifest.json
                                                 # and copy the committed tiny files

``build`` options: ``--only llama,gpt2`` (families), ``--sizes tiny``, ``--dtypes fp32``.
This module imports torch and transformers only inside ``build`` so that ``inspect``,
``check``, ``freeze`` and the tests run without them.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ZOO_DIR = HERE / "zoo"  # generated, git-ignored
SMALL_DIR = HERE / "zoo_small"  # the committed tiny fp32 files
COMMITTED_MANIFEST = HERE / "zoo_manifest.json"

# The exporter's pins (`make zoo` installs them); `build` records the versions it ran with and
# warns where they differ, since another version may write another graph.
REQUIREMENTS = HERE / "zoo_requirements.txt"

SIZES = ("tiny", "real")
DTYPES = ("fp32", "fp16")
SEED = 0
EXAMPLE_BATCH, EXAMPLE_SEQ = 2, 32  # the shapes traced by torch.export
CHECK_BATCH, CHECK_SEQ = 1, 32  # the shapes of the parity check and of `inspect`
MAX_SEQ = 4096  # upper bound of the dynamic seq dim (rotary tables are computed, not stored)
MAX_IR = 11  # ONNX Runtime accepts more; keep to what the rest of mlso writes.
MAX_COMMITTED_BYTES = 5_000_000  # the "no file over 5 MB" for anything in git
# Parity limits: max |ORT - torch| / max |torch| over the logits. fp16 against torch's own fp16
# CPU kernels, which accumulate differently from ORT's.
REL_LIMIT = {"fp32": 1e-4, "fp16": 2e-2}

# Keys common to every config: tiny vocab ids, no dropout, no cache, eager attention.
_COMMON: dict[str, Any] = {
    "use_cache": False,
    "pad_token_id": None,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


@dataclass(frozen=True)
class Family:
    """One transformers architecture: its config and causal-LM classes and two sizes.

    ``sized_after`` names the real checkpoint whose layer dimensions ``real`` copies (from its
    published config.json; nothing is downloaded). ``optional`` families may fail to export
    without failing ``make zoo``: the failure is recorded in the manifest instead."""

    name: str
    config_class: str
    model_class: str
    sized_after: str
    tiny: dict[str, Any]
    real: dict[str, Any]
    common: dict[str, Any] = field(default_factory=dict)
    optional: bool = False
    note: str = ""
    known_failure: str = ""


# Tiny sizes share hidden 256, head dim 64 (32 for MLA's parts), 2 layers, vocab 128.
_TINY = {
    "vocab_size": 128,
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "max_position_embeddings": MAX_SEQ,
}
_REAL = {"vocab_size": 2048, "num_hidden_layers": 1, "max_position_embeddings": MAX_SEQ}

FAMILIES: tuple[Family, ...] = (
    Family(
        "llama",
        "LlamaConfig",
        "LlamaForCausalLM",
        "meta-llama/Llama-3.2-1B",
        tiny={
            **_TINY,
            "intermediate_size": 384,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "tie_word_embeddings": True,
        },
        real={
            **_REAL,
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "tie_word_embeddings": True,
            "rms_norm_eps": 1e-5,
            # Llama 3.2's; only its rotary scaling reads it (the tables are computed per call).
            "max_position_embeddings": 131072,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        },
        note="RMSNorm, GQA, SwiGLU, rotary (llama3 scaling at real size), tied embeddings",
    ),
    Family(
        "qwen2",
        "Qwen2Config",
        "Qwen2ForCausalLM",
        "Qwen/Qwen2.5-0.5B",
        tiny={
            **_TINY,
            "intermediate_size": 384,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "tie_word_embeddings": True,
        },
        real={
            **_REAL,
            "hidden_size": 896,
            "intermediate_size": 4864,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
            "tie_word_embeddings": True,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        note="as llama, with biases on the q/k/v projections; 14 heads of 64 at real size",
    ),
    Family(
        "mistral",
        "MistralConfig",
        "MistralForCausalLM",
        "mistralai/Mistral-7B-v0.1",
        # A 16-token sliding window at seq 32, so that the window changes the tiny model's
        # output (at real size the 4096 window is wider than any test sequence).
        tiny={
            **_TINY,
            "intermediate_size": 384,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "sliding_window": 16,
        },
        real={
            **_REAL,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "sliding_window": 4096,
            "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
        note="as llama, with a sliding-window causal mask; untied LM head",
    ),
    Family(
        "gpt2",
        "GPT2Config",
        "GPT2LMHeadModel",
        "openai-community/gpt2-medium",
        # n_inner 512 (2x, not GPT-2's 4x) keeps the committed tiny file under 5 MB.
        tiny={
            "vocab_size": 128,
            "n_embd": 256,
            "n_layer": 2,
            "n_head": 4,
            "n_inner": 512,
            "n_positions": 256,
        },
        real={
            "vocab_size": 2048,
            "n_embd": 1024,
            "n_layer": 1,
            "n_head": 16,
            "n_inner": 4096,
            "n_positions": 1024,
        },
        common={
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "activation_function": "gelu_new",
        },
        note="LayerNorm with bias, learned positions, fused c_attn (Conv1D), GELU (tanh), MHA",
    ),
    Family(
        "phi3",
        "Phi3Config",
        "Phi3ForCausalLM",
        "microsoft/Phi-3-mini-4k-instruct",
        tiny={
            **_TINY,
            "intermediate_size": 384,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "sliding_window": 2047,
            "original_max_position_embeddings": MAX_SEQ,
        },
        real={
            **_REAL,
            "hidden_size": 3072,
            "intermediate_size": 8192,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "sliding_window": 2047,
            "original_max_position_embeddings": MAX_SEQ,
            "rms_norm_eps": 1e-5,
        },
        note="fused qkv_proj and gate_up_proj (split by Slice), MHA at real size",
    ),
    Family(
        "gemma3",
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        "google/gemma-3-1b-pt",
        # Tiny: one sliding-window (16 tokens) and one global layer, as Gemma 3 interleaves.
        tiny={
            **_TINY,
            "intermediate_size": 384,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 64,
            "query_pre_attn_scalar": 64,
            "sliding_window": 16,
            "layer_types": ["sliding_attention", "full_attention"],
        },
        real={
            **_REAL,
            "hidden_size": 1152,
            "intermediate_size": 6912,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 256,
            "query_pre_attn_scalar": 256,
            "sliding_window": 512,
            "layer_types": ["full_attention"],
        },
        note="QK-norm, (1 + w) RMSNorm, sandwich norms, gated GELU (tanh), scaled embeddings",
    ),
    Family(
        "qwen3",
        "Qwen3Config",
        "Qwen3ForCausalLM",
        "Qwen/Qwen3-0.6B",
        tiny={
            **_TINY,
            "intermediate_size": 384,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "tie_word_embeddings": True,
        },
        real={
            **_REAL,
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        note="QK-norm (RMSNorm over each head) in a llama-style layer",
    ),
    Family(
        "deepseek_v2",
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        "deepseek-ai/DeepSeek-V2-Lite",
        # first_k_dense_replace >= num_hidden_layers: every layer has the dense MLP, no MoE.
        tiny={
            **_TINY,
            "intermediate_size": 384,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "q_lora_rank": None,
            "kv_lora_rank": 64,
            "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 16,
            "v_head_dim": 32,
            "first_k_dense_replace": 2,
        },
        real={
            **_REAL,
            "hidden_size": 2048,
            "intermediate_size": 10944,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "q_lora_rank": None,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "first_k_dense_replace": 1,
        },
        optional=True,
        note="MLA (kv_a_proj -> RMSNorm -> kv_b_proj, split nope/rope heads), MoE off",
        known_failure="its rotary embedding is complex-valued (torch.polar, view_as_complex); "
        "the dynamo exporter has no complex decomposition for aten.unsqueeze, and the "
        "TorchScript exporter stops earlier at aten::diff in transformers' mask code. "
        "deepseek_v3 is the MLA layer of the zoo.",
    ),
    Family(
        "deepseek_v3",
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        "deepseek-ai/DeepSeek-V2-Lite (dims) with a V3-style q_lora_rank",
        tiny={
            **_TINY,
            "intermediate_size": 384,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "q_lora_rank": 96,
            "kv_lora_rank": 64,
            "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 16,
            "v_head_dim": 32,
            "first_k_dense_replace": 2,
        },
        real={
            **_REAL,
            "hidden_size": 2048,
            "intermediate_size": 10944,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "q_lora_rank": 1536,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "first_k_dense_replace": 1,
        },
        optional=True,
        note="MLA with low-rank queries (q_a_proj -> RMSNorm -> q_b_proj), real-valued "
        "interleaved rotary, MoE off",
    ),
)
FAMILY_BY_NAME = {f.name: f for f in FAMILIES}

# The tiny fp32 files committed under models/zoo_small/ (each < 5 MB, about 4.5 MB; together
# under ~20 MB): one per structurally distinct graph -- llama (the common RMSNorm/GQA/SwiGLU
# layer), gpt2 (LayerNorm, GELU, fused QKV, learned positions), gemma3 (QK-norm, sandwich norms,
# sliding window) and an MLA layer. qwen2, mistral, phi3 and qwen3 are llama's graph with small
# differences and are built by `make zoo` only.
COMMITTED: tuple[str, ...] = (
    "llama_tiny_fp32.onnx",
    "gpt2_tiny_fp32.onnx",
    "gemma3_tiny_fp32.onnx",
    "deepseek_v3_tiny_fp32.onnx",
)


def file_name(family: str, size: str, dtype: str) -> str:
    """The zoo's one naming rule: ``<family>_<size>_<dtype>.onnx``."""
    return f"{family}_{size}_{dtype}.onnx"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def input_shape_args() -> list[str]:
    """The ``--input-shape`` flags that fix every zoo file's dynamic dims at the checked shape."""
    return ["--input-shape", f"input_ids={CHECK_BATCH},{CHECK_SEQ}"]


def pinned_versions() -> dict[str, str]:
    """``name==version`` lines of zoo_requirements.txt, as {name: version}."""
    pins = {}
    for line in REQUIREMENTS.read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[name.strip()] = version.strip()
    return pins


def load_manifest(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {"entries": {}}


def write_manifest(path: Path, manifest: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


# ---------------------------------------------------------------------------------------------
# build (needs torch + transformers: run with .venv-zoo/bin/python)


def _build_module(family: Family, size: str):  # -> torch.nn.Module (torch imported lazily)
    """Instantiate ``family`` at ``size`` with seeded random weights, wrapped to map
    input_ids -> logits. 1-D parameters are perturbed (see the module docstring)."""
    import torch
    import transformers

    kwargs = {**_COMMON, **family.common, **getattr(family, size)}
    config = getattr(transformers, family.config_class)(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(SEED)
    model = getattr(transformers, family.model_class)(config)
    gen = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    model.eval()

    class LogitsOnly(torch.nn.Module):
        """input_ids -> logits, no cache: the one signature every zoo file has."""

        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.model = inner

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=input_ids, use_cache=False).logits

    # The exporter writes the wrapper's qualified name into every node's `namespace`; pin it so
    # the bytes do not depend on whether this module ran as __main__ or was imported.
    LogitsOnly.__module__, LogitsOnly.__qualname__ = "models.zoo", "LogitsOnly"
    return LogitsOnly(model).eval(), config


def _strip_metadata(proto) -> None:
    """Drop node metadata that records this machine's paths (stack traces), so that the bytes
    and sha256 do not depend on where the venv lives, and what only repeats ``namespace``."""
    drop = {
        "pkg.torch.onnx.stack_trace",
        "pkg.torch.onnx.fx_node",
        "pkg.torch.onnx.class_hierarchy",  # the classes in `namespace`, again
        "pkg.torch.onnx.name_scopes",  # the module paths in `namespace`, again
    }

    def walk(graph) -> None:
        for node in graph.node:
            keep = [m for m in node.metadata_props if m.key not in drop]
            del node.metadata_props[:]
            node.metadata_props.extend(keep)
            for attr in node.attribute:
                if attr.HasField("g"):
                    walk(attr.g)
                for g in attr.graphs:
                    walk(g)

    walk(proto.graph)


def _export_one(family: Family, size: str, dtype: str, out: Path) -> dict[str, Any]:
    """Export one zoo entry to ``out`` and return its manifest record (raises on failure)."""
    import numpy as np
    import onnx
    import onnxruntime as ort
    import torch

    t0 = time.time()
    module, config = _build_module(family, size)
    ref32 = module
    if dtype == "fp16":
        module = _build_module(family, size)[0].to(torch.float16)
    vocab = config.vocab_size
    example = torch.randint(
        0, vocab, (EXAMPLE_BATCH, EXAMPLE_SEQ), generator=torch.Generator().manual_seed(SEED + 2)
    )
    batch = torch.export.Dim("batch", min=1, max=64)
    seq = torch.export.Dim("seq", min=2, max=MAX_SEQ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module,
            (example,),
            dynamo=True,
            input_names=["input_ids"],
            output_names=["logits"],
            dynamic_shapes={"input_ids": {0: batch, 1: seq}},
            external_data=False,
            verbose=False,
        )
    proto = program.model_proto
    exporter_ir = proto.ir_version
    proto.ir_version = min(proto.ir_version, MAX_IR)
    _strip_metadata(proto)
    onnx.checker.check_model(proto, full_check=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(proto, str(out))
    export_s = time.time() - t0

    ids = torch.randint(
        0, vocab, (CHECK_BATCH, CHECK_SEQ), generator=torch.Generator().manual_seed(SEED + 3)
    )
    with torch.no_grad():
        expected = module(ids).float().numpy()
        expected32 = ref32(ids).numpy()
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    (got,) = sess.run(None, {"input_ids": ids.numpy()})
    got = got.astype(np.float32)
    scale = float(np.max(np.abs(expected))) or 1.0
    abs_err = float(np.max(np.abs(got - expected)))
    rel_err = abs_err / scale
    rel_err32 = float(np.max(np.abs(got - expected32))) / (float(np.max(np.abs(expected32))) or 1)
    if not np.isfinite(got).all() or not rel_err <= REL_LIMIT[dtype]:
        raise RuntimeError(
            f"ONNX Runtime disagrees with torch: max rel error {rel_err:.3e} "
            f"(limit {REL_LIMIT[dtype]:.0e}), finite={bool(np.isfinite(got).all())}"
        )

    census = collections.Counter(n.op_type for n in proto.graph.node)
    n_params = sum(p.numel() for p in ref32.parameters())
    return {
        "file": out.name,
        "family": family.name,
        "size": size,
        "dtype": dtype,
        "status": "ok",
        "bytes": out.stat().st_size,
        "sha256": sha256(out),
        "sized_after": family.sized_after,
        "note": family.note,
        "config": {**family.common, **getattr(family, size)},
        "params": int(n_params),
        "inputs": [_value_info(v) for v in proto.graph.input],
        "outputs": [_value_info(v) for v in proto.graph.output],
        "nodes": len(proto.graph.node),
        "ops": dict(sorted(census.items())),
        "ir_version": proto.ir_version,
        "exporter_ir_version": exporter_ir,
        "opsets": {(o.domain or "ai.onnx"): o.version for o in proto.opset_import},
        "export": {
            "exporter": "torch.onnx.export(dynamo=True)",
            "attn_implementation": "eager",
            "seed": SEED,
            "example_shape": [EXAMPLE_BATCH, EXAMPLE_SEQ],
            "dynamic_dims": {"batch": [1, 64], "seq": [2, MAX_SEQ]},
        },
        "parity": {
            "shape": [CHECK_BATCH, CHECK_SEQ],
            "max_abs_error": abs_err,
            "max_rel_error": rel_err,
            "max_rel_error_vs_fp32_torch": rel_err32,
            "limit": REL_LIMIT[dtype],
        },
        "export_s": round(export_s, 1),
    }


def _value_info(v) -> dict[str, Any]:
    import onnx

    t = v.type.tensor_type
    return {
        "name": v.name,
        "dtype": onnx.TensorProto.DataType.Name(t.elem_type).lower(),
        "shape": [d.dim_param or d.dim_value for d in t.shape.dim],
    }


def build(args: argparse.Namespace) -> int:
    """Export the selected entries into ``args.out`` and (re)write its MANIFEST.json; keep going
    past a failure, record it, and fail at the end only for a non-optional family."""
    import torch

    out_dir: Path = args.out
    manifest_path = out_dir / "MANIFEST.json"
    manifest = load_manifest(manifest_path)
    pins = pinned_versions()
    versions = {pkg: importlib.metadata.version(pkg) for pkg in pins}
    manifest["versions"] = {**versions, "python": sys.version.split()[0]}
    for pkg, want in pins.items():
        if versions[pkg].split("+")[0] != want:
            print(f"[zoo] warning: {pkg} {versions[pkg]} is not the pinned {want}", file=sys.stderr)
    entries = manifest.setdefault("entries", {})
    families = [FAMILY_BY_NAME[n] for n in args.only] if args.only else list(FAMILIES)
    hard_failures = []
    torch.set_num_threads(max(1, args.threads))
    for family in families:
        for size in args.sizes:
            for dtype in args.dtypes:
                name = file_name(family.name, size, dtype)
                out = out_dir / name
                print(f"[zoo] {name} ...", flush=True)
                try:
                    rec = _export_one(family, size, dtype, out)
                except Exception as exc:  # recorded; a zoo with one family missing is useful
                    tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
                    last = "".join(tb[-3:]).strip().splitlines()[-6:]
                    rec = {
                        "file": name,
                        "family": family.name,
                        "size": size,
                        "dtype": dtype,
                        "status": "failed",
                        "error": re.sub(r"\x1b\[[0-9;]*m", "", f"{type(exc).__name__}: {exc}")[
                            :4000
                        ],
                        "traceback_tail": last,
                    }
                    if out.exists():
                        out.unlink()
                    if family.known_failure:
                        rec["known_failure"] = family.known_failure
                    if not family.optional:
                        hard_failures.append(name)
                    why = " (known, see the manifest)" if family.known_failure else ""
                    # The dynamo exporter's message opens with advice; its cause is the first
                    # "<class ...>: ..." line of its exception summary.
                    lines = rec["error"].splitlines()
                    cause = next((ln for ln in lines if ln.startswith("<class ")), lines[0])
                    print(f"[zoo] {name}: FAILED{why}: {cause[:400]}", flush=True)
                else:
                    p = rec["parity"]
                    print(
                        f"[zoo] {name}: {rec['bytes'] / 1e6:.1f} MB, {rec['nodes']} nodes, "
                        f"rel err {p['max_rel_error']:.2e} (vs fp32 torch "
                        f"{p['max_rel_error_vs_fp32_torch']:.2e}), {rec['export_s']} s",
                        flush=True,
                    )
                entries[name] = rec
                write_manifest(manifest_path, manifest)
    if hard_failures:
        print(f"[zoo] failed: {', '.join(hard_failures)}", file=sys.stderr)
        return 1
    return 0


# ---------------------------------------------------------------------------------------------
# inspect / check / freeze (no torch: run with .venv/bin/python)


def _mlso() -> list[str]:
    return [sys.executable, "-m", "mlso_cli"]


def run_inspect(path: Path, timeout: float = 600) -> dict[str, Any]:
    """``mlso inspect --json`` on one file: exit code, region count, nodes in regions, time, and
    the traceback's last lines if it crashed."""
    t0 = time.time()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [*_mlso(), "inspect", str(path), *input_shape_args(), "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=timeout,
    )
    rec: dict[str, Any] = {"rc": proc.returncode, "seconds": round(time.time() - t0, 2)}
    regions = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    rec["regions"] = sum(1 for r in regions if r.get("type") == "region")
    rec["nodes_in_regions"] = sum(
        len(r.get("nodes", [])) for r in regions if r.get("type") == "region"
    )
    if proc.returncode != 0:
        rec["stderr_tail"] = proc.stderr.strip().splitlines()[-8:]
    return rec


def inspect(args: argparse.Namespace) -> int:
    """Record ``mlso inspect`` results for every built file in MANIFEST.json."""
    manifest_path = args.out / "MANIFEST.json"
    manifest = load_manifest(manifest_path)
    bad = 0
    for name, rec in sorted(manifest.get("entries", {}).items()):
        path = args.out / name
        if rec.get("status") != "ok" or not path.exists():
            continue
        if args.only and rec["family"] not in args.only:
            continue
        res = run_inspect(path)
        rec["inspect"] = {**res, "input_shape": [CHECK_BATCH, CHECK_SEQ]}
        bad += res["rc"] != 0
        print(
            f"[zoo] inspect {name}: rc {res['rc']}, {res['regions']} regions "
            f"({res['nodes_in_regions']}/{rec['nodes']} nodes), {res['seconds']} s",
            flush=True,
        )
        if res["rc"] != 0:
            print("    " + "\n    ".join(res.get("stderr_tail", [])), flush=True)
        write_manifest(manifest_path, manifest)
    return 1 if bad else 0


def check(args: argparse.Namespace) -> int:
    """Compare the built zoo with the committed manifest: same files, same bytes and sha256.
    A mismatch is reported, not fatal: another torch/transformers build may export other
    bytes; the committed tiny files under zoo_small/ are what tests pin."""
    committed = load_manifest(COMMITTED_MANIFEST).get("entries", {})
    built = load_manifest(args.out / "MANIFEST.json").get("entries", {})
    same = differ = missing = 0
    for name, want in sorted(committed.items()):
        if want.get("status") != "ok":
            continue
        got = built.get(name)
        path = args.out / name
        if got is None or got.get("status") != "ok" or not path.exists():
            print(f"[zoo] check {name}: not built")
            missing += 1
        elif sha256(path) != want["sha256"]:
            print(
                f"[zoo] check {name}: differs from the committed manifest "
                f"({path.stat().st_size} vs {want['bytes']} bytes)"
            )
            differ += 1
        else:
            same += 1
    print(f"[zoo] check: {same} as committed, {differ} differ, {missing} not built")
    return 0


def freeze(args: argparse.Namespace) -> int:
    """Write the committed manifest from the built one and copy the committed tiny files.
    Done once by hand after a build (and again only when the pins change)."""
    built = load_manifest(args.out / "MANIFEST.json")
    SMALL_DIR.mkdir(parents=True, exist_ok=True)
    for name in COMMITTED:
        rec = built["entries"].get(name)
        if rec is None or rec.get("status") != "ok":
            print(f"[zoo] freeze: {name} was not built; not committed", file=sys.stderr)
            continue
        if rec["bytes"] > MAX_COMMITTED_BYTES:
            raise SystemExit(f"{name} is {rec['bytes']} bytes, over {MAX_COMMITTED_BYTES}")
        shutil.copyfile(args.out / name, SMALL_DIR / name)
    committed = {
        "about": "Generated by `python -m models.zoo freeze` from a `make zoo` build. Lists "
        "every zoo file with its size, sha256, export settings and parity; files under "
        "models/zoo_small/ are committed, the rest are built into models/zoo/ by `make zoo`.",
        "versions": built.get("versions", {}),
        "committed": [n for n in COMMITTED if (SMALL_DIR / n).exists()],
        "check_input_shape": {"input_ids": [CHECK_BATCH, CHECK_SEQ]},
        "entries": built["entries"],
    }
    write_manifest(COMMITTED_MANIFEST, committed)
    total = sum((SMALL_DIR / n).stat().st_size for n in committed["committed"])
    print(f"[zoo] froze {len(built['entries'])} entries; committed {total / 1e6:.1f} MB")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["build", "inspect", "check", "freeze"])
    parser.add_argument("--out", type=Path, default=ZOO_DIR)
    parser.add_argument(
        "--only",
        type=lambda s: s.split(","),
        default=None,
        help=f"families, comma-separated: {','.join(FAMILY_BY_NAME)}",
    )
    parser.add_argument("--sizes", type=lambda s: s.split(","), default=list(SIZES))
    parser.add_argument("--dtypes", type=lambda s: s.split(","), default=list(DTYPES))
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    for bad in set(args.only or []) - set(FAMILY_BY_NAME):
        parser.error(f"unknown family {bad!r}")
    return {"build": build, "inspect": inspect, "check": check, "freeze": freeze}[args.command](
        args
    )


if __name__ == "__main__":
    sys.exit(main())
