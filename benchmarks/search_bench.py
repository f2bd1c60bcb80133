"""The search on every benchmark model: what it finds, how fast, against the hand-written fixture.

For each benchmark row (models/build_models.py SPECS, fp16, every batch size) this runs

    mlso optimize MODEL --dry-run --json --jobs 2 --no-cache [--max-states N]

in a subprocess (as a user would, on this machine's cores), reads the region's JSON line, and
compares the chosen program with the fixture of tests/fixtures/ugraphs.py under the same cost
model: launches, and estimated microseconds. A row passes when a searched program was chosen
with no more launches than the fixture and an estimate within 10% of it (or better). Where the
chosen program breaks that (a faster split program with more launches) but another program the
search verified at full shapes meets it, the "found" column says so and gives that program's
figures.

    .venv/bin/python -m benchmarks.search_bench [--only gqa] [--max-states N] [--out FILE]
        [--save DIR] [--jobs N] [--realwidth]

--realwidth searches models/realwidth.py's real-width subgraphs instead (issue 33's table) and
saves each chosen program as DIR/<name>.json.

Prints a Markdown table (stdout) ready for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import onnx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlso_cli.search.cost import program_cost  # noqa: E402
from models.build_models import SPECS  # noqa: E402
from tests.fixtures.ugraphs import fixture  # noqa: E402

TOLERANCE = 1.10


def _search(
    model: onnx.ModelProto,
    stem: str,
    max_states: int | None,
    timeout: float,
    save: Path | None,
    keep_cache: Path | None,
    jobs: int,
    alternatives: bool = True,
) -> tuple[subprocess.CompletedProcess, float, list[tuple[int, float]]]:
    """`mlso optimize --dry-run --json` on `model` with a fresh cache: the completed process,
    its wall seconds and the verified programs; with `save`, the chosen program is written to
    save/<stem>.json (and the other verified ones as <stem>_alt<k>.json when `alternatives`)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{stem}.onnx"
        onnx.save(model, str(path))
        # a fresh cache per row: nothing is served from an earlier run, and the entry this run
        # writes holds the chosen program (the CLI's JSON carries only its figures)
        cmd = [
            sys.executable,
            "-m",
            "mlso_cli",
            "optimize",
            str(path),
            "--dry-run",
            "--json",
            "--jobs",
            str(jobs),
            "--min-speedup",
            "0",
        ]
        if max_states is not None:
            cmd += ["--max-states", str(max_states)]
        t0 = time.monotonic()
        env = {**os.environ, "MLSO_CACHE_DIR": str(Path(tmp) / "cache"), "PYTHONPATH": str(ROOT)}
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
        wall = time.monotonic() - t0
        alts = _verified(Path(tmp) / "cache") if r.returncode == 0 else []
        if save is not None and r.returncode == 0:
            _save_best(Path(tmp) / "cache", save / f"{stem}.json", alternatives)
        if keep_cache is not None and r.returncode == 0 and (Path(tmp) / "cache").is_dir():
            # the search results, so that `optimize --gpu` on the GPU machine starts from them
            shutil.copytree(Path(tmp) / "cache", keep_cache, dirs_exist_ok=True)
    return r, wall, alts


def run_row(
    name: str,
    bs: int,
    max_states: int | None,
    timeout: float,
    save: Path | None = None,
    keep_cache: Path | None = None,
    jobs: int = 2,
) -> dict:
    model = SPECS[name].build(bs, "float16", small=False)
    r, wall, alts = _search(model, f"{name}_bs{bs}", max_states, timeout, save, keep_cache, jobs)
    if r.returncode != 0:
        return {
            "name": name,
            "bs": bs,
            "error": r.stderr.strip().splitlines()[-1:] or ["?"],
            "wall": wall,
        }
    rows = [json.loads(x) for x in r.stdout.splitlines() if x.strip()]
    region = next(x for x in rows if x.get("type") == "region")
    fx = program_cost(fixture(name, False, bs))
    return {
        "name": name,
        "bs": bs,
        "wall": wall,
        "region": region,
        "fixture_us": fx.us,
        "fixture_kernels": fx.launches,
        "verified": alts,
    }


def run_realwidth(
    name: str, max_states: int | None, timeout: float, save: Path | None, jobs: int
) -> str:
    """Search one models/realwidth.py subgraph (no fixture to compare with); save its chosen
    program as save/<name>.json; a Markdown table row."""
    from models.realwidth import REALWIDTH

    r, wall, _ = _search(
        REALWIDTH[name].build(), name, max_states, timeout, save, None, jobs, alternatives=False
    )
    if r.returncode != 0:
        err = (r.stderr.strip().splitlines()[-1:] or ["?"])[0][:80]
        return f"| {name} | error: {err} | | | | | |"
    rows = [json.loads(x) for x in r.stdout.splitlines() if x.strip()]
    regions = [x for x in rows if x.get("type") == "region"]
    g = regions[0] if regions else {}
    return (
        f"| {name} | {len(regions)} | {g.get('states')} | {g.get('verified')} | {wall:.1f} | "
        f"{g.get('kernels')} | {g.get('estimate_us')} | {g.get('onnx_estimate_us')} |"
    )


def _cached_result(cache: Path):
    """The search result a row's fresh cache holds (one region per benchmark model), or None."""
    from mlso_cli.search.cache import result_from_dict

    for entry in sorted(cache.rglob("*.json")):
        try:
            body = json.loads(entry.read_bytes().partition(b"\n")[2])  # line 1: the body's sha256
            return result_from_dict(body["result"])
        except (ValueError, KeyError, TypeError):
            continue
    return None


def _verified(cache: Path) -> list[tuple[int, float]]:
    """(launches, estimate µs) of every program the search verified at full shapes (the lifted
    target, bound 0, is not one)."""
    result = _cached_result(cache)
    if result is None:
        return []
    return [(c.kernels, c.estimate_us) for c in result.candidates if c.bound > 0]


def _save_best(cache: Path, dest: Path, alternatives: bool = True) -> None:
    from mlso_cli.ir import serialize

    result = _cached_result(cache)
    if result is None:
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    for stale in dest.parent.glob(f"{dest.stem}_alt*.json"):  # an earlier run's alternatives
        stale.unlink()
    dest.write_text(serialize.dumps(result.best.graph))
    # the other programs verified at full shapes (the fewest-launch alternative), as
    # <row>_alt<k>.json, so that the GPU times them beside the chosen one
    alts = [c for c in result.candidates[1:] if c.bound > 0] if alternatives else []
    for k, c in enumerate(alts, 1):
        dest.with_name(f"{dest.stem}_alt{k}.json").write_text(serialize.dumps(c.graph))


def table(results: list[dict]) -> str:
    head = (
        "| row | states | pruned | verified | search s | kernels (fixture) | estimate µs | fixture µs | "
        "ratio | bound | found |"
    )
    lines = [head, "|" + "---|" * 11]
    for res in results:
        row = f"{res['name']} bs{res['bs']}"
        if "error" in res:
            lines.append(f"| {row} | error: {res['error'][0][:80]} |" + " |" * 9)
            continue
        g = res["region"]
        est = g.get("estimate_us") or 0.0
        ratio = est / res["fixture_us"] if res["fixture_us"] else float("inf")
        ok = (
            g.get("searched")
            and g.get("kernels", 99) <= res["fixture_kernels"]
            and ratio <= TOLERANCE
            and g.get("verified", 0) > 0
        )
        found = "yes" if ok else "no"
        if not ok and g.get("searched"):
            # the chosen program breaks a criterion (more launches than the fixture, say) while
            # another program the search verified meets both: say so, with its figures
            alt = [
                (k, e)
                for k, e in res.get("verified", [])
                if k <= res["fixture_kernels"] and e / res["fixture_us"] <= TOLERANCE
            ]
            if alt:
                k, e = min(alt, key=lambda ke: ke[1])
                found = f"yes, also verified: {k} launch(es) at {e:.1f} µs"
        lines.append(
            f"| {row} | {g.get('states')} | {g.get('pruned')} | {g.get('verified')} | "
            f"{g.get('search_s', 0):.1f} | {g.get('kernels')} ({res['fixture_kernels']}) | {est:.1f} | "
            f"{res['fixture_us']:.1f} | {ratio:.2f} | {g.get('bound', 0):.2g} | {found} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--only", action="append", default=[], help="benchmark names to run (default: all)"
    )
    ap.add_argument("--max-states", type=int, default=None)
    ap.add_argument(
        "--batch", type=int, action="append", default=[], help="batch sizes to run (default: all)"
    )
    ap.add_argument(
        "--timeout", type=float, default=600.0, help="seconds per row (the issue's limit: 600)"
    )
    ap.add_argument("--out", type=Path, default=None, help="also write the table to this file")
    ap.add_argument(
        "--save", type=Path, default=None, help="write each row's chosen program (μGraph JSON) here"
    )
    ap.add_argument(
        "--keep-cache",
        type=Path,
        default=None,
        help="merge each row's search cache into this folder (for `optimize --gpu` elsewhere)",
    )
    ap.add_argument(
        "--jobs", type=int, default=2, help="optimize's --jobs (2: this machine's cores)"
    )
    ap.add_argument(
        "--realwidth",
        action="store_true",
        help="search models/realwidth.py's subgraphs instead (--only picks names); --save DIR "
        "writes DIR/<name>.json, without alternatives",
    )
    args = ap.parse_args()
    if args.realwidth:
        from models.realwidth import REALWIDTH

        lines = [
            "| subgraph | regions | states | verified | wall s | kernels | estimate µs | "
            "ONNX estimate µs |",
            "|" + "---|" * 8,
        ]
        for name in REALWIDTH:
            if args.only and name not in args.only:
                continue
            try:
                line = run_realwidth(name, args.max_states, args.timeout, args.save, args.jobs)
            except subprocess.TimeoutExpired:
                line = f"| {name} | timed out after {args.timeout:.0f} s | | | | | | |"
            lines.append(line)
            print(line, file=sys.stderr, flush=True)
        print("\n".join(lines))
        return
    results = []
    for name, spec in SPECS.items():
        if args.only and name not in args.only:
            continue
        for bs in spec.batch_sizes:
            if args.batch and bs not in args.batch:
                continue
            try:
                res = run_row(
                    name, bs, args.max_states, args.timeout, args.save, args.keep_cache, args.jobs
                )
            except subprocess.TimeoutExpired:
                res = {
                    "name": name,
                    "bs": bs,
                    "error": [f"timed out after {args.timeout:.0f} s"],
                    "wall": args.timeout,
                }
            results.append(res)
            # the row as it will appear in the table: a run cut short still leaves its rows
            print(table([res]).splitlines()[-1], file=sys.stderr, flush=True)
    text = table(results)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
