"""How well the cost model ranks programs the GPU timed, and a grid search over its constants.

Why: the search picks by `search/cost.py` estimates (and `optimize --gpu N` times only its top
candidates), so what matters is the order of programs of one row, not absolute error. Each refit
so far was done by hand from a timing table; this scores any timing file the same way.

    .venv/bin/python -m benchmarks.cost_fit TIMINGS.json [TIMINGS2.json ...] \\
        [--graphs DIR ...] [--fixtures tests.fixtures.ugraphs] \\
        [--grid warp_flops=0.2e12,0.3e12 --grid smem_elem_s=80e-9,160e-9,320e-9] [--top 5]

TIMINGS are `benchmarks/fixture_kernels.py --out` files. A result named `searched:<stem>` is
`<stem>.json` in one of the --graphs folders; any other name is a fixture of --fixtures. A
program's row is its name without the `searched:` prefix and without a trailing `_alt<k>`,
`_c<k>`, `_r<i>_v<j>` or `_w`. Within a row, a pair measured more than --margin apart (10%)
counts as wrong-way when the model orders it the other way round. A row's regret is the
measured time of the program the model ranks first over the row's fastest: what the search's
pick costs (`--by-regret` ranks grid settings by the worst). Prints the score of the
model as it is, then (with --grid) the best settings by wrong-way pairs, then geometric RMS
error of estimate / measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import itertools
import json
import math
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mlso_cli.ir import KernelGraph, serialize  # noqa: E402
from mlso_cli.search.cost import H200, Hardware, program_cost  # noqa: E402

SUFFIX = re.compile(r"(_alt\d+|_c\d+|_r\d+_v\d+|_w)$")


@dataclasses.dataclass(frozen=True)
class Timed:
    name: str
    row: str
    us: float
    graph: KernelGraph


@dataclasses.dataclass(frozen=True)
class Score:
    wrong: int
    pairs: int
    geo_rms: float
    wrong_pairs: tuple[tuple[str, str], ...]
    regret: dict[str, float] = dataclasses.field(default_factory=dict)
    """Per row: the measured time of the program the model ranks first over the row's fastest
    measured program (1.0 when the model picks the fastest; ties go to the slower)."""

    @property
    def worst_regret(self) -> float:
        return max(self.regret.values(), default=1.0)


def row_of(name: str) -> str:
    return SUFFIX.sub("", name.removeprefix("searched:"))


def load(timings: list[Path], graphs: list[Path], fixtures: str) -> list[Timed]:
    """Every timed program whose μGraph can be found (the last timing of a name wins)."""
    module = importlib.import_module(fixtures) if fixtures else None
    found: dict[str, Timed] = {}
    for path in timings:
        for r in json.loads(path.read_text())["results"]:
            name = r["name"]
            if name.startswith("searched:"):
                stem = name.removeprefix("searched:")
                files = [g / f"{stem}.json" for g in graphs if (g / f"{stem}.json").is_file()]
                if not files:
                    continue
                kg = serialize.loads(files[0].read_text())
            elif module is not None and name in module.FIXTURES:
                kg = module.FIXTURES[name]()
            else:
                continue
            found[name] = Timed(name, row_of(name), float(r["us"]), kg)
    return sorted(found.values(), key=lambda t: t.name)


def score(progs: list[Timed], hw: Hardware, margin: float = 1.1) -> Score:
    est = {p.name: program_cost(p.graph, hw).seconds * 1e6 for p in progs}
    rows: dict[str, list[Timed]] = defaultdict(list)
    for p in progs:
        rows[p.row].append(p)
    wrong, pairs, bad = 0, 0, []
    for members in rows.values():
        for a, b in itertools.combinations(members, 2):
            fast, slow = (a, b) if a.us < b.us else (b, a)
            if slow.us < fast.us * margin:
                continue
            pairs += 1
            if est[fast.name] > est[slow.name]:
                wrong += 1
                bad.append((fast.name, slow.name))
    logs = [math.log(est[p.name] / p.us) ** 2 for p in progs]
    geo = math.exp(math.sqrt(sum(logs) / len(logs))) if logs else float("nan")
    regret = {
        row: min(members, key=lambda p: (est[p.name], -p.us)).us / min(p.us for p in members)
        for row, members in rows.items()
    }
    return Score(wrong, pairs, geo, tuple(bad), regret)


def _grid(specs: list[str]) -> list[dict[str, float]]:
    axes = []
    for spec in specs:
        field, _, values = spec.partition("=")
        if field not in {f.name for f in dataclasses.fields(Hardware)}:
            raise SystemExit(f"--grid {spec}: Hardware has no field {field!r}")
        axes.append([(field, float(v)) for v in values.split(",")])
    return [dict(c) for c in itertools.product(*axes)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("timings", nargs="+", type=Path)
    ap.add_argument("--graphs", action="append", type=Path, default=[])
    ap.add_argument("--fixtures", default="tests.fixtures.ugraphs")
    ap.add_argument("--grid", action="append", default=[])
    ap.add_argument("--margin", type=float, default=1.1)
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument(
        "--by-regret",
        action="store_true",
        help="rank settings by worst regret first (what the search's pick costs), then wrong-way",
    )
    args = ap.parse_args()
    progs = load(args.timings, args.graphs, args.fixtures)
    if not progs:
        raise SystemExit("no timed program found: check --graphs and --fixtures")
    now = score(progs, H200, args.margin)
    print(f"{len(progs)} programs in {len({p.row for p in progs})} rows; {now.pairs} pairs")
    print(
        f"model as it is: wrong-way {now.wrong}, geometric RMS error {now.geo_rms:.3f}, "
        f"worst regret {now.worst_regret:.3f}"
    )
    for fast, slow in now.wrong_pairs:
        print(f"  wrong way: {fast} measured faster than {slow}")
    for row, r in sorted(now.regret.items()):
        if r > 1.0:
            print(f"  regret {r:.3f}: {row}'s first-ranked program against its fastest")
    if args.grid:
        results = []
        for setting in _grid(args.grid):
            s = score(progs, dataclasses.replace(H200, **setting), args.margin)
            results.append(
                (s.worst_regret if args.by_regret else 0, s.wrong, s.geo_rms, s, setting)
            )
        results.sort(key=lambda r: r[:3])
        for _, wrong, geo, s, setting in results[: args.top]:
            print(
                f"wrong-way {wrong}, geometric RMS error {geo:.3f}, "
                f"worst regret {s.worst_regret:.3f}: {setting}"
            )


if __name__ == "__main__":
    main()
