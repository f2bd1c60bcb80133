"""Block kernels are planned by functions that return frozen values, and printed from them.

Why: the planner used to be a five-class inheritance tower whose last class printed, so any
printing step could read, or change, planning state. Now blockanalysis.analyse,
blocklayout.plan_layout, blockschedule.schedule_passes and blockio.plan_io each return a frozen
value, and block.py with blockpass/ prints them. These tests hold that: every plan of the golden
table's graphs is frozen all the way down (no list, dict or set inside, no mutable record), so
it hashes and copies; the pass schedule is a table (rules -> step kinds -> printers), not an
if-chain; and the printers import only frozen record types, constants and the two entry points
from the planning modules, never a planner's internals.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import importlib
from fractions import Fraction
from pathlib import Path

import pytest

from mlso_cli.codegen import block, blockio, blockschedule
from mlso_cli.codegen.blockplan import plan_block
from mlso_cli.codegen.frozen import FrozenMap
from mlso_cli.ir import Op
from mlso_cli.ir.node import Node
from tests.data.make_codegen_golden import graphs

SAMPLE = 12
"""Every SAMPLE-th graph of the golden table (all of its first 40: the hand-written ones)."""


def _block_graphs() -> dict[str, object]:
    out = {}
    for i, (name, build) in enumerate(graphs()):
        if i >= 40 and i % SAMPLE:
            continue
        kg = build()
        for j, n in enumerate(x for x in kg.nodes() if x.op is Op.GRAPH_DEF):
            out[f"{name}#{j}"] = n.arg
    return out


BLOCKS = _block_graphs()
PLANS = {name: plan_block(bg) for name, bg in BLOCKS.items()}

ATOMS = (str, int, bool, float, Fraction, type(None), enum.Enum, Node)
"""Values a frozen plan may hold as they are (Node is the IR's immutable node)."""


def _mutable_parts(x: object, path: str, seen: set[int]) -> list[str]:
    """Paths to every list, dict, set or non-frozen record reachable from x."""
    if id(x) in seen or isinstance(x, ATOMS):
        return []
    seen.add(id(x))
    if isinstance(x, (tuple, frozenset)):
        return [p for i, v in enumerate(x) for p in _mutable_parts(v, f"{path}[{i}]", seen)]
    if isinstance(x, FrozenMap):
        return [
            p
            for i, (k, v) in enumerate(x.pairs)
            for p in _mutable_parts(k, f"{path}.key{i}", seen)
            + _mutable_parts(v, f"{path}[{i}]", seen)
        ]
    if dataclasses.is_dataclass(x):
        if not type(x).__dataclass_params__.frozen:
            return [f"{path}: {type(x).__name__} is not frozen"]
        return [
            p
            for f in dataclasses.fields(x)
            for p in _mutable_parts(getattr(x, f.name), f"{path}.{f.name}", seen)
        ]
    return [f"{path}: {type(x).__name__}"]


def test_the_sample_covers_both_paths_and_staging():
    assert len(PLANS) >= 40
    assert {p.path for p in PLANS.values()} == {"register", "shared"}
    kinds = {s.kind for p in PLANS.values() for steps in p.schedule.passes.values() for s in steps}
    assert {"stage", "register", "matmul_node", "reduce"} <= kinds


@pytest.mark.parametrize("name", sorted(PLANS))
def test_the_plan_is_frozen_all_the_way_down(name):
    p = PLANS[name]
    assert _mutable_parts(p, "plan", set()) == []
    hash(p)
    q = dataclasses.replace(p)
    assert q == p and hash(q) == hash(p)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.warps = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        p.storage[next(iter(p.storage))] = None  # type: ignore[index]
    for mp in p.plans.values():
        with pytest.raises(dataclasses.FrozenInstanceError):
            mp.row_scale = "x"  # type: ignore[misc]
        assert isinstance(mp.stages, tuple)
    for g in p.groups.values():
        assert isinstance(g.sums, tuple) and isinstance(g.wsums, tuple)
        with pytest.raises(dataclasses.FrozenInstanceError):
            g.alpha = "x"  # type: ignore[misc]


def test_planning_twice_prints_the_same_decisions():
    """Planning is a function of the graph: a second plan makes the same choices (nodes the
    normalisation creates are new objects, so plans compare by what they print, not by ==)."""
    for bg in list(BLOCKS.values())[:10]:
        a, b = plan_block(bg), plan_block(bg)
        assert a.layout == b.layout and a.names == b.names and a.path == b.path
        sa = [(s.kind, s.note) for steps in a.schedule.passes.values() for s in steps]
        sb = [(s.kind, s.note) for steps in b.schedule.passes.values() for s in steps]
        assert sa == sb


def test_the_schedule_is_a_table_and_every_step_has_a_printer():
    assert isinstance(blockschedule.RULES, tuple)
    for why, predicate, action in blockschedule.RULES:
        assert isinstance(why, str) and callable(predicate) and callable(action)
    kinds = {s.kind for p in PLANS.values() for steps in p.schedule.passes.values() for s in steps}
    assert kinds <= set(block.PRINTERS)
    assert set(blockschedule.OP_PASSES.values()) <= set(block.PRINTERS)
    assert not hasattr(block.BlockKernel, "_pass_list")


def test_the_io_plan_is_frozen():
    for cls in (blockio.IoPlan, blockio.InPlaceTile, blockio.PartialSave):
        assert cls.__dataclass_params__.frozen


DECISIONS = (
    "blockanalysis",
    "blockstorage",
    "blockmatmul",
    "blocklayout",
    "blockregister",
    "blockschedule",
    "blockio",
    "blockplan",
)
"""The planning modules: they decide; the printers read what they return."""
ENTRY_POINTS = {"block.py": {"plan_block", "plan_io"}}
"""Functions a printer module may call: block.emit_graph_def plans, then prints."""


def _allowed(module: str, name: str, printer: str) -> bool:
    """A name a printer may take from a planning module: an entry point of its own, a constant,
    or a frozen record type (what plans are made of); never a private name or a helper."""
    if name.startswith("_"):
        return False
    if name in ENTRY_POINTS.get(printer, set()):
        return True
    value = getattr(importlib.import_module(f"mlso_cli.codegen.{module}"), name)
    if name.isupper():
        return True
    return isinstance(value, type) and (
        (dataclasses.is_dataclass(value) and value.__dataclass_params__.frozen)
        or issubclass(value, FrozenMap)
    )


def _printer_files() -> list[Path]:
    root = Path(block.__file__).parent
    return [root / "block.py", *sorted((root / "blockpass").glob("*.py"))]


@pytest.mark.parametrize("path", _printer_files(), ids=lambda p: p.name)
def test_printers_import_no_planner_internals(path):
    tree = ast.parse(path.read_text())
    bad = []
    aliases: dict[str, str] = {}  # local name -> planning module imported whole
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or node.module is None:
            continue
        if node.module == "mlso_cli.codegen":
            aliases.update({a.asname or a.name: a.name for a in node.names if a.name in DECISIONS})
            continue
        module = node.module.rpartition(".")[2]
        if node.module.startswith("mlso_cli.codegen.") and module in DECISIONS:
            bad += [
                f"{path.name}:{node.lineno} {module}.{a.name}"
                for a in node.names
                if not _allowed(module, a.name, path.name)
            ]
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and not _allowed(aliases[node.value.id], node.attr, path.name)
        ):
            bad.append(f"{path.name}:{node.lineno} {aliases[node.value.id]}.{node.attr}")
    assert not bad, bad


def test_the_printer_holds_no_planner():
    """BlockKernel keeps the plans it prints and the kernel context; nothing it holds is a
    planning draft (blockstorage.Draft) or a mutable mapping of storage."""
    tree = ast.parse(Path(block.__file__).read_text())
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert not names & {"Draft", "plan_layout", "analyse", "schedule_passes", "plan_matmul"}
    init = next(
        n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "__init__"
    )
    dict_calls = [
        n
        for n in ast.walk(init)
        if isinstance(n, ast.AnnAssign)
        and "dict[Node" in ast.unparse(n.annotation)
        and "storage" in ast.unparse(n.target)
    ]
    assert not dict_calls


def test_a_frozen_map_is_read_only_hashable_and_copies():
    import copy
    import pickle

    m = FrozenMap({"a": (1, 2), "b": 3})
    assert (
        m == {"a": (1, 2), "b": 3}
        and list(m) == ["a", "b"]
        and m.pairs == (("a", (1, 2)), ("b", 3))
    )
    for twin in (pickle.loads(pickle.dumps(m)), copy.deepcopy(m), copy.copy(m)):
        assert twin == m and hash(twin) == hash(m)
    with pytest.raises(TypeError):
        m["c"] = 4  # type: ignore[index]
    with pytest.raises(AttributeError):
        m._d = {}  # type: ignore[misc]
    p = next(iter(PLANS.values()))
    assert copy.deepcopy(p).layout == p.layout
