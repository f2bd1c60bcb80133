"""Decide, then print: one frozen BlockPlan per graph-defined kernel, printed without the Lowering.

Why: the printer of a block kernel used to be the last class of the planners' tower and reach
back into the Lowering; a decision could then be changed while printing. These tests hold the
separation: the plan is frozen and read-only, its layout is the figure the architecture check
uses, and the printers (block.py's BlockKernel, codegen/blockpass/) name no Lowering.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from mlso_cli.codegen import block
from mlso_cli.codegen.blocklayout import smem_layout
from mlso_cli.codegen.blockplan import BlockPlan, plan_block
from mlso_cli.ir import Op
from tests import test_codegen_graphs as T
from tests import test_codegen_stabilise as S
from tests.fixtures import ugraphs


def _block_graphs() -> dict[str, object]:
    graphs = {f"graph_{k}": f() for k, f in T.GRAPHS.items()}
    graphs.update({f"small_{k}": f() for k, f in ugraphs.SMALL_FIXTURES.items()})
    graphs.update({f"stabilise_{k}": f(dt) for k, (f, dt) in S.CASES.items()})
    out = {}
    for name, kg in graphs.items():
        for i, n in enumerate(x for x in kg.nodes() if x.op is Op.GRAPH_DEF):
            out[f"{name}#{i}"] = n.arg
    return out


BLOCKS = _block_graphs()


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_the_plan_is_the_layout_the_architecture_check_reads(name):
    bg = BLOCKS[name]
    p = plan_block(bg)
    assert p.layout == smem_layout(bg)
    assert p.threads == 32 * p.warps == p.layout.threads
    assert p.path == ("register" if p.layout.register_path else "shared")
    assert set(p.loop_iters) <= set(p.iters) and p.direct <= set(p.iters)


def test_the_plan_is_frozen_and_read_only():
    bg = next(iter(BLOCKS.values()))
    p = plan_block(bg)
    assert dataclasses.is_dataclass(p) and BlockPlan.__dataclass_params__.frozen
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.warps = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        p.storage[next(iter(p.storage))] = None  # type: ignore[index]


def test_some_test_graph_takes_each_path():
    paths = {plan_block(bg).path for bg in BLOCKS.values()}
    assert paths == {"register", "shared"}


def test_the_printers_name_no_lowering():
    root = Path(block.__file__).parent
    files = [root / "block.py", *sorted((root / "blockpass").glob("*.py"))]
    for path in files:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                assert node.attr != "lw", f"{path.name}:{node.lineno} reads .lw"
        if path.name == "block.py":
            continue  # emit_graph_def adapts the Lowering into a KernelContext
        for node in ast.walk(tree):
            if isinstance(node, (ast.Name, ast.arg)):
                name = node.id if isinstance(node, ast.Name) else node.arg
                assert name not in ("lw", "Lowering"), f"{path.name}:{node.lineno}: {name}"
    init = ast.parse((root / "block.py").read_text())
    cls = next(n for n in init.body if isinstance(n, ast.ClassDef) and n.name == "BlockKernel")
    assert not cls.bases, "BlockKernel prints a plan; it inherits no planner"


@pytest.mark.parametrize(
    "module, printer, plan_type",
    [
        ("matmulkernel", "print_matmul", "MatmulKernelPlan"),
        ("reducekernel", "print_reduce", "ReduceKernelPlan"),
        ("kernels", "print_elementwise", "ElementwiseKernelPlan"),
    ],
)
def test_kernel_level_printers_read_their_plan_not_the_lowering(module, printer, plan_type):
    import importlib

    mod = importlib.import_module(f"mlso_cli.codegen.{module}")
    tree = ast.parse(Path(mod.__file__).read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == printer)
    names = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)}
    names |= {a.arg for a in fn.args.args}
    assert not names & {"lw", "Lowering"}
    assert [a.arg for a in fn.args.args][:2] == ["plan", "site"]
    assert getattr(mod, plan_type).__dataclass_params__.frozen
