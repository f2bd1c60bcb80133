"""Two checks of an MlsoKernel that do not go through the lifter: its μGraph against onnx's
reference evaluator on the original nodes, and its generated source on the host emulator.

Why the first: the field check compares a kernel's μGraph with its lifted fallback body, and
both sides come out of `frontend/lift.py`; a lifting rule that gets an op wrong (a softmax over
the wrong axis, a dropped bias) puts the same mistake on both sides, and the field check
passes it. Here the μGraph, run in the interpreter's float64 mode, is compared with onnx's
`ReferenceEvaluator` on the region's own ONNX nodes (the fallback body, promoted to float64 by
`reference64.py`, which also works around the evaluator's pre-opset-13 Softmax), at several
kinds of inputs. The constants the kernel takes (weights, the 0/1 masks lifting derives from
a `Where`) are fed their stored values, never random ones, and are compared as values with the
original model's: a weight altered in B would otherwise be read by the kernel and by its
fallback body alike, and every check that compares the two would pass.

Why the second: the chain check ties the source to the μGraph by regenerating it, so a bug in
code generation is regenerated too. Running the very source on the CPU (codegen/hostemu.py)
with the same inputs and comparing it with the same fp64 reference catches it, where the
kernel is small enough to emulate (one OS thread per CUDA thread).
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from mlso_cli.frontend.siblings import PREFIX as CONCAT_PREFIX
from mlso_cli.ir import DType, KernelGraph, Op
from mlso_cli.ir.node import toposort
from mlso_cli.verify.floatcheck import LIMITS

KINDS: tuple[str, ...] = ("random", "large", "cancel", "offset")
"""Input kinds, each drawn once per kernel:
random  standard normal;
large   standard normal times 1e3 (sums of squares, rsqrt, softmax logits);
cancel  1e3 * (u - roll(u, 1, last axis)) + v, u and v standard normal: large elements whose
        sums along the last axis cancel down to the small part;
offset  standard normal + 100 (a norm must subtract the mean before it squares).
The magnitudes (1e3, 100) shrink where the float64 evaluation overflows: see _MAGNITUDES.
Integer inputs are drawn over their whole valid range in every kind (indices into a table of
known size from -size to size - 1, other integers over the dtype's range up to 2^31), and
boolean inputs over {0, 1}."""

_SHRINK = tuple(10 ** (k / 2) for k in range(6, -1, -1))
"""1e3 down to 1 in steps of sqrt(10)."""

_MAGNITUDES: dict[str, tuple[float, ...]] = {
    "random": (1.0,),
    "large": _SHRINK,
    "cancel": _SHRINK,
    "offset": _SHRINK[2:],
}
"""Magnitudes tried in order for each kind: the first at which both the fp64 reference and the
μGraph's float64 run are finite is used. The float64 mode sums exps without a running max (the
exact semantics), so logits beyond about 709 overflow there where onnx's stabilised Softmax does
not; such inputs say nothing about lifting (attention logits grow with the square of the input
magnitude, so a 16-wide attention runs "large" at about 3). At the last magnitude, 1, the
comparison runs whatever the μGraph gives: not finite where the reference is, is an infinite
error."""

FP64_TOLERANCE = 2.0**-30
"""Largest norm-wise relative error between the μGraph and the reference, both in float64.
Derivation: fp64's unit roundoff is u = 2^-53, and a result of reductions of n terms with
condition number k is accurate to about n * k * u. The inputs here reach k ~ 1e4 (a one-pass
variance at an offset of 100 squares the offset's ratio) and reductions of hundreds to
thousands of terms, so 2^23 * u = 2^-30 (9.3e-10) bounds the rounding of any correct pair.
Measured on the small fixtures: at most 7e-13 (layernorm_linear's one-pass variance at
+100), 1e-16 to 1e-15 elsewhere. A lifting mistake is far above: a wrong axis or a dropped
term is O(1), an epsilon off by 1e-6 in a norm about 5e-6 at unit inputs."""

ERF_TOLERANCE = 1e-6
"""The tolerance when the μGraph has an ERF or GELU: lifting snaps the constant that scales an
erf argument to exactly 1/sqrt(2) when it is within 1e-6 of it (the canonical GELU of
docs/verification.md), so the μGraph may differ from the original nodes by that much by design
(fp32 spellings of 1/sqrt(2) are 1.7e-8 away)."""

LIFT_CHECK_ELEMENTS = 1 << 22
"""Largest kernel (input and output elements) whose lifting check runs: the interpreter and
onnx's evaluator are numpy, four input kinds each, and a full-size attention region takes
seconds per run. The same limit as the float check's."""

EMULATOR_THREADS = 1 << 15
"""Largest kernel (CUDA threads summed over its launches, grid times block) run on the host
emulator: each CUDA thread is an OS thread, about 50 us each on a 2-core machine, so a kernel
at the limit takes about 1.6 s per input kind."""

OWN_ERROR_FACTOR = 8.0
"""The emulator check's allowance beyond the dtype's limit: this many times the larger of the
region's fp32 errors at the same inputs (its original nodes in ONNX Runtime on the CPU, and its
μGraph in the interpreter's float32 mode, which computes what code generation computes). Why
not verify's twice: where fp32 cancels (a mean of 100 before a one-pass variance), correct fp32
programs differ from each other severalfold (measured on the norm fixtures over 12 seeds: the
emulated source up to 2.85 times the float32 mode, 21 times ONNX Runtime's two-pass LayerNorm),
so twice would fail correct kernels at random; a code generation mistake (a wrong index, a
missing barrier, an unstabilised exp) is O(1) or not finite, far beyond. Where the region is
well conditioned the own errors are ~1e-7 and the dtype's limit is what applies."""

LIFTER_CONSTANTS = ("mlso_mask_", "mlso_causal_tl_", "mlso_select_", "mlso_bias_", CONCAT_PREFIX)
"""Name prefixes of the constants lifting itself makes (frontend/lift.py): the original model
has no tensor of that name; their value is what lifting the original nodes derives."""

_ABSORBED = re.compile(r"^(.*)__mlso_r\d+$")
"""A fallback body's own copy of an original constant (package/absorb.py): NAME__mlso_rK."""


@dataclass
class Case:
    """One drawn input set for one kernel, with the fp64 reference of its original nodes."""

    kind: str
    magnitude: float
    inputs: list[np.ndarray]
    """In the μGraph's input order, stored in each input's dtype (constants as stored in B)."""
    reference: list[np.ndarray]
    """fp64 outputs of the original nodes, in the μGraph's output order."""
    feeds: dict[str, np.ndarray] = field(default_factory=dict)
    """The body model's graph inputs (what ONNX Runtime is fed for its own error)."""
    ugraph: list[np.ndarray] | None = None
    """The μGraph's float64 outputs at these inputs (computed once, while drawing)."""

    @property
    def label(self) -> str:
        if self.kind == "random":
            return "random"
        m = f"{self.magnitude:.0f}" if self.magnitude >= 10 else f"{self.magnitude:.3g}"
        return f"offset(+{m})" if self.kind == "offset" else f"{self.kind}(x{m})"


@dataclass
class CheckOutcome:
    """One check of one kernel: ran and passed, ran and failed, or skipped, with why."""

    status: str
    """"ok", "failed" or "skipped"."""
    detail: str
    worst: float | None = None
    output: str = ""
    """The output that failed, when one did."""

    def text(self) -> str:
        """The report's one-cell form, as verify's other per-kernel fields are written."""
        word = {"ok": "ok", "failed": "FAILED", "skipped": "skipped"}[self.status]
        return f"{word}: {self.detail}" if self.detail else word


def index_bounds(model: onnx.ModelProto) -> dict[str, int]:
    """For integer graph inputs that index a tensor of known shape (Gather, GatherElements,
    GatherND's first axis), the number of valid indices: verify draws them over that whole
    range. Why: drawn from {0, 1} only, a model whose embedding rows 2..999 differ passed."""
    shapes = {t.name: tuple(t.dims) for t in model.graph.initializer}
    for vi in list(model.graph.input) + list(model.graph.value_info):
        dims = vi.type.tensor_type.shape.dim
        if dims and all(d.HasField("dim_value") for d in dims):
            shapes.setdefault(vi.name, tuple(d.dim_value for d in dims))
    bounds: dict[str, int] = {}
    for n in model.graph.node:
        if n.op_type not in ("Gather", "GatherElements", "GatherND") or len(n.input) < 2:
            continue
        data = shapes.get(n.input[0])
        if not data:
            continue
        axis = (
            next((a.i for a in n.attribute if a.name == "axis"), 0)
            if n.op_type != "GatherND"
            else 0
        )
        size = data[axis % len(data)]
        if size > 0:
            bounds[n.input[1]] = min(bounds.get(n.input[1], size), size)
    return bounds


def draw_input(
    kind: str,
    shape: tuple[int, ...],
    dtype: np.dtype,
    rng: np.random.Generator,
    magnitude: float = 1.0,
    bound: int | None = None,
) -> np.ndarray:
    """One input of the given kind (see KINDS), stored in `dtype`."""
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(dtype)
    if dtype.kind in "iu":
        if bound is not None:
            return rng.integers(-bound if dtype.kind == "i" else 0, bound, shape).astype(dtype)
        info = np.iinfo(dtype)
        lo, hi = max(int(info.min), -(2**31)), min(int(info.max), 2**31 - 1)
        return rng.integers(lo, hi, shape, endpoint=True).astype(dtype)
    u = rng.standard_normal(shape)
    if kind == "large":
        x = u * magnitude
    elif kind == "cancel":
        x = magnitude * (u - np.roll(u, 1, axis=-1)) + rng.standard_normal(shape) if shape else u
    elif kind == "offset":
        x = u + magnitude
    else:
        x = u
    with np.errstate(over="ignore"):
        return np.asarray(x).astype(dtype)


def _all_ops(kg: KernelGraph) -> set[Op]:
    """Every op of the graph, inside block graphs and thread bodies too."""
    ops: set[Op] = set()
    todo = list(kg.nodes())
    while todo:
        n = todo.pop()
        ops.add(n.op)
        if n.op is Op.GRAPH_DEF:
            todo.extend(n.arg.nodes())
        elif n.op is Op.THREAD:
            todo.extend(toposort([n.arg.body]))
    return ops


def tolerance(program: KernelGraph) -> float:
    """FP64_TOLERANCE, or ERF_TOLERANCE for a μGraph with an erf (see both)."""
    return ERF_TOLERANCE if _all_ops(program) & {Op.ERF, Op.GELU} else FP64_TOLERANCE


def relative_error(out: np.ndarray, ref: np.ndarray) -> float:
    """||out - ref|| / ||ref||, the absolute norm when ref is zero, inf when out is not finite."""
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if out.shape != ref.shape:
        return float("inf")
    if not np.all(np.isfinite(out)):
        return float("inf")
    num, den = float(np.linalg.norm(out - ref)), float(np.linalg.norm(ref))
    return num / den if den > 0 else num


# ---- constants ---------------------------------------------------------------------------------


class Constants:
    """A graph's constants by name (initializers and Constant nodes), each converted to numpy only
    when asked for: a large model's weights are not copied for the few a kernel takes."""

    def __init__(self, g: onnx.GraphProto) -> None:
        self._inits = {t.name: t for t in g.initializer}
        self._nodes = {
            n.output[0]: n
            for n in g.node
            if n.op_type == "Constant" and n.domain in ("", "ai.onnx") and n.output
        }

    def __contains__(self, name: object) -> bool:
        return name in self._inits or name in self._nodes

    def get(self, name: str) -> np.ndarray | None:
        from mlso_cli.frontend.fold import constant_node_value

        if name in self._inits:
            return numpy_helper.to_array(self._inits[name])
        if name in self._nodes:
            return constant_node_value(self._nodes[name])
        return None


class Originals:
    """Constant values of the original model A by name: initializers and Constant nodes, and on
    a miss the constants that folding A's shape arithmetic gives (optimize folds before it
    partitions, so a kernel may take a folded tensor A computes from constants)."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        self.plain = Constants(model.graph)
        self.folded: Constants | None = None
        self.producers: dict[str, onnx.NodeProto] | None = None

    def get(self, name: str) -> np.ndarray | None:
        if name in self.plain:
            return self.plain.get(name)
        if self.folded is None:
            from mlso_cli.frontend.fold import fold_constants

            m = onnx.ModelProto()
            m.CopyFrom(self.model)
            self.folded = Constants(onnx.GraphProto())
            # folding is best effort: a name it cannot give has no original
            with contextlib.suppress(Exception):
                self.folded = Constants(fold_constants(m).graph)
        return self.folded.get(name)

    def weight_of(self, output: str) -> np.ndarray | None:
        """The constant weight (second input) of A's MatMul that produces `output`; None when
        A has no such MatMul or its weight is not a constant."""
        if self.producers is None:
            self.producers = {o: n for n in self.model.graph.node for o in n.output if o}
        n = self.producers.get(output)
        if n is None or n.op_type != "MatMul" or n.domain not in ("", "ai.onnx"):
            return None
        return self.get(n.input[1]) if len(n.input) == 2 else None


def _difference(got: np.ndarray, want: np.ndarray) -> str | None:
    """None when the two are the same value (dtype, shape and every bit), else what differs."""
    got, want = np.asarray(got), np.asarray(want)
    if got.dtype != want.dtype:
        return f"dtype {got.dtype}, the original's is {want.dtype}"
    if got.shape != want.shape:
        return f"shape {got.shape}, the original's is {want.shape}"
    if np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes():
        return None
    g64, w64 = got.astype(np.float64), want.astype(np.float64)
    with np.errstate(invalid="ignore"):
        differ = ~((g64 == w64) | (np.isnan(g64) & np.isnan(w64)))
    count = int(np.count_nonzero(differ))
    if count == 0:  # equal as numbers, different bits (-0.0, NaN payloads)
        return "its bits differ from the original's (signed zeros or NaN payloads)"
    largest = float(np.nanmax(np.abs(g64[differ] - w64[differ])))
    return f"{count} of {got.size} elements differ from the original's (largest by {largest:.3g})"


def kernel_constants(
    model: onnx.ModelProto, node: onnx.NodeProto, constants: Constants | None = None
) -> dict[str, np.ndarray]:
    """The kernel's inputs that are constants of `model` (initializers or Constant nodes of the
    main graph), by name: the weights and masks it holds rather than computes."""
    constants = constants or Constants(model.graph)
    out = {x: constants.get(x) for x in list(node.input)[1:] if x in constants}
    return {x: v for x, v in out.items() if v is not None}


def constant_problems(
    original: onnx.ModelProto,
    model: onnx.ModelProto,
    node: onnx.NodeProto,
    held: dict[str, np.ndarray] | None = None,
    originals: Originals | None = None,
    body: onnx.ModelProto | None = None,
) -> list[str]:
    """Each constant the kernel or its fallback body holds that is not the original's value.

    Originals: A's tensor of the same name (a body's copy NAME__mlso_rK is A's NAME); for the
    masks lifting derives, the array that lifting the fallback body derives; for a concatenation
    of sibling weights the body reads in column Slices (package/absorb.py), A's weights
    (`_concat_problems`). A constant with no original at all is a problem too: optimize makes no
    other kind."""
    from mlso_cli.frontend.fold import constant_node_value
    from mlso_cli.package.unpack import fallback_function

    originals = originals or Originals(original)
    held = held if held is not None else kernel_constants(model, node)
    problems: list[str] = []
    derived: dict[str, np.ndarray] | None = None
    fn = fallback_function(model, node)
    formal = dict(zip(node.input, fn.input)) if fn is not None else {}
    bounds: set[str] = set()
    for name, value in held.items():
        if name.startswith(CONCAT_PREFIX) and fn is not None and _body_reads(fn, formal.get(name)):
            found, used = _concat_problems(originals, fn, formal[name], name, value)
            problems.extend(found)
            bounds |= used
            continue
        if name.startswith(LIFTER_CONSTANTS):
            if derived is None:
                derived = _derived_constants(model, node, body)
            want = derived.get(name) if isinstance(derived, dict) else None
            if want is None:
                why = derived if isinstance(derived, str) else "lifting its body derives none"
                problems.append(f"constant '{name}' has no original to compare with ({why})")
                continue
        else:
            want = originals.get(name)
            if want is None:
                problems.append(f"constant '{name}' is not a tensor of the original model")
                continue
        diff = _difference(value, want)
        if diff is not None:
            problems.append(f"constant '{name}': {diff}")
    for n in fn.node if fn is not None else []:
        if n.op_type != "Constant" or n.domain not in ("", "ai.onnx") or not n.output:
            continue
        if n.output[0] in bounds:  # a column Slice's bounds, checked with its concatenation
            continue
        value = constant_node_value(n)
        m = _ABSORBED.match(n.output[0])
        name = m.group(1) if m else n.output[0]
        want = originals.get(name)
        if value is None or want is None:
            problems.append(
                f"its fallback body's constant '{n.output[0]}' is not a tensor of the original model"
            )
            continue
        diff = _difference(value, want)
        if diff is not None:
            problems.append(f"its fallback body's constant '{n.output[0]}': {diff}")
    return problems


def _body_reads(fn: onnx.FunctionProto, name: str | None) -> bool:
    return name is not None and any(name in n.input for n in fn.node)


def _concat_problems(
    originals: Originals, fn: onnx.FunctionProto, formal: str, name: str, value: np.ndarray
) -> tuple[list[str], set[str]]:
    """A concatenation of sibling weights (frontend/siblings.py) that the fallback body `fn`
    reads as `formal`, compared with the original model A's weights: what differs, and the
    names of the body's Constants that bound its column Slices (checked here, so the caller
    does not look for them in A).

    Why A and not the body: the body reads each sibling MatMul's weight as a Slice of this very
    tensor, so lifting the body would derive back whatever the tensor holds, and a concatenation
    tampered with together with the body would pass. Instead every reader of it in the body must
    be a Slice of columns start:end with constant bounds, each Slice read only as the weight
    (second input) of MatMuls, and those columns must be, bit for bit, the constant weight of
    the MatMul in A that produces the same output; and every column must be read so (the kernel
    may read a column that the body does not, and nothing would tie it to A)."""
    from mlso_cli.frontend.fold import constant_node_value

    label = f"constant '{name}'"
    value = np.asarray(value)
    if value.ndim != 2:
        return [f"{label}: shape {value.shape}, a concatenation of weights is a matrix"], set()
    consts = {
        n.output[0]: n
        for n in fn.node
        if n.op_type == "Constant" and n.domain in ("", "ai.onnx") and n.output
    }
    nodes = list(fn.node)
    readers: dict[str, list[tuple[int, int]]] = {}  # tensor -> (node index, input position)
    for i, n in enumerate(nodes):
        for k, x in enumerate(n.input):
            readers.setdefault(x, []).append((i, k))
    problems: list[str] = []
    covered = np.zeros(value.shape[1], dtype=bool)
    slices: set[int] = set()
    for i, k in readers.get(formal, []):
        s = nodes[i]
        if s.op_type != "Slice" or s.domain not in ("", "ai.onnx") or k != 0 or len(s.input) < 3:
            problems.append(f"{label}: its fallback body reads it other than in column Slices")
            continue
        args = [constant_node_value(consts[x]) if x in consts else None for x in s.input[1:]]
        if any(a is None for a in args):
            problems.append(f"{label}: a Slice of it in its fallback body has bounds that vary")
            continue
        starts, ends = np.ravel(args[0]), np.ravel(args[1])
        axes = np.ravel(args[2]) if len(args) > 2 else np.array([0])
        steps = np.ravel(args[3]) if len(args) > 3 else np.array([1])
        if not (len(starts) == len(ends) == len(axes) == len(steps) == 1) or (
            int(axes[0]) not in (1, -1) or int(steps[0]) != 1
        ):
            problems.append(f"{label}: a Slice of it in its fallback body is not of columns")
            continue
        start, end, _ = slice(int(starts[0]), int(ends[0])).indices(value.shape[1])
        slices.add(i)
        users = readers.get(s.output[0], [])
        if users:  # columns nothing reads cover nothing
            covered[start:end] = True
        for j, pos in users:
            mm = nodes[j]
            out = mm.output[0] if mm.output else ""
            want = originals.weight_of(out) if mm.op_type == "MatMul" and pos == 1 else None
            if want is None:
                problems.append(
                    f"{label}: columns {start}:{end} feed a node that is not a MatMul of the "
                    f"original model with a constant weight ('{out or mm.op_type}')"
                )
                continue
            diff = _difference(value[:, start:end], want)
            if diff is not None:
                problems.append(f"{label}: columns {start}:{end} (the weight of '{out}'): {diff}")
    if not covered.all():
        first = int(np.argmin(covered))
        problems.append(
            f"{label}: {int((~covered).sum())} of its {covered.size} columns (from column "
            f"{first}) are read by no MatMul of its fallback body, so nothing ties them to "
            "the original model's weights"
        )
    bounds = {
        x
        for i in slices
        for x in nodes[i].input[1:]
        if all(j in slices and k >= 1 for j, k in readers.get(x, []))
    }
    return problems, bounds


def _derived_constants(
    model: onnx.ModelProto, node: onnx.NodeProto, body: onnx.ModelProto | None = None
) -> dict[str, np.ndarray] | str:
    """The constants lifting derives from the fallback body (its masks), or why there are none.
    `body`: region_model's model of it, when the caller has one."""
    from mlso_cli.frontend.lift import lift_whole_graph, merged_kernel
    from mlso_cli.frontend.load import loaded_from_proto
    from mlso_cli.package.regionmodel import region_model

    try:
        loaded = loaded_from_proto(body or region_model(model, node), f"body of {node.name}")
        merged = merged_kernel(node.input[1:])  # in the kernel's form, whatever the knob says
        return dict(lift_whole_graph(loaded, merged=merged).extra_inputs)
    except Exception as exc:  # LiftError, or a body that does not load: no original, say why
        return f"its fallback body cannot be lifted: {str(exc)[:200]}"


# ---- the lifting check -------------------------------------------------------------------------


def _elements(program: KernelGraph) -> int:
    return sum(n.numel for n in list(program.inputs) + list(program.outputs))


def _np_dtype(dtype: DType) -> np.dtype:
    from mlso_cli.runtime.launcher import numpy_dtype

    return numpy_dtype(dtype.value)


def draw_cases(
    body: onnx.ModelProto,
    program: KernelGraph,
    constants: dict[str, np.ndarray],
    seed: int,
    kinds: Sequence[str] = KINDS,
) -> tuple[list[Case], list[str]]:
    """Input sets of each kind for the μGraph and the fp64 reference of `body` (the original
    nodes as a standalone model, region_model's) at them; and, for kinds that give none, why.

    Constants are fed their values; every other input is drawn. Each kind tries its magnitudes
    (_MAGNITUDES) until the reference and the μGraph's float64 run are both finite."""
    from mlso_cli.verify import interpreter
    from mlso_cli.verify.reference64 import Reference

    fp64_reference = Reference(body)  # promoted once for every kind and magnitude
    outs = [o.name for o in body.graph.output]
    body_inputs = {i.name for i in body.graph.input} - {t.name for t in body.graph.initializer}
    bounds = index_bounds(body)
    cases: list[Case] = []
    skipped: list[str] = []
    for k, kind in enumerate(kinds):
        last = None
        for magnitude in _MAGNITUDES[kind]:
            rng = np.random.default_rng([seed, k])
            ins = [
                constants[name]
                if name in constants
                else draw_input(
                    kind, node.shape, _np_dtype(node.dtype), rng, magnitude, bounds.get(name)
                )
                for name, node in zip(program.input_names, program.inputs)
            ]
            by_name = dict(zip(program.input_names, ins))
            feeds = {x: by_name[x] for x in body_inputs if x in by_name}
            missing = body_inputs - set(feeds)
            for x in missing:  # a tensor the body reads but the μGraph does not take
                vi = next(i for i in body.graph.input if i.name == x)
                tt = vi.type.tensor_type
                shape = tuple(d.dim_value for d in tt.shape.dim)
                feeds[x] = draw_input(
                    kind,
                    shape,
                    onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type),
                    rng,
                    magnitude,
                    bounds.get(x),
                )
            with np.errstate(all="ignore"):
                ref = fp64_reference(
                    {
                        n: v.astype(np.float64) if v.dtype.kind not in "biu" else v
                        for n, v in feeds.items()
                    },
                )
            reference = [np.asarray(ref[o], np.float64) for o in outs]
            if not all(np.all(np.isfinite(r)) for r in reference):
                continue
            with np.errstate(all="ignore"):
                xs = [np.asarray(x, np.float64) for x in ins]
                got = interpreter.run(program, xs, "float64")
            last = Case(kind, magnitude, ins, reference, feeds, [np.asarray(g) for g in got])
            if all(np.all(np.isfinite(g)) for g in last.ugraph):
                break
        if last is None:
            skipped.append(f"{kind}: the fp64 reference is not finite at any magnitude tried")
        else:
            cases.append(last)
    return cases, skipped


def compare_with_reference(
    program: KernelGraph, names: Sequence[str], cases: Sequence[Case]
) -> CheckOutcome:
    """The μGraph's float64 outputs against the fp64 reference at every case, within
    `tolerance(program)`; the first output beyond it fails, named."""
    from mlso_cli.verify import interpreter

    tol = tolerance(program)
    worst = 0.0
    for case in cases:
        got = case.ugraph
        if got is None:
            xs = [np.asarray(x, np.float64) for x in case.inputs]
            with np.errstate(all="ignore"):
                got = interpreter.run(program, xs, "float64")
        for name, g, r in zip(names, got, case.reference):
            err = relative_error(np.asarray(g), r)
            if not err <= tol:
                by = f"by {err:.3g}" if math.isfinite(err) else "(it is not finite there)"
                return CheckOutcome(
                    "failed",
                    f"output '{name}' differs from onnx's reference evaluator on the original "
                    f"nodes {by} at {case.label} inputs (tolerance {tol:.3g})",
                    err,
                    name,
                )
            worst = max(worst, err)
    ran = ", ".join(c.label for c in cases)
    return CheckOutcome("ok", f"{worst:.3g} (tolerance {tol:.3g}) at {ran}", worst)


def check_kernel(
    original: onnx.ModelProto,
    model: onnx.ModelProto,
    node: onnx.NodeProto,
    program: KernelGraph,
    gp: Any,
    seed: int,
    *,
    lift: str | None = None,
    emulate: str | None = None,
    infos: dict[str, onnx.ValueInfoProto] | None = None,
    originals: Originals | None = None,
    constants: Constants | None = None,
) -> dict[str, CheckOutcome]:
    """The lifting check and the emulator check of one MlsoKernel node of `model` (B), whose
    μGraph is `program` and generated program `gp`, against the original model `original` (A).

    `lift` / `emulate`: None to run that check, else the reason it is skipped. Both checks use
    the same drawn inputs and the same fp64 reference. `infos`, `originals`, `constants`: B's
    value infos, A's and B's constants, when the caller checks several kernels of one model.
    Returns {"lifting": CheckOutcome, "emulator": CheckOutcome}.
    """
    from mlso_cli.package.regionmodel import region_model

    out: dict[str, CheckOutcome] = {}
    if lift is not None:
        out["lifting"] = CheckOutcome("skipped", lift)
    if emulate is not None:
        out["emulator"] = CheckOutcome("skipped", emulate)
    elif gp is None:
        out["emulator"] = CheckOutcome("skipped", "its μGraph generates no source")
    if "lifting" in out and "emulator" in out:
        return out  # nothing left to run
    try:
        body = region_model(model, node, infos)
    except ValueError as exc:  # no fallback body: nothing to compare with
        why = f"its original nodes cannot be cut out: {exc}"
        out.setdefault("lifting", CheckOutcome("failed", why))
        out.setdefault("emulator", CheckOutcome("skipped", why))
        return out
    if "lifting" not in out:
        problems = constant_problems(original, model, node, originals=originals, body=body)
        if problems:
            out["lifting"] = CheckOutcome(
                "failed", "constants that are not the original model's: " + "; ".join(problems[:3])
            )
    size = _elements(program)
    if size > LIFT_CHECK_ELEMENTS:
        why = f"{size} input and output elements (limit {LIFT_CHECK_ELEMENTS})"
        out.setdefault("lifting", CheckOutcome("skipped", why + "; constants compared"))
        out.setdefault("emulator", CheckOutcome("skipped", why))
        return out
    names = [o.name for o in body.graph.output]
    if len(names) != len(program.outputs):
        why = f"its μGraph has {len(program.outputs)} outputs, its original nodes {len(names)}"
        out.setdefault("lifting", CheckOutcome("failed", why))
        out.setdefault("emulator", CheckOutcome("skipped", why))
        return out
    held = kernel_constants(model, node, constants)
    cases, skipped = draw_cases(body, program, held, seed)
    note = f"; not drawn: {'; '.join(skipped)}" if skipped else ""
    if "lifting" not in out:
        if cases:
            res = compare_with_reference(program, names, cases)
            res.detail += note if res.status == "ok" else ""
            out["lifting"] = res
        else:
            out["lifting"] = CheckOutcome("skipped", "; ".join(skipped))
    if "emulator" not in out:
        out["emulator"] = emulator_check(gp, program, cases, body)
        if out["emulator"].status == "ok":
            out["emulator"].detail += note
    return out


# ---- the host emulator -------------------------------------------------------------------------


def emulated_threads(plan: dict[str, Any]) -> int:
    """CUDA threads summed over the plan's launches (grid times block; a library GEMM, run on
    the emulator's host thread, counts none)."""
    return sum(
        math.prod(int(v) for v in launch["grid"]) * math.prod(int(v) for v in launch["block"])
        for launch in plan.get("launches", [])
        if launch.get("kind") != "gemm"
    )


def _own_errors(body: onnx.ModelProto, case: Case) -> list[float] | None:
    """The original nodes' own error in ONNX Runtime (CPU, their own dtypes) at the case's
    inputs, per output; None when ONNX Runtime cannot run them."""
    try:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        sess = ort.InferenceSession(
            body.SerializeToString(), opts, providers=["CPUExecutionProvider"]
        )
        got = sess.run(None, case.feeds)
    except Exception:  # e.g. bfloat16 ops the CPU EP lacks: the dtype's limit alone then
        return None
    return [relative_error(np.asarray(g, np.float64), r) for g, r in zip(got, case.reference)]


def _as_codegen(program: KernelGraph, inputs: Sequence[np.ndarray]) -> list[np.ndarray] | None:
    """The μGraph in the interpreter's float32 mode ("as code generation computes"), or None
    where that mode cannot run it (its own rewrite fails on some block graphs): the allowance
    then rests on the original nodes' error alone, which is stricter."""
    from mlso_cli.verify import interpreter

    try:
        with np.errstate(all="ignore"):
            return interpreter.run(program, inputs, "float32")
    except Exception:
        return None


def emulator_check(
    gp: Any,
    program: KernelGraph,
    cases: Sequence[Case],
    body: onnx.ModelProto,
    timeout: float = 120.0,
) -> CheckOutcome:
    """Run the generated program `gp` on the host emulator with each case's inputs and compare
    with its fp64 reference: an output passes within its dtype's limit (floatcheck.LIMITS) or
    OWN_ERROR_FACTOR times the fp32 error the region has anyway at those inputs (see there)."""
    from mlso_cli.codegen import hostemu
    from mlso_cli.errors import EnvironmentProblem, first_line

    threads = emulated_threads(gp.plan)
    if threads > EMULATOR_THREADS:
        return CheckOutcome(
            "skipped", f"{threads} CUDA threads to emulate (limit {EMULATOR_THREADS})"
        )
    if not cases:
        return CheckOutcome("skipped", "no input set was drawn")
    try:
        hostemu.build(gp)  # once here, so a build failure is told apart from a failed run
    except EnvironmentProblem as exc:
        return CheckOutcome("skipped", exc.what)
    except (RuntimeError, OSError, ValueError) as exc:
        return CheckOutcome(
            "skipped", f"the emulator cannot build its source: {first_line(exc, 200)}"
        )
    names = [o.name for o in body.graph.output]
    worst, notes = 0.0, []
    for case in cases:
        try:
            got = hostemu.run(gp, case.inputs, timeout)
        except Exception as exc:  # a crash of the emulated source (or a timeout)
            return CheckOutcome(
                "failed",
                f"the emulated run at {case.label} inputs failed: {first_line(exc, 200)}",
            )
        own = _own_errors(body, case)
        as_codegen = _as_codegen(program, case.inputs)
        for i, (name, g, r, node) in enumerate(zip(names, got, case.reference, program.outputs)):
            limit = LIMITS.get(node.dtype, LIMITS[DType.BF16])
            own_orig = own[i] if own is not None else 0.0
            own_ug = (
                relative_error(np.asarray(as_codegen[i], np.float64), r)
                if as_codegen is not None
                else float("nan")  # not run: widens nothing, and says so below
            )
            # an own error that is not finite widens nothing: the reference is finite here, so a
            # result that is not is wrong whatever else overflows
            own_err = max((e for e in (own_orig, own_ug) if math.isfinite(e)), default=0.0)
            err = relative_error(np.asarray(g, np.float64), r)
            if not err <= max(limit, OWN_ERROR_FACTOR * own_err):
                what = (
                    f"has error {err:.3g} against"
                    if math.isfinite(err)
                    else "is not finite (inf or NaN) where it is finite in"
                )
                return CheckOutcome(
                    "failed",
                    f"output '{name}' at {case.label} inputs {what} the "
                    f"fp64 reference (limit {limit:g}, or {OWN_ERROR_FACTOR:g} times the fp32 "
                    f"error the region has anyway: its original nodes in ONNX Runtime "
                    f"{own_orig:.3g}, its μGraph as code generation computes it "
                    f"{'(not run)' if math.isnan(own_ug) else f'{own_ug:.3g}'})",
                    err,
                    name,
                )
            if err > limit:
                notes.append(
                    f"'{name}' at {case.label}: {err:.3g}, above the {limit:g} limit but within "
                    f"{OWN_ERROR_FACTOR:g}x the fp32 error the region has anyway ({own_err:.3g})"
                )
            worst = max(worst, err)
    ran = ", ".join(c.label for c in cases)
    note = f"; {'; '.join(notes)}" if notes else ""
    return CheckOutcome("ok", f"{worst:.3g} at {ran} ({threads} threads){note}", worst)
