"""The whole verification chain on a packaged model, as a library returning plain data.

    verify_models(a, b, VerifyOptions(seed=...), source_a=, source_b=) -> VerifyReport
    check_kernels(a, b, seed=..., ...)                                 -> [KernelVerdict]

Why a library: `mlso verify` (commands/verify.py) is flags and reporting over `verify_models`,
and `mlso optimize` runs the same function on the model it is about to write (pipeline/run.py),
so optimize never writes what verify refuses. Nothing here prints or raises for a failed check:
every check's outcome is data (rows, per-kernel verdicts, the first failure with its fix); a
missing tool (nvcc for the binary check) or an unloadable model is still an exception.

The chain, per MlsoKernel node of B, in this order:
  chain     its source, plan and binary are what its μGraph compiles to
  field     its μGraph equals its lifted fallback body in the finite field, with a bound
  float     its μGraph as code generation computes it (fp32) against fp64
  lifting   its μGraph (fp64) against onnx's reference evaluator on its original nodes,
            and its constants against A's values (verify/liftcheck.py)
  emulator  its generated source on the host emulator at unit and adversarial inputs
Then A and B in ONNX Runtime against an fp64 evaluation of A at several scales, and the
algebraic A-vs-B check (verify/algebraic.py), each output of B against A's in the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx

from mlso_cli.errors import EnvironmentProblem, InputError, MlsoError, first_line
from mlso_cli.frontend.load import require_memory
from mlso_cli.ir import DType
from mlso_cli.verify.floatcheck import LIMITS
from mlso_cli.verify.liftcheck import CheckOutcome, index_bounds
from mlso_cli.verify.reference64 import Reference, input_specs

SMALLEST_AUTO_SCALE = 2.0**-12
"""How far verify shrinks the inputs below the smallest --scales when no output was comparable."""

_DTYPE_OF = {np.dtype(np.float32): DType.F32, np.dtype(np.float16): DType.F16}
"""numpy dtypes ONNX Runtime returns; anything else here is bfloat16."""


def _session(model: onnx.ModelProto, gpu: int | None, which: str):
    """An ORT session for model `which` (A or B). A load failure is the model's problem (exit 1,
    see the module docstring); a CUDA EP that ORT silently dropped is the machine's (exit 4)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    data = model.SerializeToString()
    try:
        if gpu is None:
            return ort.InferenceSession(data, opts, providers=["CPUExecutionProvider"])
        from mlso_cli import runtime

        sess = runtime.session(data, providers=[("CUDAExecutionProvider", {"device_id": gpu})])
    except MlsoError:
        raise
    except Exception as exc:  # ORT's own load errors: report them in one line
        raise InputError(
            f"ONNX Runtime cannot load model {which} ({model.graph.name or 'unnamed'}), so verify "
            f"cannot compare it: {first_line(exc)}",
            "verify runs both models in ONNX Runtime; ops of other domains need their library "
            "registered in ORT",
        ) from None
    if "CUDAExecutionProvider" not in sess.get_providers():
        raise EnvironmentProblem(
            f"ONNX Runtime could not use the CUDA EP on GPU {gpu}",
            "Install the CUDA and cuDNN libraries onnxruntime-gpu needs, or run verify without --gpu",
        )
    return sess


def _require_input_memory(specs: list, source: str, draws: int = 1) -> None:
    """Random inputs, ORT's outputs and the fp64 reference for huge --input-shape values could
    exhaust memory half-way (a MemoryError traceback, or the OOM killer); fail first instead.
    `draws`: the output check holds every draw's inputs and outputs at once (each evaluator
    runs them all before the next is built: `_evaluate_apart`)."""
    nbytes = sum(int(np.prod(s, dtype=np.float64)) * np.dtype(dt).itemsize for _, s, dt in specs)
    require_memory(8 * nbytes * max(1, draws), f"verifying {source} at these input shapes")


def _feeds(
    specs: list, rng: np.random.Generator, scale: float, bounds: dict[str, int]
) -> dict[str, np.ndarray]:
    """Random inputs: floats normal at `scale`; integer indices over their whole valid range;
    other integers from {0, 1} (shapes and flags cannot take arbitrary values)."""
    feeds = {}
    for n, shape, dt in specs:
        if np.dtype(dt).kind == "f":
            feeds[n] = (rng.standard_normal(shape) * scale).astype(dt)
        elif np.dtype(dt).kind == "b":
            feeds[n] = rng.integers(0, 2, shape).astype(dt)
        else:
            feeds[n] = rng.integers(0, bounds.get(n, 2), shape).astype(dt)
    return feeds


def representable(ref: np.ndarray, dtype: np.dtype) -> bool:
    """Is the float64 reference finite once stored in the output's dtype? At an adversarial
    scale a float16 output can exceed 65504 (rmsnorm_linear with every input x1000: about 6e7).
    The right answer is then inf, the original model's answer is whatever its overflow gives,
    and comparing either with the float64 value says nothing about the rewrite."""
    if np.dtype(dtype).kind != "f":
        return True
    with np.errstate(over="ignore"):
        return bool(np.all(np.isfinite(np.asarray(ref).astype(dtype))))


def _rel(out: np.ndarray, ref: np.ndarray) -> float:
    out = out.astype(np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    denom = float(np.linalg.norm(ref))
    return float(np.linalg.norm(out - ref)) / (denom if denom else 1.0)


def _closeness(row: dict) -> str:
    err = row.get("rel_err_b")
    if err is None:
        return "not compared numerically"
    return f"numerically close: rel err {err:.2g}"


def _algebraic(
    a: onnx.ModelProto,
    b: onnx.ModelProto,
    seed: int,
    rows: list[dict],
    enabled: bool,
    numeric: bool,
    source_a: str,
    source_b: str,
) -> tuple[list[dict], dict]:
    """The algebraic A-vs-B check (verify/algebraic.py) as JSON rows, one per graph output, and
    the summary's keys. Each row carries B's worst numeric error for the output (the ONNX
    Runtime rows), so a difference is reported next to how close B looked numerically.
    `numeric`: a difference is reported but accepted (--numeric; whatever B holds otherwise, a
    different function fails). `algebraic_ok` (dropped from the printed summary) is
    False when an output differs and it is not accepted."""
    worst: dict[str, float] = {}
    for r in rows:
        worst[r["output"]] = max(worst.get(r["output"], 0.0), r["rel_err_b"])
    if not enabled:
        return [], {
            "algebraic": "skipped",
            "algebraic_detail": "--no-algebraic",
            "algebraic_trials": 0,
            "algebraic_seconds": 0.0,
            "algebraic_enforced": False,
            "algebraic_ok": True,
        }
    from mlso_cli.verify.algebraic import check_algebraic

    res = check_algebraic(a, b, seed, source_a=source_a, source_b=source_b)
    alg_rows = [
        {
            "type": "algebraic",
            "output": o.output,
            "status": o.status,
            "detail": o.detail,
            "rel_err_b": worst.get(o.output),
            "accepted": o.status != "differs" or numeric,
        }
        for o in res.outputs
    ]
    detail = res.detail
    if res.status == "differs" and numeric:
        detail += "; accepted: numerical equivalence decides (--numeric)"
    return alg_rows, {
        "algebraic": res.status,
        "algebraic_detail": detail,
        "algebraic_trials": res.trials,
        "algebraic_seconds": round(res.seconds, 3),
        "algebraic_enforced": not numeric,
        "algebraic_ok": res.status != "differs" or numeric,
    }


def packaged_constants(model: onnx.ModelProto):
    """name -> value of `model`'s initializers that no graph input can override (None for any
    other name), converted when asked: the constants the chain check hands code generation,
    as optimize handed it the region's lifted constants (codegen/indexmask.py)."""
    from onnx import numpy_helper

    inputs = {i.name for i in model.graph.input}
    inits = {t.name: t for t in model.graph.initializer if t.name not in inputs}

    def lookup(name: str) -> np.ndarray | None:
        t = inits.get(name)
        return None if t is None else numpy_helper.to_array(t)

    return lookup


def chain_check_kernels(
    kernels: list, trust_binary: bool, generated: dict | None = None, constants=None
) -> list[dict]:
    """Tie each MlsoKernel's binary to its μGraph: regenerate the CUDA source and launch plan from
    the embedded μGraph and compare them with the node's source_sha256 and plan, then recompile
    (nvcc, cached) and compare the fatbin with the node's binary. Why: the field check proves the
    μGraph; without this, a binary, plan or hash spliced in from another model would run
    unchecked. nvcc output is deterministic for one nvcc version (checked across cache folders),
    so a model optimized with another nvcc version fails here: re-run optimize, or pass
    --trust-binary to check only source and plan. `generated`, when given, receives each node's
    regenerated program by node index (the emulator check runs that very source). `constants`
    (packaged_constants): the model's values of the nodes' `mlso_mask_*` inputs, which decide,
    as they did in optimize, whether a mask is computed from indices instead of read."""
    import hashlib

    from mlso_cli.codegen import DEFAULT_TARGETS, generate
    from mlso_cli.codegen.indexmask import mask_constants
    from mlso_cli.codegen.nvcc import compile_generated
    from mlso_cli.ir import loads

    rows = []
    for checked in kernels:
        row = {
            "type": "chain",
            "node": checked.node.name,
            "source": False,
            "plan": False,
            "binary": "not checked" if trust_binary else False,
            "detail": "",
        }
        rows.append(row)
        try:
            program = loads(checked.ugraph_json)
            targets = tuple(checked.plan.get("targets") or DEFAULT_TARGETS)
            # main-graph nodes only: a subgraph's own initializers could shadow the names
            lookup = constants if constants is not None and not checked.graph_path else None
            masks = mask_constants(program.input_names, lookup or (lambda _: None), checked.inputs)
            gp = generate(program, targets, masks)
        except Exception as exc:  # a μGraph codegen refuses cannot have made this binary
            row["detail"] = (
                f"its μGraph does not generate code: {type(exc).__name__}: {str(exc)[:200]}"
            )
            continue
        if generated is not None:
            generated[checked.node_index] = gp
        row["source"] = hashlib.sha256(gp.source.encode()).hexdigest() == checked.source_sha256
        row["plan"] = gp.plan == checked.plan
        if not row["source"]:
            row["detail"] = "source_sha256 is not the hash of the code its μGraph generates"
            continue
        if not row["plan"]:
            row["detail"] = "the launch plan is not the one its μGraph generates"
            continue
        if trust_binary:
            continue
        fatbin = compile_generated(gp, targets).fatbin  # EnvironmentProblem without nvcc
        row["binary"] = hashlib.sha256(fatbin).hexdigest() == checked.binary_sha256
        if not row["binary"]:
            row["detail"] = (
                "the binary is not what nvcc makes of its μGraph's code (another nvcc version? "
                "re-run optimize here, or pass --trust-binary)"
            )
    return rows


def field_check_kernels(
    model: onnx.ModelProto, kernels: list, seed: int, float_headroom: float = 1.0
) -> list[dict]:
    """Check each MlsoKernel's μGraph (`kernels`: runtime.check_model's results for `model`)
    against its lifted fallback body in the finite field (and, where equivalent, its float
    error; `float_headroom`: VerifyOptions')."""
    from mlso_cli.frontend.lift import (
        LiftError,
        lift_whole_graph,
        merged_kernel,
        with_input_order,
    )
    from mlso_cli.frontend.load import loaded_from_proto
    from mlso_cli.ir import loads
    from mlso_cli.package.regionmodel import region_model, value_infos
    from mlso_cli.verify.equivalence import check_equivalent

    rows = []
    infos = value_infos(model) if kernels else {}  # shape inference is per model, not per kernel
    for k, checked in enumerate(kernels, start=1):
        node = checked.node
        row = {
            "type": "kernel",
            "node": node.name,
            "equivalent": False,
            "bound": 1.0,
            "trials": 0,
            "detail": "",
            "status": "unlifted",
        }
        rows.append(row)
        program = loads(checked.ugraph_json)
        body = loaded_from_proto(region_model(model, node, infos), f"body of {node.name}")
        try:
            # in the kernel's form: merged siblings or not, whatever MLSO_MERGE_SIBLINGS says now
            lifted = lift_whole_graph(body, merged=merged_kernel(program.input_names))
        except LiftError as exc:
            row["detail"] = f"its function body cannot be lifted: {exc}"
            continue
        reference = with_input_order(lifted.graph, program.input_names, program)
        verdict = check_equivalent(reference, program, seed=seed, runs_so_far=k)
        row.update(
            equivalent=verdict.equivalent,
            bound=verdict.bound,
            trials=verdict.trials,
            detail=verdict.detail,
            # a witness (bound 0) says the kernel computes something else; agreement that
            # never reached a usable bound says only that it could not be verified
            status="equivalent"
            if verdict.equivalent
            else "differs"
            if verdict.bound == 0.0
            else "unbounded",
        )
        if verdict.heuristic:
            row["assumes"] = verdict.heuristic
        if verdict.equivalent:
            _float_check(row, reference, program, _float_seed(program), float_headroom)
    return rows


FLOAT_CHECK_ELEMENTS = 1 << 22
"""Largest μGraph (input and output elements) whose float check runs in verify: the interpreter
is numpy, and a full-size attention region takes seconds."""


def _float_seed(program) -> int:
    """The float check's inputs come from the kernel's own μGraph hash, not the run's seed. Why:
    its error is a property of the code on typical data, and a kernel's attention error varied
    6x between two draws (gpt2_tiny: 5e-6 under optimize's seed, 2.96e-5 under verify's), so
    optimize's check passed what verify's then refused. The same draw on both sides gives one
    verdict; the field check keeps the run's fresh seed, which is what a tuned μGraph must face."""
    from mlso_cli.ir.hashing import graph_hash

    return int(graph_hash(program)[:15], 16)


def _float_check(row: dict, reference, program, seed: int, headroom: float = 1.0) -> None:
    """The μGraph as code generation computes it (the interpreter's float32 mode: 16-bit staging,
    casts, stabilised exps) against the reference region in float64. Why: the field treats CAST
    as the identity, so a μGraph that rounds softmax row sums to bf16 is equivalent there; here
    it must stay within its dtype's limit or twice the reference's own float32 error (times
    `headroom`: below 1 before optimize writes, VerifyOptions.float_headroom)."""
    from mlso_cli.runtime.launcher import numpy_dtype
    from mlso_cli.verify import interpreter

    size = sum(n.numel for n in list(program.inputs) + list(program.outputs))
    if size > FLOAT_CHECK_ELEMENTS:
        row["float_check"] = f"skipped: {size} elements (limit {FLOAT_CHECK_ELEMENTS})"
        return
    rng = np.random.default_rng(seed)
    ins = [rng.standard_normal(n.shape).astype(numpy_dtype(n.dtype.value)) for n in program.inputs]
    want = interpreter.run(reference, ins, mode="float64")
    try:
        own = interpreter.run(reference, ins, mode="float32")
        got = interpreter.run(program, ins, mode="float32")
    except Exception as exc:  # the float32 mode's own rewrite (codegen/ascomputed.py) refused it
        row["float_check"] = (
            f"skipped: the interpreter's float32 mode cannot run this μGraph "
            f"({type(exc).__name__}: {str(exc)[:120]})"
        )
        return
    worst = 0.0
    for w, o, g, node in zip(want, own, got, program.outputs):
        if not np.all(np.isfinite(w)):
            row["float_check"] = "skipped: the reference is not finite at these inputs"
            return
        e_prog, e_ref = _rel(np.asarray(g), np.asarray(w)), _rel(np.asarray(o), np.asarray(w))
        limit = LIMITS.get(node.dtype, LIMITS[DType.BF16])
        worst = max(worst, e_prog)
        if e_prog > headroom * max(limit, 2 * e_ref):
            margin = "" if headroom == 1.0 else f"; optimize keeps {1 / headroom:g}x headroom"
            why = f"{e_prog:.3g} (limit {limit:g}, the region's own {e_ref:.3g}{margin})"
            row["equivalent"] = False
            row["status"] = "float"
            row["detail"] = (
                f"equivalent in the field, but as code generation computes it the error is {why}"
            )
            row["float_check"] = f"FAILED: {why}"
            return
    row["float_check"] = f"ok: {worst:.3g}"


def independent_check_kernels(
    original: onnx.ModelProto,
    model: onnx.ModelProto,
    kernels: list,
    generated: dict,
    seed: int,
    *,
    lift: bool = True,
    emulate: str | None = None,
) -> dict[int, dict]:
    """The checks of each MlsoKernel that do not go through the lifter (verify/liftcheck.py):
    its μGraph against onnx's reference evaluator on its original nodes, its constants against
    A's values, and its generated source (`generated`, by node index, from the chain check) on
    the host emulator. `emulate`: None to run the emulator, else why not. Returns, by node
    index, {"lifting": CheckOutcome, "emulator": CheckOutcome}."""
    from mlso_cli.ir import loads
    from mlso_cli.package.regionmodel import value_infos
    from mlso_cli.verify.liftcheck import Constants, Originals, check_kernel

    if not kernels:
        return {}
    infos = value_infos(model)
    originals, constants = Originals(original), Constants(model.graph)
    return {
        checked.node_index: check_kernel(
            original,
            model,
            checked.node,
            loads(checked.ugraph_json),
            generated.get(checked.node_index),
            seed,
            lift=None if lift else "--no-lift",
            emulate=emulate,
            infos=infos,
            originals=originals,
            constants=constants,
        )
        for checked in kernels
    }


def _library_reason(gpu: int | None, kernels: list) -> tuple[bool, str]:
    """Whether B's ONNX Runtime session runs the kernels' binaries (the mlso library is
    registered), and why or why not: on the CPU it never does, ORT runs the fallback bodies."""
    if gpu is None:
        return False, "ONNX Runtime on the CPU runs its fallback body, not its binary"
    if not kernels:
        return False, "no kernels"
    try:
        from mlso_cli.runtime.session_helper import library_decision

        decision = library_decision(kernels, [("CUDAExecutionProvider", {"device_id": gpu})])
    except Exception as exc:  # the session itself reports a broken GPU setup, with its exit code
        return False, f"the mlso library's use could not be decided: {type(exc).__name__}"
    if decision.register:
        return True, f"its binary ran on GPU {gpu}"
    return False, f"its fallback body ran ({decision.reason})"


def _emulate_skip(emulate: bool, gpu: int | None, kernels: list) -> str | None:
    """None to run the emulator check, else why it is skipped: --no-emulate, or --gpu where B
    runs the binaries themselves (the emulator stands in for the GPU on the CPU)."""
    if not emulate:
        return "--no-emulate"
    binaries_run, why = _library_reason(gpu, kernels)
    return f"--gpu: {why} instead" if binaries_run else None


def _check_rows(
    kernels: list,
    chain_rows: list[dict],
    kernel_rows: list[dict],
    outcomes: dict[int, dict],
    field: bool,
    trust_binary: bool,
    gpu: int | None,
    outputs_failed: bool,
) -> list[dict]:
    """One row per kernel saying which checks ran, which were skipped and why, and each result
    (JSON type "kernel_checks"; the stderr table shows the same)."""
    _, ort_how = _library_reason(gpu, kernels)
    rows = []
    for i, checked in enumerate(kernels):
        chain = chain_rows[i]
        kr = kernel_rows[i] if field and i < len(kernel_rows) else None
        per = outcomes[checked.node_index]
        if kr is None:
            field_text = "skipped: --no-field"
            float_text = "skipped: --no-field (it runs on what the field check accepts)"
        else:
            float_text = kr.get("float_check", "")
            if kr["equivalent"] or float_text.startswith("FAILED"):
                field_text = f"ok: false-accept bound {kr['bound']:.2e} in {kr['trials']} trials"
                if kr.get("assumes"):
                    field_text += f"; the bound assumes {kr['assumes']}"
            else:
                field_text = f"FAILED: {kr['detail']}"
                float_text = "not run: the field check failed"
        rows.append(
            {
                "type": "kernel_checks",
                "node": checked.name,
                "chain": "ok: source, plan and binary"
                if chain["binary"] is True
                else "ok: source and plan; binary not checked (--trust-binary)"
                if trust_binary
                else "ok: source and plan",
                "field": field_text,
                "float": float_text,
                "lifting": per["lifting"].text(),
                "lifting_error": per["lifting"].worst,
                "emulator": per["emulator"].text(),
                "emulator_error": per["emulator"].worst,
                "ort": f"{'FAILED' if outputs_failed else 'ok'}: whole model; {ort_how}",
            }
        )
    return rows


# ---- the library's entry points ----------------------------------------------------------------

DEFAULT_SCALES: tuple[float, ...] = (1.0, 4.0, 1000.0)


@dataclass(frozen=True)
class VerifyOptions:
    """What `mlso verify`'s flags set (and what optimize passes before it writes)."""

    seed: int
    """Random inputs, primes and salts; optimize draws a fresh one per run."""
    samples: int = 2
    scales: tuple[float, ...] = DEFAULT_SCALES
    rtol: float | None = None
    atol: float | None = None
    rtol_per: Mapping[str, float] = field(default_factory=dict)
    atol_per: Mapping[str, float] = field(default_factory=dict)
    gpu: int | None = None
    field: bool = True
    lift: bool = True
    emulate: bool = True
    trust_binary: bool = False
    algebraic: bool = True
    numeric: bool = False
    """Accept an algebraic difference when B is numerically equivalent (the report says so)."""
    float_headroom: float = 1.0
    """The float check accepts an error up to this fraction of its limit. Why optimize passes 0.5:
    a kernel whose error sits near the limit must not pass optimize and fail `mlso verify`. Both
    now draw the float check's inputs from the kernel's hash (`_float_seed`), so they see the
    same numbers on one machine; the headroom covers another machine's BLAS and rounding (a
    deepseek_v3_tiny attention kernel, when the draw followed the run's seed, passed optimize
    and failed verify at 1 seed in 18: 1.68e-05 against 1e-05)."""
    distinct: bool = False
    """Check each distinct kernel once (optimize before writing): kernels with the same μGraph
    and the same fallback body (a transformer's repeated layers) share the first one's field,
    float, lifting and emulator results, and only their constants are compared with A's each.
    `mlso verify` checks every kernel (False), each with its own share of the run's bound."""


@dataclass(frozen=True)
class Failure:
    """The first check that refuses B: one line saying what failed and why, and the fix."""

    what: str
    fix: str | None = None
    node: str | None = None
    """The MlsoKernel node it is about, when it is about one."""


@dataclass(frozen=True)
class KernelVerdict:
    """Every check of one MlsoKernel node. `failure` is None when none refused it."""

    node: str
    node_index: int
    outputs: tuple[str, ...]
    """The tensors the node produces (how optimize matches a kernel to its region)."""
    chain: dict
    field: dict | None
    """The field (and float) check's row; None when --no-field."""
    lifting: CheckOutcome
    emulator: CheckOutcome

    @property
    def bound(self) -> float | None:
        """The false-accept bound the field check obtained (None: no usable one)."""
        if self.field is None or not self.field["equivalent"]:
            return None
        return float(self.field["bound"])

    @property
    def failure(self) -> str | None:
        """Why this kernel is refused, in one line, or None."""
        if self.chain.get("detail"):
            return f"not what its μGraph compiles to: {self.chain['detail']}"
        if self.field is not None and not self.field["equivalent"]:
            return field_failure(self.field)
        if self.lifting.status == "failed":
            return f"fails the lifting check: {self.lifting.detail}"
        if self.emulator.status == "failed":
            return (
                "its generated source, run on the host emulator, does not compute its original "
                f"nodes: {self.emulator.detail}"
            )
        return None


def field_failure(row: dict) -> str:
    """A refused field row in words that do not contradict themselves: a witness says the kernel
    computes something else; agreement without a usable bound says it could not be verified."""
    status = row.get("status", "")
    if status == "unbounded":
        return f"could not be verified: {row['detail']}"
    if status == "unlifted":
        return f"could not be verified: {row['detail']}"
    if status == "float":
        return f"fails the float check: {row['detail']}"
    return f"does not compute its region: {row['detail']}"


@dataclass(frozen=True)
class VerifyReport:
    """Everything `mlso verify` prints, as plain data; `failure` None means B passes."""

    kernels: tuple[KernelVerdict, ...]
    kernel_rows: tuple[dict, ...]
    check_rows: tuple[dict, ...]
    rows: tuple[dict, ...]
    alg_rows: tuple[dict, ...]
    summary: dict
    failure: Failure | None

    @property
    def passed(self) -> bool:
        return self.failure is None


def check_kernels(
    original: onnx.ModelProto,
    model: onnx.ModelProto,
    options: VerifyOptions,
    kernels: list | None = None,
) -> list[KernelVerdict]:
    """Every per-kernel check of `model`'s MlsoKernel nodes against `original` (A), with
    `options.seed`. The chain check needs nvcc unless `trust_binary` (EnvironmentProblem)."""
    from mlso_cli.runtime import check_model

    kernels = check_model(model) if kernels is None else kernels
    generated: dict = {}
    try:
        chain_rows = chain_check_kernels(
            kernels, options.trust_binary, generated, packaged_constants(model)
        )
    except EnvironmentProblem as exc:
        raise EnvironmentProblem(
            f"binary not checked: {exc.what.rstrip('.')}",
            "Install the CUDA toolkit (nvcc), or pass --trust-binary to check only the "
            "source hash and plan",
        ) from None
    reps, of = _representatives(model, kernels) if options.distinct else (kernels, None)
    field_rows = (
        field_check_kernels(model, reps, options.seed, options.float_headroom)
        if options.field
        else []
    )
    emulate = _emulate_skip(options.emulate, options.gpu, kernels)
    outcomes = independent_check_kernels(
        original, model, reps, generated, options.seed, lift=options.lift, emulate=emulate
    )
    field_by = {c.node_index: row for c, row in zip(reps, field_rows)}
    if of is not None:
        _duplicates(original, model, kernels, of, outcomes, options)
    verdicts = []
    for i, checked in enumerate(kernels):
        rep = checked.node_index if of is None else of[checked.node_index]
        verdicts.append(
            KernelVerdict(
                checked.name,
                checked.node_index,
                tuple(checked.node.output),
                chain_rows[i],
                field_by.get(rep) if options.field else None,
                outcomes[checked.node_index]["lifting"],
                outcomes[checked.node_index]["emulator"],
            )
        )
    return verdicts


def _representatives(model: onnx.ModelProto, kernels: list) -> tuple[list, dict[int, int]]:
    """The first kernel of each distinct (μGraph, fallback body) pair, and each kernel's
    representative by node index. Two such kernels are the same function of their inputs, so
    the field, float, lifting and emulator checks of one are the checks of the other; only the
    constant values they are fed differ, and those are compared with A's for each.

    Distinct up to value names (`_canonical_key`): a decoder's layers give the same region with
    other tensor names (`model.layers.0...` against `model.layers.1...`), and compared by raw
    bytes each layer's kernels were checked again: Phi-3's two layers gave 11 checks where 6
    differ, and with every search cached its optimize took 4 min 16 s on 2 cores (2 min 28 s
    now), most of it this check."""
    from mlso_cli.package.unpack import fallback_function

    first: dict[tuple[str, bytes], int] = {}
    of: dict[int, int] = {}
    reps = []
    for checked in kernels:
        key = _canonical_key(checked.ugraph_json, fallback_function(model, checked.node))
        if key not in first:
            first[key] = checked.node_index
            reps.append(checked)
        of[checked.node_index] = first[key]
    return reps, of


def _clear_metadata(proto) -> None:
    """Drop metadata_props (onnx >= 1.16 has them on nodes and functions; older, none)."""
    if hasattr(proto, "metadata_props"):
        del proto.metadata_props[:]


def _canonical_key(ugraph_json: str, fn: onnx.FunctionProto | None) -> tuple[str, bytes]:
    """(μGraph, body) with every value name replaced by its order of first appearance in the body
    (formal inputs first), names, doc strings and metadata cleared, and the μGraph's input
    and output names mapped through the same renaming, so the pairing of the μGraph's inputs with
    the body's stays part of the key. A body with a subgraph (If, Loop) keeps its own names:
    names inside a subgraph can refer to the outer scope, and renaming them is not attempted."""
    if fn is None:
        return ugraph_json, b""
    anon = onnx.FunctionProto()
    anon.CopyFrom(fn)
    anon.name, anon.overload, anon.doc_string = "", "", ""
    _clear_metadata(anon)
    subgraph = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
    if any(a.type in subgraph for n in anon.node for a in n.attribute):
        return ugraph_json, anon.SerializeToString(deterministic=True)
    names: dict[str, str] = {}

    def canon(name: str) -> str:
        return names.setdefault(name, f"v{len(names)}") if name else name

    def rename(field) -> None:
        renamed = [canon(x) for x in field]
        del field[:]
        field.extend(renamed)

    rename(anon.input)
    for node in anon.node:
        node.name, node.doc_string = "", ""
        _clear_metadata(node)  # the exporter's module path, which names the layer
        rename(node.input)
        rename(node.output)
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                attr.t.name = ""
    rename(anon.output)
    for info in anon.value_info:
        info.name = canon(info.name)
    graph = json.loads(ugraph_json)
    for k in ("input_names", "output_names"):
        # a name the body does not have keeps itself (marked), so it never matches a renamed one
        graph[k] = [names.get(x, f"?{x}") for x in graph.get(k, [])]
    return json.dumps(graph, sort_keys=True), anon.SerializeToString(deterministic=True)


def _duplicates(
    original: onnx.ModelProto,
    model: onnx.ModelProto,
    kernels: list,
    of: dict[int, int],
    outcomes: dict[int, dict],
    options: VerifyOptions,
) -> None:
    """Fill `outcomes` for kernels that are not their own representative: the representative's
    results, unless a constant the kernel holds is not A's value (then its lifting check fails,
    as it would have run alone)."""
    from mlso_cli.package.regionmodel import region_model, value_infos
    from mlso_cli.verify.liftcheck import Originals, constant_problems

    dups = [c for c in kernels if of[c.node_index] != c.node_index]
    if not dups:
        return
    infos, originals = value_infos(model), Originals(original)
    for checked in dups:
        rep = outcomes[of[checked.node_index]]
        lifting = rep["lifting"]
        if options.lift:
            try:
                body = region_model(model, checked.node, infos)
            except ValueError:
                body = None
            problems = constant_problems(
                original, model, checked.node, originals=originals, body=body
            )
            if problems:
                lifting = CheckOutcome(
                    "failed",
                    "constants that are not the original model's: " + "; ".join(problems[:3]),
                )
        outcomes[checked.node_index] = {"lifting": lifting, "emulator": rep["emulator"]}


def verify_models(
    a: onnx.ModelProto,
    b: onnx.ModelProto,
    options: VerifyOptions,
    *,
    source_a: str = "A",
    source_b: str = "B",
) -> VerifyReport:
    """The whole chain (module docstring) on B against A, both loaded with their weights.
    A and B with different graph inputs or outputs are a failure, before any check runs."""
    specs_a, specs_b = input_specs(a), input_specs(b)
    if [(n, s) for n, s, _ in specs_a] != [(n, s) for n, s, _ in specs_b]:
        return _refused(
            Failure(
                "A and B have different graph inputs",
                f"A: {[(n, s) for n, s, _ in specs_a]}; B: {[(n, s) for n, s, _ in specs_b]}",
            ),
            options,
        )
    from mlso_cli.package import check_input_shapes

    # B was optimized for fixed shapes: say so in mlso's words before the checks trip on them
    check_input_shapes(b, {n: s for n, s, _ in specs_a}, source_b)
    outs_a = [o.name for o in a.graph.output]
    if outs_a != [o.name for o in b.graph.output]:
        return _refused(Failure("A and B have different graph outputs"), options)
    _require_input_memory(specs_a, source_a, options.samples * len(options.scales))
    from mlso_cli.runtime import check_model

    kernels = check_model(b)  # plans and binary hashes, once for every check below
    verdicts = check_kernels(a, b, options, kernels)
    bad_chain = next((v for v in verdicts if v.chain["detail"]), None)
    if bad_chain is not None:
        return _refused(
            Failure(
                f"mlso kernel '{bad_chain.node}' is not what its μGraph compiles to: "
                f"{bad_chain.chain['detail']}",
                node=bad_chain.node,
            ),
            options,
            verdicts,
        )
    rows = compare_outputs(a, b, options, specs_a)
    failed = not all(r["pass"] for r in rows)
    alg_rows, alg_summary = _algebraic(
        a, b, options.seed, rows, options.algebraic, options.numeric, source_a, source_b
    )
    kernel_rows = [v.field for v in verdicts if v.field is not None]
    chain_rows = [v.chain for v in verdicts]
    outcomes = {v.node_index: {"lifting": v.lifting, "emulator": v.emulator} for v in verdicts}
    check_rows = _check_rows(
        kernels,
        chain_rows,
        kernel_rows,
        outcomes,
        options.field,
        options.trust_binary,
        options.gpu,
        failed,
    )
    # one bound per check obtained: kernels that share a check (VerifyOptions.distinct) count once
    usable = list({id(v.field): v.bound for v in verdicts if v.bound is not None}.values())
    summary = {
        "type": "summary",
        "pass": False,
        "checks": len(rows),
        "failed": sum(not r["pass"] for r in rows),
        "kernels": len(kernel_rows),
        "kernels_equivalent": sum(k["equivalent"] for k in kernel_rows),
        # the union of the bounds obtained; None when no kernel has one (never a made-up 0 or 2)
        "false_accept_bound": min(1.0, sum(usable)) if usable else None,
        "bound_assumes": sorted({k["assumes"] for k in kernel_rows if k.get("assumes")}),
        "seed": options.seed,
        "binaries_checked": sum(c["binary"] is True for c in chain_rows),
        "binaries_trusted": sum(c["binary"] == "not checked" for c in chain_rows),
        "lifting_checked": sum(v.lifting.status != "skipped" for v in verdicts),
        "emulated": sum(v.emulator.status != "skipped" for v in verdicts),
        **{k: v for k, v in alg_summary.items() if k != "algebraic_ok"},
    }
    failure = _first_failure(verdicts, rows, alg_rows, alg_summary)
    summary["pass"] = failure is None
    return VerifyReport(
        tuple(verdicts),
        tuple(kernel_rows),
        tuple(check_rows),
        tuple(rows),
        tuple(alg_rows),
        summary,
        failure,
    )


def _refused(
    failure: Failure, options: VerifyOptions, verdicts: Sequence[KernelVerdict] = ()
) -> VerifyReport:
    summary = {"type": "summary", "pass": False, "seed": options.seed, "checks": 0}
    return VerifyReport(tuple(verdicts), (), (), (), (), summary, failure)


def _first_failure(
    verdicts: Sequence[KernelVerdict],
    rows: Sequence[dict],
    alg_rows: Sequence[dict],
    alg_summary: dict,
) -> Failure | None:
    """The failure verify reports: field and float first, then lifting, then the emulator,
    then B's outputs in ONNX Runtime, then the algebraic check."""
    for v in verdicts:
        if v.field is not None and not v.field["equivalent"]:
            return Failure(f"mlso kernel '{v.node}' {field_failure(v.field)}", node=v.node)
    for v in verdicts:
        if v.lifting.status == "failed":
            return Failure(
                f"mlso kernel '{v.node}' fails the lifting check: {v.lifting.detail}",
                "Re-run `mlso optimize` on A; if a fresh B fails too, report it as a lifting bug",
                node=v.node,
            )
    for v in verdicts:
        if v.emulator.status == "failed":
            return Failure(
                f"mlso kernel '{v.node}': its generated source, run on the host emulator, "
                f"does not compute its original nodes: {v.emulator.detail}",
                "Re-run `mlso optimize` on A; if a fresh B fails too, report it as a code "
                "generation bug",
                node=v.node,
            )
    bad_rows = [r for r in rows if not r["pass"]]
    if bad_rows:
        worst = max(bad_rows, key=lambda r: r["rel_err_b"])
        return Failure(
            f"B differs from A: output '{worst['output']}' at scale {worst['scale']:g} has "
            f"relative error {worst['rel_err_b']:.3g} (limit {worst['limit']:g}, A's own error "
            f"{worst['rel_err_a']:.3g})"
        )
    if not alg_summary["algebraic_ok"]:
        bad = next(r for r in alg_rows if r["status"] == "differs")
        return Failure(
            f"B's output '{bad['output']}' is not algebraically equal to A's: {bad['detail']} "
            f"({_closeness(bad)})",
            "Pass --numeric to accept numerical equivalence",
        )
    return None


def compare_outputs(
    a: onnx.ModelProto, b: onnx.ModelProto, options: VerifyOptions, specs: list | None = None
) -> list[dict]:
    """A and B in ONNX Runtime against an fp64 evaluation of A, one row per output, sample and
    scale (module docstring of commands/verify.py for the rule). No comparable output at any
    scale (down to SMALLEST_AUTO_SCALE) is an MlsoError: verify could not compare."""
    specs = input_specs(a) if specs is None else specs
    rng = np.random.default_rng(options.seed)
    bounds = index_bounds(a)

    def compare(scales: list[float]) -> list[dict]:
        """Rows of every output of every sample at these input scales; none where the fp64
        reference is not finite or no output is representable in its dtype."""
        feeds = [
            (scale, sample, _feeds(specs, rng, scale, bounds))
            for scale in scales
            for sample in range(options.samples)
        ]
        got_a, got_b, refs = _evaluate_apart(a, b, [f for _, _, f in feeds], options.gpu)
        out: list[dict] = []
        for (scale, sample, _), ga, gb, ref in zip(feeds, got_a, got_b, refs, strict=True):
            if not all(np.all(np.isfinite(v)) for v in ref.values()):
                continue  # adversarial scales only where the reference stays finite
            for name in ga:
                out.extend(_output_row(name, scale, sample, ref, ga, gb, options))
        return out

    rows = compare(list(options.scales))
    # Weights fed as graph inputs at N(0, 1) can overflow a float16 output at every scale asked
    # for (a SwiGLU MLP with its down projection: about 1e5 at scale 1). Then no output was
    # compared, which says nothing about B: shrink the inputs until outputs are representable.
    scale = min(options.scales)
    while not rows and scale > SMALLEST_AUTO_SCALE:
        scale /= 8
        rows += compare([scale])
    if not rows:
        raise MlsoError(
            f"could not compare A and B: at every input scale down to {scale:.2g} the fp64 "
            "reference was not finite or overflowed the outputs' dtypes",
            "Pass the input scales at which the model's outputs are finite, e.g. --scales 0.001",
        )
    return rows


def _evaluate_apart(
    a: onnx.ModelProto, b: onnx.ModelProto, feeds: list[dict], gpu: int | None
) -> tuple[list[dict], list[dict], list[dict]]:
    """A's and B's outputs in ONNX Runtime and A's fp64 reference, each for every set of feeds,
    by one evaluator at a time: each is built, run on all the feeds and let go before the next.
    Why: each holds its own copy of the weights (ORT's sessions on the CPU add float32 copies
    of float16 weights; the reference holds float64 ones), and alive together they took 13x
    the weights' size (a 2-layer Phi-3-mini-width export, 478 MB: 6.2 GB at the peak; Mistral-7B
    width, 906 MB: 12.5 GB). A first: a model ORT cannot load fails before the reference runs."""
    names = [o.name for o in a.graph.output]
    got = []
    for model, which in ((a, "A"), (b, "B")):
        sess = _session(model, gpu, which)
        try:
            got.append([dict(zip(names, sess.run(names, f))) for f in feeds])
        except Exception as exc:  # noqa: BLE001 - ORT's errors are one class per status code
            raise InputError(
                f"ONNX Runtime cannot run model {which} ({model.graph.name or 'unnamed'}) on "
                f"verify's inputs: {first_line(exc)}",
                "Check that the model runs in ONNX Runtime; where it ran out of memory, pass "
                "smaller --input-shape values or use a machine with more memory",
            ) from None
        del sess
    reference = Reference(a)
    with np.errstate(all="ignore"):  # overflow at adversarial scales is skipped by the caller
        refs = [reference(f) for f in feeds]
    del reference
    return got[0], got[1], refs


def _output_row(
    name: str, scale: float, sample: int, ref: dict, got_a: dict, got_b: dict, options
) -> list[dict]:
    dt = got_b[name].dtype
    if not representable(ref[name], dt):
        return []  # no program can be right: the true output overflows its dtype
    exact = dt.kind in "iub"  # integers and booleans must match exactly
    limit = 0.0 if exact else LIMITS[_DTYPE_OF.get(dt, DType.BF16)]
    ea, eb = _rel(got_a[name], ref[name]), _rel(got_b[name], ref[name])
    diff = np.abs(got_b[name].astype(np.float64) - ref[name])
    if exact:
        ok = bool(np.array_equal(got_b[name], np.asarray(ref[name]).astype(dt)))
    else:
        ok = eb <= max(limit, 2 * ea)
    rt = options.rtol_per.get(name, options.rtol)
    at = options.atol_per.get(name, options.atol)
    if rt is not None or at is not None:
        ok = ok and bool(np.all(diff <= (at or 0.0) + (rt or 0.0) * np.abs(ref[name])))
    return [
        {
            "type": "output",
            "output": name,
            "scale": scale,
            "sample": sample,
            "dtype": str(dt),
            "limit": limit,
            "rel_err_a": ea,
            "rel_err_b": eb,
            "max_abs_err_b": float(diff.max()) if diff.size else 0.0,
            "pass": ok,
        }
    ]
