"""A calibration set for the cost model: several verified programs per benchmark row, with estimates.

Why: the search keeps the program the cost model (search/cost.py) ranks first, so the model's
errors decide what users get. Timing only the chosen program shows an error after the fact;
timing the runners-up as well shows where the ranking is wrong and gives the data to refit it.

For each row (models/build_models.py SPECS, fp16) this runs the search in this process, as
`mlso optimize` does, with the full-shape verification widened to the cheapest `--top`
structures (SearchOptions.full_checks), and writes each verified program as μGraph JSON, named
`<row>_bs<N>_c<k>.json` (k = 0 is the model's choice), plus `estimates.json` with the model's
figure for each. `--compile` also compiles them with nvcc into the kernel cache
(MLSO_CACHE_DIR), so a GPU machine that is given the cache only times them:

    .venv/bin/python -m benchmarks.calibration_set --rows qknorm_gqa:1,mla:1 --top 5 --out DIR
    # on the GPU machine: python3 benchmarks/fixture_kernels.py --graphs DIR --verify
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import onnx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlso_cli.ir import serialize  # noqa: E402
from mlso_cli.pipeline.frontend import lift  # noqa: E402
from mlso_cli.search import run as search_run  # noqa: E402
from mlso_cli.search.api import SearchOptions  # noqa: E402
from models.build_models import SPECS  # noqa: E402


def row_programs(name: str, bs: int, top: int, jobs: int) -> list[tuple[str, float, int]]:
    """(μGraph JSON, estimate µs, launches) of the verified searched programs of one row, best
    estimate first; the lifted target (the search's fallback) is left out."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{name}_bs{bs}.onnx"
        onnx.save(SPECS[name].build(bs, "float16", small=False), str(path))
        lifted = lift(str(path))
    target = lifted.regions[0].graph
    result = search_run.search(target, SearchOptions(jobs=jobs, full_checks=top))
    return [
        (serialize.dumps(c.graph), c.estimate_us, c.kernels)
        for c in result.candidates
        if c.graph is not target
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", required=True, help="comma-separated name:batch, e.g. gqa:1,mla:1")
    ap.add_argument("--top", type=int, default=5, help="structures verified and kept per row")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--compile", action="store_true", help="also compile into the kernel cache")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    index_path = args.out / "estimates.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else {}
    for item in args.rows.split(","):
        name, bs = item.split(":")
        t0 = time.time()
        progs = row_programs(name, int(bs), args.top, args.jobs)
        for k, (text, est, launches) in enumerate(progs):
            stem = f"{name}_bs{bs}_c{k}"
            (args.out / f"{stem}.json").write_text(text)
            index[stem] = {"estimate_us": round(est, 3), "launches": launches}
            if args.compile:
                from mlso_cli.codegen import compile_program

                compile_program(serialize.loads(text))
        index_path.write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")
        print(f"{item}: {len(progs)} programs in {time.time() - t0:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
