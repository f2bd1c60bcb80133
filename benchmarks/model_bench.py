"""Model-level benchmark on the GPU machine: each benchmark model rewritten with its fixture.

For every row of docs/benchmarks.md: package models/bench/<name>_bs<bs>.onnx with the
hand-written fixture program (compiled by codegen; a test helper, not `optimize`), then run
`mlso verify --gpu 0` (float checks on the CUDA EP; the finite-field check of the same programs
runs in the CPU test suite) and `mlso bench --gpu 0 --json`. Also feeds a wrong shape to the op
and records that it was refused. Prints a markdown table; writes JSON with --out.

    python3 benchmarks/model_bench.py --out results.json [--rows gqa_bs1,ntrans_bs8]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mlso_cli", *args], capture_output=True, cwd=ROOT, timeout=timeout
    )


def _wrong_shape_refused(path: Path) -> str:
    """Feed the packaged model an input of the wrong shape through the CUDA EP with the library."""
    import numpy as np
    import onnx

    from mlso_cli import runtime

    m = onnx.load(str(path))
    kernel = next(n for n in m.graph.node if n.domain == "ai.mlso")
    first = kernel.input[1]
    # cut the model to the kernel alone with its first input made one row shorter
    from mlso_cli.bench.harness import random_feeds

    feeds = random_feeds(m)
    if first not in feeds:
        return "skipped: first kernel input is an initializer"
    arr = feeds[first]
    feeds[first] = np.ascontiguousarray(arr[..., : max(1, arr.shape[-1] // 2)])
    inp = next(i for i in m.graph.input if i.name == first)
    inp.type.tensor_type.shape.dim[-1].dim_value = feeds[first].shape[-1]
    try:
        sess = runtime.session(m.SerializeToString(), providers=["CUDAExecutionProvider"])
        sess.run(None, feeds)
    except Exception as exc:  # ORT raises on the op's shape check (or earlier, on shape inference)
        return f"refused: {str(exc).splitlines()[0][:160]}"
    return "NOT refused"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rows", default="")
    ap.add_argument("--work", type=Path, default=Path("/tmp/mlso-model-bench"))
    args = ap.parse_args()
    import onnx

    from mlso_cli.codegen import compile_program
    from mlso_cli.package.assemble import Built
    from tests.fixtures.packaging import package_fixture
    from tests.fixtures.ugraphs import FIXTURES

    args.work.mkdir(parents=True, exist_ok=True)
    wanted = [r for r in args.rows.split(",") if r] or sorted(FIXTURES)
    results = []
    for row in wanted:
        name, _, bs = row.rpartition("_bs")
        orig = ROOT / "models" / "bench" / f"{row}.onnx"
        t0 = time.time()
        rec = {"row": row}
        try:
            program = FIXTURES[row]()
            prog = compile_program(program)
            fast = args.work / f"{row}.mlso.onnx"
            onnx.save(
                package_fixture(
                    orig, program, Built(program, prog.fatbin, prog.plan, prog.source_sha256)
                ),
                str(fast),
            )
            v = _cli(
                "verify",
                str(orig),
                str(fast),
                "--gpu",
                "0",
                "--no-field",
                "--samples",
                "1",
                "--scales",
                "1,4",
                "--json",
            )
            rec["verify_rc"] = v.returncode
            rec["verify"] = [json.loads(x) for x in v.stdout.decode().splitlines()]
            if v.returncode != 0:
                rec["verify_err"] = v.stderr.decode()[-600:]
            b = _cli(
                "bench",
                str(orig),
                str(fast),
                "--gpu",
                "0",
                "--json",
                "--repeats",
                "5",
                "--iters",
                "200",
            )
            rec["bench_rc"] = b.returncode
            rec["bench"] = [json.loads(x) for x in b.stdout.decode().splitlines()]
            if b.returncode != 0:
                rec["bench_err"] = b.stderr.decode()[-600:]
            rec["wrong_shape"] = _wrong_shape_refused(fast)
        except Exception as exc:
            rec["error"] = f"{type(exc).__name__}: {exc}"[:600]
        rec["seconds"] = round(time.time() - t0, 1)
        results.append(rec)
        print(
            json.dumps({k: v for k, v in rec.items() if k not in ("verify", "bench")}), flush=True
        )
    args.out.write_text(json.dumps(results, indent=1))
    print(
        "\n| row | verify | worst rel err | ORT orig µs | ORT mlso µs | speedup | region orig µs | kernel µs | wrong shape |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        model = next((x for x in r.get("bench", []) if x["type"] == "model"), {})
        region = next((x for x in r.get("bench", []) if x["type"] == "region"), {})
        errs = [x["rel_err_b"] for x in r.get("verify", []) if x.get("type") == "output"]
        print(
            f"| {r['row']} | {'pass' if r.get('verify_rc') == 0 else 'FAIL'} | {max(errs) if errs else float('nan'):.2e} "
            f"| {model.get('orig_us', float('nan')):.1f} | {model.get('fast_us', float('nan')):.1f} "
            f"| {model.get('speedup', float('nan')):.2f} | {region.get('orig_us', float('nan')):.1f} "
            f"| {region.get('kernel_us', float('nan')):.1f} | {r.get('wrong_shape', r.get('error', ''))[:40]} |"
        )


if __name__ == "__main__":
    main()
