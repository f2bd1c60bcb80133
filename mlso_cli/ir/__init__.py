"""The μGraph IR: kernel, block and thread graphs of immutable nodes, and their spec checker.

Semantics (the interpreter, the finite-field checker and code generation all follow this):

  - Kernel level: INPUT, CONST (scalar, shape ()), elementwise unary (EXP, SQUARE, SQRT, RSQRT, RECIPROCAL, NEG, SILU=x*sigmoid(x), SIGMOID, TANH, ERF, GELU = exact erf GELU x*Phi(x), RELU, CAST(arg=DType)), binary with numpy broadcasting (ADD, SUB, MUL, DIV, MAX), MATMUL (batched over leading dims, broadcasting), REDUCE_SUM/MEAN/MAX over one axis with keepdims (arg = non-negative axis), views RESHAPE(arg=shape), TRANSPOSE(arg=perm), BROADCAST(arg=shape); GRAPH_DEF (arg=BlockGraph, src = kernel tensors read through the InputMaps in order) and PROJ(arg=i) selecting its i-th output.
  - Block level: a grid of blocks (x,y,z). `ITER(arg=i)` is this block's tile of kernel input i: for each grid dim g with imap[g]=d, tensor dim d is split into grid[g] equal chunks and the block takes chunk blockIdx[g]; if fmap=f, the for-loop walks dim f in `loop` equal steps (within the block's chunk if a grid dim also splits f), and the ITER is LOOP-phase (else PRE-phase). Ops derive their phase from their sources (PRE<LOOP<POST; mixing LOOP and POST is illegal). Accumulators take LOOP-phase sources and produce POST values: ACC_SUM(x) = sum over steps of x; ACC_EXP_SUM(s) = sum over steps of rowsum(exp(s)) (shape s[:-1]+(1,)); ACC_EXP_WSUM(s, v) = sum over steps of exp(s) @ v. Their exact-arithmetic meaning is the definition; subtracting a running max (online softmax) is an obligation of float code, not IR semantics. SAVE(x, OutputMap) writes the block's tile into output `index`: for each grid dim g, omap[g]=d places blocks side by side along output dim d; omap[g]=PARTIAL makes grid dim g a leading dim of per-block partial results (fp32), later reduced by a kernel-level REDUCE_SUM over that leading dim. Block compute is fp32 (dtype F32) except ITER (input dtype) and SAVE (output dtype); a block-level CAST keeps dtype F32 and rounds its value to the target dtype in arg (so float code may hold it in that dtype).
  - Thread level: THREAD(arg=ThreadGraph(body), src=...) evaluates the elementwise body with THREAD_IN(i) = src[i].

A worked example (split-KV attention as partials plus a combining kernel) is in
tests/test_ir.py::split_kv_attention.
"""

from __future__ import annotations

from mlso_cli.ir.graph import PARTIAL, BlockGraph, InputMap, KernelGraph, OutputMap, ThreadGraph
from mlso_cli.ir.hashing import graph_hash
from mlso_cli.ir.node import Node, toposort
from mlso_cli.ir.ops import DType, Op, Phase
from mlso_cli.ir.printer import format_graph
from mlso_cli.ir.serialize import dumps, loads
from mlso_cli.ir.spec import SpecError, check

__all__ = [
    "PARTIAL",
    "BlockGraph",
    "DType",
    "InputMap",
    "KernelGraph",
    "Node",
    "Op",
    "OutputMap",
    "Phase",
    "SpecError",
    "ThreadGraph",
    "check",
    "dumps",
    "format_graph",
    "graph_hash",
    "loads",
    "toposort",
]
