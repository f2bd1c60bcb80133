"""Algebraic A-vs-B: each graph output of B against the same output of A, in the finite field,
with every weight an exact constant.

Why: verify's other checks compare each MlsoKernel's μGraph with its *own* fallback body (the
field check, the lifting check) and then A with B numerically (ONNX Runtime). A B whose kernels
are self-consistent but compute something only numerically close to A passes all of them: a
softmax that divides by (sum + 1e-9), a GELU replaced by its tanh approximation, a weight rounded
to fp16, a layer norm without its mean subtraction on data whose mean is about 0. Over the
rationals these are different functions of the inputs, so the field tells them apart at random
inputs, however small the numeric difference.

What is evaluated. Both models are folded as optimize folds them and cut into units that the
field can evaluate, in dependency order, passing field values between them by tensor name:
  - the regions that `frontend/analyse.py` lifts (the regions optimize itself lifts);
  - each MlsoKernel node of B: its embedded μGraph, on the values of the node's inputs;
  - any other node, lifted alone, or else a layout op evaluated on the residues directly
    (Slice, Concat, Split, Gather, Reshape, Squeeze, Unsqueeze, Flatten, Transpose, Expand,
    Identity, a float-to-float Cast): index operations are exact in the field.
A node none of these cover (an unknown op, an If, a mask computed at run time) means the model
does not *lift*, and the check is skipped with the node and the reason. So a whole model is
never composed into one graph: the field's semantics are compositional (a value carries its
residues, whether its q-residue is known, and a max its leaves, across units), so evaluating
unit by unit is evaluating the composition.

Values. Graph inputs are uniform random field elements (integer inputs, which only layout ops
may read, are drawn over their valid index range and kept as integers). Initializers and
Constant nodes that a unit reads as a float tensor are their exact rational values: a float is
m * 2^e with an integer m (frexp), so its residue is (m mod r) * (2^e mod r), computed for a
whole tensor at once. Each model's constants are its own: a weight of B that differs from A's
by one ulp is a different constant. Scalar constants are lifted as CONST nodes, exactly, as in
every field check. The masks lifting derives from a Where are 0/1 constants.

Trials and what a verdict means. Each of `TRIALS` trials draws fresh primes, oracle salt and
inputs (verify's --seed). An output that differs in any trial is a *witness*: A and B are not
the same function of the inputs over the rationals (given the field's canonical forms,
docs/verification.md), whatever the numeric error. Agreement in every trial is evidence, not a
stated bound: the Schwartz-Zippel part is about deg/q per trial (q >= 2^23), but the bound
machinery of `equivalence.py` does not cover whole models with fixed weights (the weights'
products are coefficients whose prime factors it does not count), so none is claimed; the
kernels' own bounds are the field check's.

Size. Weights are converted per trial and held as residue pairs (16 bytes an element, plus
float64 temporaries), and every unit runs at full size, as the field check runs each kernel.
Models whose float constants and graph inputs exceed `MAX_ELEMENTS` elements (A and B
together) are skipped with the count.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx

from mlso_cli.frontend.load import LoadedModel
from mlso_cli.ir import KernelGraph
from mlso_cli.verify.field import BadPrime, Field, FieldArray, ZeroDenominator

TRIALS = 2
"""Trials per verify run. One differing trial is a witness; two make an accidental agreement
(about deg/q, q >= 2^23, per trial) negligible at a cost of two evaluations of each model."""

MAX_ELEMENTS = 1 << 26
"""Largest number of float-constant and graph-input elements (A and B together) the check
converts to field values. Measured on a loaded 2-core machine: converting takes about 0.2 s per
million elements per trial; the full-size fp16 benchmark models against their hand-written
fixtures check in 0.01 s (ntrans) to 5.1 s (gated_mlp bs1: 33.6M elements, 1.1 GB peak with
the models), so the limit is about 10 s and 2.5 GB."""

BYTES_PER_ELEMENT = 64
"""Peak memory per converted element: float64 value, frexp parts and two int64 residues while
converting, the residue pair kept (an upper estimate: 34 bytes an element measured at 33.6M,
the models included); the check is skipped where half the available memory is less."""

MAX_RESAMPLES = 16
"""Input draws per trial after zero denominators (as in equivalence.py), then new primes."""

MAX_REDRAWS = 8
"""Prime draws (after zero denominators at every input draw, or a bad prime) before giving up."""

LAYOUT_OPS = frozenset(
    {
        "Slice",
        "Concat",
        "Split",
        "Gather",
        "Reshape",
        "Squeeze",
        "Unsqueeze",
        "Flatten",
        "Transpose",
        "Expand",
        "Identity",
        "Cast",
    }
)
"""ONNX ops evaluated on field values directly when they are not inside a lifted region."""


class NotLifted(Exception):
    """The model has a node the field cannot evaluate; the message says which and why."""


@dataclass
class OutputVerdict:
    """One graph output: "equal" (every trial agreed), "differs" (a witness), or "skipped"."""

    output: str
    status: str
    detail: str


@dataclass
class AlgebraicResult:
    """The check's outcome: status "ok" (every output equal), "differs", or "skipped"."""

    status: str
    detail: str
    outputs: list[OutputVerdict] = field(default_factory=list)
    trials: int = 0
    seconds: float = 0.0

    @property
    def differing(self) -> list[OutputVerdict]:
        return [o for o in self.outputs if o.status == "differs"]


# ---- exact constants ---------------------------------------------------------------------------


def exact_residues(values: np.ndarray, r: int) -> np.ndarray:
    """The residues mod r of a float array's exact values (each m * 2^e, m an integer).

    Why frexp: float16/float32/float64 values are dyadic rationals; their residues are exact
    without Fractions (which would cost a Python object per element). Non-finite values have
    no residue: the caller refuses them."""
    x = np.asarray(values, dtype=np.float64)
    mant, exp = np.frexp(x)
    m = (mant * float(1 << 53)).astype(np.int64)  # exact: a double has 53 significant bits
    k = exp.astype(np.int64)
    lo = int(k.min()) if k.size else 0
    hi = int(k.max()) if k.size else 0
    # 2^(e - 53) mod r for every exponent in range (at most ~2100 for doubles; a negative
    # power is an inverse); a table lookup, not a sort of the exponents
    pow2 = np.array([pow(2, e - 53, r) for e in range(lo, hi + 1)], dtype=np.int64)
    out = np.remainder(m, r)
    out *= pow2[k - lo]
    out %= r
    return out


def exact_constant(fld: Field, values: np.ndarray, name: str) -> FieldArray:
    """A float tensor as a field constant: its exact rational value in both residues."""
    arr = np.asarray(values)
    if arr.dtype.kind != "f" and arr.dtype.name != "bfloat16":
        raise NotLifted(f"constant '{name}' ({arr.dtype}) is read as a float tensor")
    arr = arr.astype(np.float64)
    if not np.all(np.isfinite(arr)):
        raise NotLifted(f"constant '{name}' holds inf or NaN, which has no field value")
    return FieldArray(exact_residues(arr, fld.p), exact_residues(arr, fld.q))


# ---- a model as units the field evaluates ------------------------------------------------------


@dataclass
class _Unit:
    """A kernel graph run on the field values of `inputs`, giving `outputs`; or one layout
    node (`node` set, `graph` None)."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    graph: KernelGraph | None = None
    node: onnx.NodeProto | None = None
    label: str = ""


class FieldModel:
    """One model (A or B), cut into units the field evaluates; `run` evaluates its outputs.

    Raises NotLifted at construction when a node is not covered (module docstring)."""

    def __init__(self, loaded: LoadedModel, which: str) -> None:
        from mlso_cli.frontend.analyse import analyse
        from mlso_cli.frontend.lift import LiftError, lift_region
        from mlso_cli.frontend.partition import Region, constant_values
        from mlso_cli.ir import loads
        from mlso_cli.runtime.check import is_mlso_node
        from mlso_cli.verify.liftcheck import Constants

        self.which = which
        self.loaded = loaded
        g = loaded.graph
        self.constants = Constants(g)
        inits = {t.name for t in g.initializer}
        self.input_names = [i.name for i in g.input if i.name not in inits]
        self.output_names = [o.name for o in g.output]
        self.extra: dict[str, np.ndarray] = {}
        # Sibling projections stay separate matmuls here (frontend/siblings.py): A is then
        # evaluated as its own nodes compute, and B's kernels with their concatenated weights,
        # so the field checks that merge on both models' exact weights.
        analysis = analyse(loaded, merge=False)
        units: list[_Unit] = []
        for lr in analysis.lifted:
            self.extra.update(lr.extra_inputs)
            units.append(
                _Unit(
                    tuple(lr.graph.input_names),
                    tuple(lr.graph.output_names),
                    lr.graph,
                    label=f"region of {len(lr.region.nodes)} node(s)",
                )
            )
        consts = None
        read = {x for n in g.node for x in n.input} | set(self.output_names)
        reasons = {ex.index: ex.reason for ex in analysis.partition.excluded}
        in_regions = {i for lr in analysis.lifted for i in lr.region.nodes}
        # every node outside the lifted regions, not only those the partition lists as excluded
        for index in (i for i in range(len(g.node)) if i not in in_regions):
            node = g.node[index]
            label = f"{node.op_type} node '{node.name or f'#{index}'}'"
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
                continue
            if is_mlso_node(node):
                program = loads(next(a.s for a in node.attribute if a.name == "ugraph").decode())
                if len(program.inputs) != len(node.input) - 1 or len(program.outputs) != len(
                    node.output
                ):
                    raise NotLifted(f"{which}: {label}: its μGraph's signature is not the node's")
                units.append(_Unit(tuple(node.input[1:]), tuple(node.output), program, label=label))
                continue
            if consts is None:
                consts = constant_values(loaded.model)
            produced = tuple(o for o in node.output if o and o in read)
            region = Region(
                0, (index,), tuple(x for x in node.input if x), produced, "one", (node.op_type,)
            )
            try:
                lr = lift_region(loaded, region, consts, merge=False)
            # LiftError, or a rule tripping on a node it was not written for (a KeyError on an
            # unknown shape): either way this node has no lifted form
            except (LiftError, KeyError, ValueError, IndexError, TypeError) as exc:
                if node.op_type in LAYOUT_OPS and node.domain in ("", "ai.onnx"):
                    units.append(_Unit(tuple(x for x in node.input if x), produced, node=node))
                    continue
                why = (str(exc) if isinstance(exc, LiftError) else "") or reasons.get(index)
                why = why or f"{type(exc).__name__}: {exc}"
                raise NotLifted(f"{which}: {label}: {why[:200]}") from None
            self.extra.update(lr.extra_inputs)
            units.append(
                _Unit(
                    tuple(lr.graph.input_names), tuple(lr.graph.output_names), lr.graph, label=label
                )
            )
        self.units = self._order(units)

    def _known(self, name: str) -> bool:
        return name in self.input_names or name in self.constants or name in self.extra

    def _order(self, units: list[_Unit]) -> list[_Unit]:
        """The units in dependency order (tensor names produced before they are read)."""
        ready = {n for u in units for n in u.inputs if self._known(n)}
        order: list[_Unit] = []
        pending = list(units)
        while pending:
            rest = [u for u in pending if not all(x in ready for x in u.inputs)]
            done = [u for u in pending if all(x in ready for x in u.inputs)]
            if not done:
                u = rest[0]
                missing = next(x for x in u.inputs if x not in ready)
                raise NotLifted(
                    f"{self.which}: {u.label or 'a unit'} reads '{missing}', which no node "
                    "produces and which is neither a graph input nor a constant"
                )
            for u in done:
                order.append(u)
                ready.update(u.outputs)
            pending = rest
        for o in self.output_names:
            if o not in ready and not self._known(o):
                raise NotLifted(f"{self.which}: graph output '{o}' is not produced")
        return order

    def run(self, fld: Field, feeds: dict[str, Any]) -> dict[str, Any]:
        """Every graph output's field value at `feeds` (graph inputs by name)."""
        from mlso_cli.verify.fieldrun import run_field

        env: dict[str, Any] = dict(feeds)
        cache: dict[str, FieldArray] = {}

        def value(name: str) -> Any:
            if name in env:
                return env[name]
            if name not in cache:
                arr = self.extra.get(name)
                if arr is None:
                    arr = self.constants.get(name)
                if arr is None:
                    raise NotLifted(f"{self.which}: tensor '{name}' has no value")
                cache[name] = exact_constant(fld, arr, name)
            return cache[name]

        for u in self.units:
            if u.graph is not None:
                args = [value(x) for x in u.inputs]
                for x, node, arg in zip(u.inputs, u.graph.inputs, args):
                    if not isinstance(arg, FieldArray) or tuple(arg.shape) != node.shape:
                        raise NotLifted(
                            f"{self.which}: {u.label or 'a unit'}: input '{x}' is "
                            f"{getattr(arg, 'shape', '?')}, its graph reads {node.shape}"
                        )
                outs = run_field(u.graph, args, fld)
                env.update(zip(u.outputs, outs))
            else:
                env.update(zip(u.outputs, self._layout(u.node, fld, value)))
        return {o: value(o) for o in self.output_names}

    # ---- layout ops on field values ----

    def _ints(self, name: str) -> list[int]:
        v = self.constants.get(name) if name else None
        if v is None:
            raise NotLifted(f"{self.which}: '{name}' must be a constant")
        return [int(x) for x in np.asarray(v).reshape(-1)]

    def _layout(self, node: onnx.NodeProto, fld: Field, value) -> list[Any]:
        """One layout node on field values (FieldArray) or exact integers (numpy)."""
        op = node.op_type
        shapes = self.loaded.shapes
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        x = value(node.input[0])
        out0 = shapes.get(node.output[0])
        if op == "Cast":
            to = attrs.get("to")
            floats = (
                onnx.TensorProto.FLOAT,
                onnx.TensorProto.FLOAT16,
                onnx.TensorProto.BFLOAT16,
                onnx.TensorProto.DOUBLE,
            )
            if isinstance(x, FieldArray) and to in floats:
                return [x]  # the field's CAST is the identity
            if not isinstance(x, FieldArray) and to not in floats:
                return [np.asarray(x).astype(onnx.helper.tensor_dtype_to_np_dtype(to))]
            raise NotLifted(f"{self.which}: Cast '{node.name}' between float and integer")
        if op in ("Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"):
            if out0 is None:
                raise NotLifted(f"{self.which}: shape of '{node.output[0]}' is unknown")
            return [_reshape(fld, x, out0)]
        if op == "Transpose":
            perm = tuple(attrs.get("perm") or reversed(range(len(x.shape))))
            return [fld.transpose(x, perm) if isinstance(x, FieldArray) else x.transpose(perm)]
        if op == "Expand":
            if out0 is None:
                raise NotLifted(f"{self.which}: shape of '{node.output[0]}' is unknown")
            lead = (1,) * (len(out0) - len(x.shape)) + tuple(x.shape)
            x = _reshape(fld, x, lead)
            if isinstance(x, FieldArray):
                return [fld.broadcast(x, out0)]
            return [np.broadcast_to(x, out0)]
        if op == "Slice":
            starts, ends = self._ints(node.input[1]), self._ints(node.input[2])
            rank = len(x.shape)
            axes = self._ints(node.input[3]) if len(node.input) > 3 and node.input[3] else None
            steps = self._ints(node.input[4]) if len(node.input) > 4 and node.input[4] else None
            axes = axes if axes is not None else list(range(len(starts)))
            steps = steps if steps is not None else [1] * len(starts)
            idx: list[slice] = [slice(None)] * rank
            for a, s, e, st in zip(axes, starts, ends, steps):
                if st == 0:
                    raise NotLifted(f"{self.which}: Slice '{node.name}' with step 0")
                idx[a % rank] = slice(s, e, st)
            return [_index(x, tuple(idx))]
        if op == "Concat":
            parts = [value(n) for n in node.input if n]
            return [_concat(parts, attrs.get("axis", 0))]
        if op == "Split":
            axis = attrs.get("axis", 0) % len(x.shape)
            sizes = [shapes[o][axis] for o in node.output if o in shapes]
            if len(sizes) != len(node.output):
                raise NotLifted(f"{self.which}: Split '{node.name}': output shapes unknown")
            outs, start = [], 0
            for n in sizes:
                idx = [slice(None)] * len(x.shape)
                idx[axis] = slice(start, start + n)
                outs.append(_index(x, tuple(idx)))
                start += n
            return outs
        if op == "Gather":
            name = node.input[1]
            ind = self.constants.get(name) if name in self.constants else value(name)
            if isinstance(ind, FieldArray) or np.asarray(ind).dtype.kind not in "iu":
                raise NotLifted(f"{self.which}: Gather '{node.name}' with non-integer indices")
            axis = attrs.get("axis", 0) % len(x.shape)
            ind = np.asarray(ind)
            if isinstance(x, FieldArray):
                return [_take(x, ind, axis)]
            return [np.take(x, ind, axis=axis)]
        raise NotLifted(f"{self.which}: {op} '{node.name}' has no field evaluation")


def _reshape(fld: Field, x: Any, shape: tuple[int, ...]) -> Any:
    return fld.reshape(x, tuple(shape)) if isinstance(x, FieldArray) else np.reshape(x, shape)


def _index(x: Any, idx: tuple[slice, ...]) -> Any:
    if isinstance(x, FieldArray):
        p = x.p[idx]
        return FieldArray(p, None if not x.q_known() else x.q[idx])
    return np.asarray(x)[idx]


def _concat(parts: list[Any], axis: int) -> Any:
    if all(isinstance(p, FieldArray) for p in parts):
        ax = axis % len(parts[0].shape)
        p = np.concatenate([x.p for x in parts], axis=ax)
        q = None
        if all(x.q_known() for x in parts):
            q = np.concatenate([x.q for x in parts], axis=ax)
        return FieldArray(p, q)
    if any(isinstance(p, FieldArray) for p in parts):
        raise NotLifted("Concat of field values and integers")
    return np.concatenate([np.asarray(x) for x in parts], axis=axis)


def _take(x: FieldArray, ind: np.ndarray, axis: int) -> FieldArray:
    p = np.take(x.p, ind, axis=axis)
    return FieldArray(p, np.take(x.q, ind, axis=axis) if x.q_known() else None)


# ---- the check ---------------------------------------------------------------------------------


def folded(model: onnx.ModelProto, source: str) -> LoadedModel:
    """`model` (loaded by verify, shapes fixed, weights in memory) folded as optimize folds it,
    so shape arithmetic on constants is constant for the lifting rules."""
    from mlso_cli.frontend.fold import fold_constants
    from mlso_cli.frontend.load import loaded_from_proto

    m = onnx.ModelProto()
    m.CopyFrom(model)
    return loaded_from_proto(fold_constants(m), source)


def _draw_feeds(
    fld: Field,
    specs: list[tuple[str, tuple[int, ...], np.dtype]],
    rng: np.random.Generator,
    bounds: dict[str, int],
) -> dict[str, Any]:
    feeds: dict[str, Any] = {}
    for name, shape, dt in specs:
        kind = np.dtype(dt).kind
        if kind == "f" or np.dtype(dt).name == "bfloat16":
            feeds[name] = fld.random(tuple(shape), rng)
        elif kind == "b":
            feeds[name] = rng.integers(0, 2, shape).astype(dt)
        else:
            feeds[name] = rng.integers(0, bounds.get(name, 2), shape).astype(dt)
    return feeds


def _difference(a: FieldArray, b: FieldArray) -> str | None:
    if tuple(a.shape) != tuple(b.shape):
        return f"its shape is {list(b.shape)}, A's is {list(a.shape)}"
    if a.equal(b):
        return None
    bad = a.p != b.p
    if a.q_known() and b.q_known():
        bad = bad | (a.q != b.q)
    first = tuple(int(j) for j in np.argwhere(bad)[0]) if bad.ndim else ()
    return f"{int(bad.sum())} of {bad.size} entries differ, first at {first}"


def check_algebraic(
    a: onnx.ModelProto,
    b: onnx.ModelProto,
    seed: int,
    *,
    trials: int = TRIALS,
    source_a: str = "A",
    source_b: str = "B",
) -> AlgebraicResult:
    """Compare every graph output of B with A's in the field (module docstring). A and B are
    the models verify loaded (shapes fixed, weights in memory). Never raises for a model it
    cannot evaluate: the result is then "skipped" with the reason."""
    from mlso_cli.frontend.load import available_memory
    from mlso_cli.verify.liftcheck import index_bounds
    from mlso_cli.verify.reference64 import input_specs

    start = time.perf_counter()

    def skipped(why: str) -> AlgebraicResult:
        outs = [OutputVerdict(o.name, "skipped", why) for o in a.graph.output]
        return AlgebraicResult("skipped", why, outs, 0, time.perf_counter() - start)

    specs = input_specs(a)
    elements = sum(int(np.prod(s, dtype=np.int64)) for _, s, _ in specs)
    for m in (a, b):
        for t in m.graph.initializer:
            if t.data_type in (
                onnx.TensorProto.FLOAT,
                onnx.TensorProto.FLOAT16,
                onnx.TensorProto.BFLOAT16,
                onnx.TensorProto.DOUBLE,
            ):
                elements += int(np.prod(t.dims, dtype=np.int64))
    if elements > MAX_ELEMENTS:
        return skipped(
            f"{elements} float-constant and input elements in A and B (limit {MAX_ELEMENTS})"
        )
    free = available_memory()
    if free is not None and BYTES_PER_ELEMENT * elements > free // 2:
        return skipped(
            f"{elements} float-constant and input elements need about "
            f"{BYTES_PER_ELEMENT * elements / 2**30:.1f} GiB; {free / 2**30:.1f} GiB is available"
        )
    try:
        fa = FieldModel(folded(a, source_a), "A")
        fb = FieldModel(folded(b, source_b), "B")
    except NotLifted as exc:
        return skipped(f"{exc} (the check needs both models to lift)")
    except Exception as exc:  # a model the frontend cannot take apart: say so, skip the check
        return skipped(f"the models cannot be taken apart: {type(exc).__name__}: {str(exc)[:200]}")
    missing = [o for o in fa.output_names if o not in fb.output_names]
    if missing:
        return skipped(f"B has no output '{missing[0]}'")
    bounds = index_bounds(a)
    rng = np.random.default_rng([seed, 0xA16E])
    results: dict[str, OutputVerdict] = {}
    done = redraws = 0
    while done < trials:
        if redraws > MAX_REDRAWS:
            return skipped(
                f"a denominator was zero at every sample in {redraws} fields (a weight that "
                "makes a denominator vanish identically?)"
            )
        fld = Field.draw(rng)
        outs = None
        try:
            for _ in range(MAX_RESAMPLES):
                feeds = _draw_feeds(fld, specs, rng, bounds)
                try:
                    outs = fa.run(fld, feeds), fb.run(fld, feeds)
                    break
                except ZeroDenominator:
                    continue
        except BadPrime:
            outs = None
        except NotLifted as exc:
            return skipped(f"{exc} (the check needs both models to lift)")
        except Exception as exc:  # a μGraph the field cannot run; its kernel's own checks say why
            return skipped(
                f"the field cannot evaluate the models: {type(exc).__name__}: {str(exc)[:200]}"
            )
        if outs is None:
            redraws += 1
            continue
        done += 1
        oa, ob = outs
        for name in fa.output_names:
            if name in results and results[name].status == "differs":
                continue
            diff = _difference(oa[name], ob[name])
            if diff is not None:
                results[name] = OutputVerdict(
                    name,
                    "differs",
                    f"in the finite field (weights exact; p={fld.p}, q={fld.q}) {diff}",
                )
            else:
                results[name] = OutputVerdict(name, "equal", f"equal in {done} field trial(s)")
    outputs = [results[n] for n in fa.output_names]
    status = "differs" if any(o.status == "differs" for o in outputs) else "ok"
    differ = [o.output for o in outputs if o.status == "differs"]
    if differ:
        names = ", ".join(f"'{n}'" for n in differ)
        detail = f"{len(differ)} of {len(outputs)} output(s) differ from A's in the field: {names}"
    else:
        detail = f"{len(outputs)} of {len(outputs)} output(s) equal in the field in {done} trial(s)"
    return AlgebraicResult(status, detail, outputs, done, time.perf_counter() - start)
