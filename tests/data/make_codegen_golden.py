"""Record (or check) sha256 of generated source and plans for every graph the tests build.

Why: code generation is being restructured (decide, then print) and must print byte-identical
source for every current program. This script is the safety net's recorder: it walks the test
graphs (tests/test_codegen_graphs.py GRAPHS, tests/fixtures/ugraphs FIXTURES and SMALL_FIXTURES,
tests/test_codegen_stabilise.py CASES, tests/test_libgemm.py GRAPHS, and seeded random graphs
from tests/graphgen.py), and for each, with library GEMMs on and off, hashes
`generate(kg).source`, the launch plan `generate(kg).plan` and the lowering plan
`codegen.plan.plan(kg).to_json()`.

    python tests/data/make_codegen_golden.py          # rewrite tests/data/codegen_golden.json
    python tests/data/make_codegen_golden.py --check  # compare, print the differing names

tests/test_codegen_golden.py checks the same table.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GOLDEN = Path(__file__).with_name("codegen_golden.json")
RANDOM_SEED = 20261205
RANDOM_SMALL = 200
RANDOM_LARGE = 100


def graphs() -> Iterator[tuple[str, Callable]]:
    """(name, builder) for every graph in the table, in a fixed order."""
    from tests import graphgen
    from tests import test_codegen_graphs as T
    from tests import test_codegen_stabilise as S
    from tests import test_libgemm as L
    from tests.fixtures import ugraphs

    for k, f in T.GRAPHS.items():
        yield f"graph_{k}", f
    for k, f in ugraphs.FIXTURES.items():
        yield f"fixture_{k}", f
    for k, f in ugraphs.SMALL_FIXTURES.items():
        yield f"small_{k}", f
    for k, (f, dt) in S.CASES.items():
        yield f"stabilise_{k}", (lambda f=f, dt=dt: f(dt))
    for k, f in L.GRAPHS.items():
        yield f"libgemm_{k}", f
    for i, g in enumerate(graphgen.seeded(RANDOM_SEED, RANDOM_SMALL, small=True)):
        yield f"random_small_{i:03d}_{g.name}", (lambda kg=g.kg: kg)
    for i, g in enumerate(graphgen.seeded(RANDOM_SEED + 1, RANDOM_LARGE, small=False)):
        yield f"random_large_{i:03d}_{g.name}", (lambda kg=g.kg: kg)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _canon(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def record(kg) -> dict[str, str]:
    """sha256 of source, launch plan and lowering plan, library GEMMs on ("lib") and off."""
    from mlso_cli.codegen import generate
    from mlso_cli.codegen.plan import plan

    out: dict[str, str] = {}
    old = os.environ.get("MLSO_LIBRARY_GEMM")
    try:
        for tag, value in (("lib", "1"), ("nolib", "0")):
            os.environ["MLSO_LIBRARY_GEMM"] = value
            gp = generate(kg)
            out[f"{tag}_source"] = _sha(gp.source)
            out[f"{tag}_plan"] = _sha(_canon(gp.plan))
            out[f"{tag}_lowering"] = _sha(_canon(plan(kg).to_json()))
    finally:
        if old is None:
            os.environ.pop("MLSO_LIBRARY_GEMM", None)
        else:
            os.environ["MLSO_LIBRARY_GEMM"] = old
    return out


def table() -> dict[str, dict[str, str]]:
    return {name: record(build()) for name, build in graphs()}


def main(argv: list[str]) -> int:
    now = table()
    if "--check" in argv:
        want = json.loads(GOLDEN.read_text())
        bad = sorted(k for k in set(want) | set(now) if want.get(k) != now.get(k))
        for k in bad:
            print("differs:", k)
        print(f"{len(now) - len(bad)}/{len(now)} graphs identical")
        return 1 if bad else 0
    GOLDEN.write_text(json.dumps(now, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(now)} graphs to {GOLDEN}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
