"""The μGraph IR: kernel, block and thread graphs of immutable nodes, and their spec checker."""

from __future__ import annotations

from mlso_cli.ir.graph import PARTIAL, BlockGraph, InputMap, KernelGraph, OutputMap, ThreadGraph
from mlso_cli.ir.hashing import graph_hash
from mlso_cli.ir.node import Node, toposort
from mlso_cli.ir.ops import DType, Op, Phase
from mlso_cli.ir.printer import format_graph
from mlso_cli.ir.serialize import dumps, loads
from mlso_cli.ir.spec import SpecError, check

__all__ = ["PARTIAL", "BlockGraph", "DType", "InputMap", "KernelGraph", "Node", "Op", "OutputMap", "Phase",
           "SpecError", "ThreadGraph", "check", "dumps", "format_graph", "graph_hash", "loads", "toposort"]
