"""Generated source and plans are byte-identical to the recorded table.

Why: code generation is being restructured into decisions (frozen plans) and printers; every
current program must print exactly as before until a path changes on purpose. The table
(tests/data/codegen_golden.json) holds sha256 of `generate(kg).source`, of its launch plan and of
the lowering plan, library GEMMs on and off, for every graph the tests build plus a few hundred
seeded random graphs. A deliberate change regenerates it with
`python tests/data/make_codegen_golden.py` and says why in its commit.
"""

from __future__ import annotations

import json

from tests.data.make_codegen_golden import GOLDEN, graphs, record


def test_generated_source_and_plans_match_the_golden_table(monkeypatch):
    monkeypatch.delenv("MLSO_LIBRARY_GEMM", raising=False)
    want = json.loads(GOLDEN.read_text())
    names = [name for name, _ in graphs()]
    assert sorted(names) == sorted(want), "the graph list changed: regenerate the table"
    bad = []
    for name, build in graphs():
        got = record(build())
        if got != want[name]:
            bad.append(f"{name}: {sorted(k for k in got if got[k] != want[name].get(k))}")
    assert not bad, f"{len(bad)} of {len(want)} graphs print differently:\n" + "\n".join(bad[:40])
