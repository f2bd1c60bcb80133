"""Turn the JSON written on the GPU machine into the markdown tables of RESULTS.md.

    python benchmarks/results_tables.py FIXTURE_KERNELS.json MODEL_BENCH.json

Peers and targets are those of docs/benchmarks.md (measured on the same kind of H200).
"""

from __future__ import annotations

import json
import sys

# best peer (µs) and target (µs) per row, from docs/benchmarks.md
PEERS = {
    "gqa_bs1": (18.3, "compile", 12.2),
    "gqa_bs8": (39.2, "SDPA", 26.1),
    "gqa_bs16": (39.3, "SDPA", 26.2),
    "qknorm_gqa_bs1": (22.2, "compile", 14.8),
    "qknorm_gqa_bs8": (77.2, "compile", 28.0),
    "qknorm_gqa_bs16": (143.1, "compile", 28.0),
    "rmsnorm_linear_bs1": (15.3, "compile", 13.0),
    "rmsnorm_linear_bs8": (15.3, "compile", 13.1),
    "rmsnorm_linear_bs16": (14.9, "compile", 13.2),
    "lora_bs1": (9.0, "compile", 6.0),
    "gated_mlp_bs1": (28.2, "compile", 18.8),
    "ntrans_bs1": (2.1, "compile", 2.2),
    "ntrans_bs8": (2.3, "compile", 2.2),
    "ntrans_bs16": (2.3, "compile", 2.2),
}
ORT_RUN = {
    "gqa_bs1": 43.0,
    "gqa_bs8": 93.6,
    "gqa_bs16": 146.8,
    "qknorm_gqa_bs1": 106.7,
    "qknorm_gqa_bs8": 164.4,
    "qknorm_gqa_bs16": 270.8,
    "rmsnorm_linear_bs1": 94.8,
    "rmsnorm_linear_bs8": 80.8,
    "rmsnorm_linear_bs16": 81.0,
    "lora_bs1": 61.5,
    "gated_mlp_bs1": 68.7,
    "ntrans_bs1": 111.1,
    "ntrans_bs8": 99.4,
    "ntrans_bs16": 107.2,
}


def kernel_table(path: str) -> str:
    with open(path) as f:
        d = json.load(f)
    lines = [
        "| fixture | mlso kernel µs | launches | best peer µs | mlso / best peer | target µs | mlso / target |",
        "|---|---:|---:|---|---:|---:|---:|",
    ]
    for r in d["results"]:
        peer = PEERS.get(r["name"])
        if peer:
            lines.append(
                f"| {r['name']} | {r['us']:.1f} | {r['launches']} | {peer[0]} ({peer[1]}) | "
                f"{r['us'] / peer[0]:.2f}x | {peer[2]} | {r['us'] / peer[2]:.2f}x |"
            )
        else:
            lines.append(f"| {r['name']} | {r['us']:.1f} | {r['launches']} | — | — | — | — |")
    return "\n".join(lines)


def model_table(path: str) -> str:
    with open(path) as f:
        rows = json.load(f)
    lines = [
        "| model | verify --gpu 0 | worst rel. err (limit 2e-3) | ORT orig µs | ORT rewritten µs | speedup "
        "| region: ORT µs | region: mlso kernel µs | wrong shape fed |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        model = next((x for x in r.get("bench", []) if x["type"] == "model"), {})
        region = next((x for x in r.get("bench", []) if x["type"] == "region"), {})
        errs = [
            x["rel_err_b"]
            for x in r.get("verify", [])
            if x.get("type") == "output" and x["scale"] == 1.0
        ]
        shape = (
            "refused, not launched"
            if str(r.get("wrong_shape", "")).startswith("refused")
            else r.get("wrong_shape", r.get("error", ""))
        )
        nan = float("nan")
        lines.append(
            f"| {r['row']} | {'pass' if r.get('verify_rc') == 0 else 'FAIL'} | {max(errs) if errs else nan:.1e} "
            f"| {model.get('orig_us', nan):.1f} | {model.get('fast_us', nan):.1f} | {model.get('speedup', nan):.2f}x "
            f"| {region.get('orig_us', nan):.1f} | {region.get('kernel_us', nan):.1f} | {shape} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(kernel_table(sys.argv[1]))
    print()
    print(model_table(sys.argv[2]))
