"""`mlso verify A B`: run both models on random inputs and compare them to an fp64 evaluation of A.

When B holds mlso kernels (ai.mlso::MlsoKernel), each node's embedded μGraph is first checked
against its function body (the original region, lifted) with the finite-field checker; every
verdict carries its false-accept bound, and the bounds are union-bounded over the run. Two
checks do not go through the lifter (verify/liftcheck.py): the μGraph in fp64 against onnx's
reference evaluator on the original nodes, with its constants compared as values with A's, and
the generated source on the host emulator. The report says per kernel which checks ran.

Then the algebraic check (verify/algebraic.py): where both models lift, every graph output of B
is compared with A's in the finite field, with each model's weights as exact constants. A B that
is only numerically close to A (an eps added to a softmax denominator, a weight rounded to fp16)
passes every comparison of a kernel with its own fallback body and the numeric one, and fails
here with exit 3 naming the output, unless --numeric accepts numerical equivalence. Only a B
that carries mlso kernels fails so: mlso's rewrites are exact, so there a difference is a wrong
or altered B. For two plain ONNX models (an fp16 export against its fp32 original) the
difference is reported and numerical equivalence decides, as it always has.

B passes an output when its norm-wise relative error ||B - ref|| / ||ref|| is within the limit
for its dtype (fp32 1e-5, fp16 2e-3, bf16 1e-2) or no worse than twice A's own error at the same
inputs (A is the user's model as ONNX Runtime runs it; B is not blamed for A's rounding). With
--rtol/--atol, every element must also satisfy |B - ref| <= atol + rtol * |ref|.

Exit codes: 3 when a kernel of B fails one of its checks, or both models ran and differ. A model ONNX Runtime cannot load on the CPU
(an op of a domain it does not know, such as com.example::FancyOp) is exit 1: the model, not the
machine, is the problem, and verify cannot compare what it cannot run, so it says so instead of
passing or failing. Exit 4 is kept for the machine: --gpu without a GPU, or ONNX Runtime without
a usable CUDA EP.
"""

from __future__ import annotations

import json

import click
import numpy as np
import onnx

from mlso_cli.commands.options import input_shape_option, json_option
from mlso_cli.console import chatty, stderr
from mlso_cli.console import summary as one_line_summary
from mlso_cli.errors import (
    EnvironmentProblem,
    InputError,
    MlsoError,
    UsageError,
    VerificationFailed,
)
from mlso_cli.frontend.load import load_model, parse_input_shapes, require_memory, with_weights
from mlso_cli.ir import DType
from mlso_cli.verify.floatcheck import LIMITS
from mlso_cli.verify.liftcheck import EMULATOR_THREADS, index_bounds
from mlso_cli.verify.reference64 import input_specs, reference_outputs

SMALLEST_AUTO_SCALE = 2.0**-12
"""How far verify shrinks the inputs below the smallest --scales when no output was comparable."""

_DTYPE_OF = {np.dtype(np.float32): DType.F32, np.dtype(np.float16): DType.F16}
"""numpy dtypes ONNX Runtime returns; anything else here is bfloat16."""


def _parse_tol(values: tuple[str, ...], flag: str) -> tuple[float | None, dict[str, float]]:
    default, per = None, {}
    for v in values:
        name, sep, num = v.rpartition("=")
        try:
            x = float(num)
        except ValueError:
            raise UsageError(
                f"{flag} '{v}' is not a number or NAME=number",
                f"Write e.g. {flag} 1e-3 or {flag} O=1e-3",
            ) from None
        if not x >= 0 or x == float("inf"):  # also NaN
            raise UsageError(
                f"{flag} '{v}' must be a finite number >= 0", f"Write e.g. {flag} 1e-3"
            )
        if sep:
            per[name] = x
        else:
            default = x
    return default, per


def _check_numbers(samples: int, seed: int, gpu: int | None, scales: list[float]) -> None:
    """Flags that would otherwise make verify pass vacuously (--samples 0 checks nothing) or fail
    with a numpy traceback (--seed -1) are usage errors, before any model is loaded."""
    rules = [
        (samples < 1, "--samples must be at least 1"),
        (seed < 0, "--seed must be >= 0 (numpy's generators take no negative seed)"),
        (gpu is not None and gpu < 0, "--gpu must be a GPU index >= 0"),
        (
            not scales or not all(0 < s < float("inf") for s in scales),
            "--scales must be a comma-separated list of finite numbers > 0",
        ),
    ]
    for bad, what in rules:
        if bad:
            raise UsageError(what)


def _parse_scales(scales: str) -> list[float]:
    try:
        return [float(s) for s in scales.split(",") if s.strip()]
    except ValueError:
        raise UsageError(f"--scales '{scales}' is not a comma-separated list of numbers") from None


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
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(
            f"ONNX Runtime cannot load model {which} ({model.graph.name or 'unnamed'}), so verify "
            f"cannot compare it: {first[:300]}",
            "verify runs both models in ONNX Runtime; ops of other domains need their library "
            "registered in ORT",
        ) from None
    if "CUDAExecutionProvider" not in sess.get_providers():
        raise EnvironmentProblem(
            f"ONNX Runtime could not use the CUDA EP on GPU {gpu}",
            "Install the CUDA and cuDNN libraries onnxruntime-gpu needs, or run verify without --gpu",
        )
    return sess


def _require_input_memory(specs: list, source: str) -> None:
    """Random inputs, ORT's outputs and the fp64 reference for huge --input-shape values could
    exhaust memory half-way (a MemoryError traceback, or the OOM killer); fail first instead."""
    nbytes = sum(int(np.prod(s, dtype=np.float64)) * np.dtype(dt).itemsize for _, s, dt in specs)
    require_memory(8 * nbytes, f"verifying {source} at these input shapes")


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


@click.command("verify")
@click.argument("model_a", metavar="A")
@click.argument("model_b", metavar="B")
@input_shape_option
@json_option
@click.option("--samples", default=2, show_default=True, help="Random input sets per scale.")
@click.option(
    "--seed",
    type=int,
    default=None,
    help="Seed for the random inputs and the field's primes (default: fresh from the OS each run, "
    "printed in the report, so a μGraph cannot be tuned to a known seed).",
)
@click.option(
    "--scales",
    default="1,4,1000",
    show_default=True,
    help="Input scales to test; large ones are adversarial (softmax logits, norm inputs).",
)
@click.option(
    "--rtol",
    multiple=True,
    metavar="[OUT=]X",
    help="Elementwise relative tolerance, for all or one output.",
)
@click.option(
    "--atol",
    multiple=True,
    metavar="[OUT=]X",
    help="Elementwise absolute tolerance, for all or one output.",
)
@click.option("--gpu", type=int, default=None, help="Run both models on this GPU with the CUDA EP.")
@click.option(
    "--field/--no-field",
    default=True,
    show_default=True,
    help="Check each mlso kernel's μGraph against its region in the finite field.",
)
@click.option(
    "--lift/--no-lift",
    default=True,
    show_default=True,
    help="Check each mlso kernel's μGraph against onnx's reference evaluator on its original "
    "nodes (fp64), and its constants against A's values.",
)
@click.option(
    "--emulate/--no-emulate",
    default=True,
    show_default=True,
    help=f"Run each mlso kernel's generated source on the CPU host emulator (kernels up to "
    f"{EMULATOR_THREADS} CUDA threads) against the fp64 reference.",
)
@click.option(
    "--trust-binary",
    is_flag=True,
    help="Check each kernel's source hash and plan against its μGraph, but not its binary (no nvcc here).",
)
@click.option(
    "--algebraic/--no-algebraic",
    default=True,
    show_default=True,
    help="Compare each output of B with A's in the finite field, with both models' weights as "
    "exact constants (skipped, with the reason, where a model does not lift).",
)
@click.option(
    "--numeric",
    is_flag=True,
    help="Accept a B that is numerically equivalent to A but not algebraically equal (the "
    "algebraic difference is still reported).",
)
def verify_cmd(
    model_a,
    model_b,
    input_shapes,
    as_json,
    samples,
    seed,
    scales,
    rtol,
    atol,
    gpu,
    field,
    lift,
    emulate,
    trust_binary,
    algebraic,
    numeric,
) -> None:
    """Check that model B computes what model A computes (exit 3 when it does not).

    \b
    Checks of each mlso kernel of B, in this order (the report says which ran):
      chain     its source, plan and binary are what its μGraph compiles to
      field     its μGraph equals its lifted fallback body in a finite field
      float     its μGraph as code generation computes it (fp32) vs fp64
      lifting   its μGraph (fp64) vs onnx's reference evaluator on its original nodes,
                and its constants vs A's values (--no-lift to skip)
      emulator  its generated source on the host emulator vs fp64 (CPU; --no-emulate)
    Then A and B run in ONNX Runtime and are compared with an fp64 evaluation of A, and each
    output of B is compared with A's in the finite field, weights as exact constants
    (algebraic; --no-algebraic to skip; --numeric accepts numerically equal outputs).
    """
    scale_list = _parse_scales(scales)
    if seed is None:
        import secrets

        seed = secrets.randbits(63)
    _check_numbers(samples, seed, gpu, scale_list)
    rt_default, rt_per = _parse_tol(rtol, "--rtol")
    at_default, at_per = _parse_tol(atol, "--atol")
    shapes = parse_input_shapes(input_shapes)
    if gpu is not None:
        from mlso_cli.pipeline.gpu import require_gpu

        require_gpu(gpu)
    a = with_weights(load_model(model_a, shapes, fold=False))
    b = with_weights(load_model(model_b, shapes, fold=False))
    specs_a, specs_b = input_specs(a), input_specs(b)
    if [(n, s) for n, s, _ in specs_a] != [(n, s) for n, s, _ in specs_b]:
        raise VerificationFailed(
            "A and B have different graph inputs",
            f"A: {[(n, s) for n, s, _ in specs_a]}; B: {[(n, s) for n, s, _ in specs_b]}",
        )
    from mlso_cli.package import check_input_shapes

    # B was optimized for fixed shapes: say so in mlso's words before the checks trip on them
    check_input_shapes(b, {n: s for n, s, _ in specs_a}, model_b)
    outs_a = [o.name for o in a.graph.output]
    if outs_a != [o.name for o in b.graph.output]:
        raise VerificationFailed("A and B have different graph outputs")
    _require_input_memory(specs_a, model_a)
    from mlso_cli.runtime import check_model

    kernels = check_model(b)  # plans and binary hashes, once for both checks below
    generated: dict = {}
    try:
        chain_rows = chain_check_kernels(kernels, trust_binary, generated)
    except EnvironmentProblem as exc:
        raise EnvironmentProblem(
            f"binary not checked: {exc.what.rstrip('.')}",
            "Install the CUDA toolkit (nvcc), or pass --trust-binary to check only the "
            "source hash and plan",
        ) from None
    bad_chain = next((c for c in chain_rows if c["detail"]), None)
    if bad_chain is not None:
        raise VerificationFailed(
            f"mlso kernel '{bad_chain['node']}' is not what its μGraph compiles to: "
            f"{bad_chain['detail']}"
        )
    kernel_rows = field_check_kernels(b, kernels, seed) if field else []
    outcomes = independent_check_kernels(
        a, b, kernels, generated, seed, lift=lift, emulate=_emulate_skip(emulate, gpu, kernels)
    )
    sess_a, sess_b = _session(a, gpu, "A"), _session(b, gpu, "B")
    rng = np.random.default_rng(seed)
    bounds = index_bounds(a)
    rows: list[dict] = []

    def compare(scale: float) -> list[dict]:
        """Rows of every output of every sample at one input scale; none where the fp64
        reference is not finite or no output is representable in its dtype."""
        out: list[dict] = []
        for sample in range(samples):
            feeds = _feeds(specs_a, rng, scale, bounds)
            with np.errstate(all="ignore"):  # overflow at adversarial scales is skipped below
                ref = reference_outputs(a, feeds)
            if not all(np.all(np.isfinite(v)) for v in ref.values()):
                continue  # adversarial scales only where the reference stays finite
            got_a = dict(zip(outs_a, sess_a.run(outs_a, feeds)))
            got_b = dict(zip(outs_a, sess_b.run(outs_a, feeds)))
            for name in outs_a:
                dt = got_b[name].dtype
                if not representable(ref[name], dt):
                    continue  # no program can be right: the true output overflows its dtype
                exact = dt.kind in "iub"  # integers and booleans must match exactly
                limit = 0.0 if exact else LIMITS[_DTYPE_OF.get(dt, DType.BF16)]
                ea, eb = _rel(got_a[name], ref[name]), _rel(got_b[name], ref[name])
                diff = np.abs(got_b[name].astype(np.float64) - ref[name])
                if exact:
                    ok = bool(np.array_equal(got_b[name], np.asarray(ref[name]).astype(dt)))
                else:
                    ok = eb <= max(limit, 2 * ea)
                rt, at = rt_per.get(name, rt_default), at_per.get(name, at_default)
                if rt is not None or at is not None:
                    ok = ok and bool(np.all(diff <= (at or 0.0) + (rt or 0.0) * np.abs(ref[name])))
                out.append(
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
                )
        return out

    for scale in scale_list:
        rows += compare(scale)
    # Weights fed as graph inputs at N(0, 1) can overflow a float16 output at every scale asked
    # for (a SwiGLU MLP with its down projection: about 1e5 at scale 1). Then no output was
    # compared, which says nothing about B: shrink the inputs until outputs are representable.
    scale = min(scale_list)
    while not rows and scale > SMALLEST_AUTO_SCALE:
        scale /= 8
        rows += compare(scale)
    failed = not all(r["pass"] for r in rows)
    if not rows:
        raise MlsoError(
            f"could not compare A and B: at every input scale down to {scale:.2g} the fp64 "
            "reference was not finite or overflowed the outputs' dtypes",
            "Pass the input scales at which the model's outputs are finite, e.g. --scales 0.001",
        )
    alg_rows, alg_summary = _algebraic(
        a, b, seed, rows, algebraic, numeric or not kernels, model_a, model_b
    )
    kernels_ok = all(k["equivalent"] for k in kernel_rows)
    check_rows = _check_rows(
        kernels, chain_rows, kernel_rows, outcomes, field, trust_binary, gpu, failed
    )
    independent_ok = all(o.status != "failed" for per in outcomes.values() for o in per.values())
    summary = {
        "type": "summary",
        "pass": not failed and kernels_ok and independent_ok and alg_summary["algebraic_ok"],
        "checks": len(rows),
        "failed": sum(not r["pass"] for r in rows),
        "kernels": len(kernel_rows),
        "kernels_equivalent": sum(k["equivalent"] for k in kernel_rows),
        "false_accept_bound": sum(k["bound"] for k in kernel_rows) if kernel_rows else None,
        "bound_assumes": sorted({k["assumes"] for k in kernel_rows if k.get("assumes")}),
        "seed": seed,
        "binaries_checked": sum(c["binary"] is True for c in chain_rows),
        "binaries_trusted": sum(c["binary"] == "not checked" for c in chain_rows),
        "lifting_checked": sum(per["lifting"].status != "skipped" for per in outcomes.values()),
        "emulated": sum(per["emulator"].status != "skipped" for per in outcomes.values()),
        **{k: v for k, v in alg_summary.items() if k != "algebraic_ok"},
    }
    if as_json:
        for r in kernel_rows + check_rows + rows + alg_rows:
            click.echo(json.dumps(r))
        click.echo(json.dumps(summary))
    if chatty():
        _print(rows, summary, kernel_rows, check_rows, alg_rows)
    if not kernels_ok:
        bad = next(k for k in kernel_rows if not k["equivalent"])
        raise VerificationFailed(
            f"mlso kernel '{bad['node']}' does not compute its region: {bad['detail']}"
        )
    for checked in kernels:
        per = outcomes[checked.node_index]
        if per["lifting"].status == "failed":
            raise VerificationFailed(
                f"mlso kernel '{checked.name}' fails the lifting check: {per['lifting'].detail}",
                "Re-run `mlso optimize` on A; if a fresh B fails too, report it as a lifting bug",
            )
    for checked in kernels:
        per = outcomes[checked.node_index]
        if per["emulator"].status == "failed":
            raise VerificationFailed(
                f"mlso kernel '{checked.name}': its generated source, run on the host emulator, "
                f"does not compute its original nodes: {per['emulator'].detail}",
                "Re-run `mlso optimize` on A; if a fresh B fails too, report it as a code "
                "generation bug",
            )
    if failed:
        worst = max((r for r in rows if not r["pass"]), key=lambda r: r["rel_err_b"])
        raise VerificationFailed(
            f"B differs from A: output '{worst['output']}' at scale {worst['scale']:g} has relative error "
            f"{worst['rel_err_b']:.3g} (limit {worst['limit']:g}, A's own error {worst['rel_err_a']:.3g})"
        )
    if not alg_summary["algebraic_ok"]:
        bad = next(r for r in alg_rows if r["status"] == "differs")
        raise VerificationFailed(
            f"B's output '{bad['output']}' is not algebraically equal to A's: {bad['detail']} "
            f"({_closeness(bad)})",
            "Pass --numeric to accept numerical equivalence",
        )
    one_line_summary(
        f"verify: B matches A: {summary['checks']} output check(s) passed"
        + (f", {summary['kernels']} MlsoKernel node(s) equivalent" if summary["kernels"] else "")
    )


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
    `numeric`: a difference is reported but accepted (--numeric, or a B without mlso kernels,
    where mlso promised nothing exact). `algebraic_ok` (dropped from the printed summary) is
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
        detail += "; accepted: numerical equivalence decides (--numeric, or B has no mlso kernels)"
    return alg_rows, {
        "algebraic": res.status,
        "algebraic_detail": detail,
        "algebraic_trials": res.trials,
        "algebraic_seconds": round(res.seconds, 3),
        "algebraic_enforced": not numeric,
        "algebraic_ok": res.status != "differs" or numeric,
    }


def chain_check_kernels(
    kernels: list, trust_binary: bool, generated: dict | None = None
) -> list[dict]:
    """Tie each MlsoKernel's binary to its μGraph: regenerate the CUDA source and launch plan from
    the embedded μGraph and compare them with the node's source_sha256 and plan, then recompile
    (nvcc, cached) and compare the fatbin with the node's binary. Why: the field check proves the
    μGraph; without this, a binary, plan or hash spliced in from another model would run
    unchecked. nvcc output is deterministic for one nvcc version (checked across cache folders),
    so a model optimized with another nvcc version fails here: re-run optimize, or pass
    --trust-binary to check only source and plan. `generated`, when given, receives each node's
    regenerated program by node index (the emulator check runs that very source)."""
    import hashlib

    from mlso_cli.codegen import DEFAULT_TARGETS, generate
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
            gp = generate(program, targets)
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


def field_check_kernels(model: onnx.ModelProto, kernels: list, seed: int) -> list[dict]:
    """Check each MlsoKernel's μGraph (`kernels`: runtime.check_model's results for `model`)
    against its lifted fallback body in the finite field."""
    from mlso_cli.bench.harness import region_model
    from mlso_cli.frontend.lift import LiftError, lift_whole_graph, with_input_order
    from mlso_cli.frontend.load import loaded_from_proto
    from mlso_cli.ir import loads
    from mlso_cli.verify.equivalence import check_equivalent

    rows = []
    for k, checked in enumerate(kernels, start=1):
        node = checked.node
        row = {
            "type": "kernel",
            "node": node.name,
            "equivalent": False,
            "bound": 1.0,
            "trials": 0,
            "detail": "",
        }
        rows.append(row)
        program = loads(checked.ugraph_json)
        body = loaded_from_proto(region_model(model, node), f"body of {node.name}")
        try:
            lifted = lift_whole_graph(body)
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
        )
        if verdict.heuristic:
            row["assumes"] = verdict.heuristic
        if verdict.equivalent:
            _float_check(row, reference, program, seed)
    return rows


FLOAT_CHECK_ELEMENTS = 1 << 22
"""Largest μGraph (input and output elements) whose float check runs in verify: the interpreter
is numpy, and a full-size attention region takes seconds."""


def _float_check(row: dict, reference, program, seed: int) -> None:
    """The μGraph as code generation computes it (the interpreter's float32 mode: 16-bit staging,
    casts, stabilised exps) against the reference region in float64. Why: the field treats CAST
    as the identity, so a μGraph that rounds softmax row sums to bf16 is equivalent there; here
    it must stay within its dtype's limit or twice the reference's own float32 error."""
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
        if e_prog > max(limit, 2 * e_ref):
            row["equivalent"] = False
            row["detail"] = (
                f"equivalent in the field, but as code generation computes it the error is "
                f"{e_prog:.3g} (limit {limit:g}, the region's own {e_ref:.3g})"
            )
            row["float_check"] = (
                f"FAILED: {e_prog:.3g} (limit {limit:g}, the region's own {e_ref:.3g})"
            )
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
    from mlso_cli.verify.liftcheck import Constants, Originals, check_kernel, value_infos

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


def _print(rows, summary, kernel_rows=(), check_rows=(), alg_rows=()) -> None:
    from rich.table import Table

    if summary.get("algebraic") == "skipped":
        stderr().print(
            f"algebraic: skipped: {summary['algebraic_detail']}", markup=False, soft_wrap=True
        )
    elif alg_rows:
        at = Table(
            title=f"algebraic A vs B (finite field, weights exact): {summary['algebraic_detail']}",
            title_justify="left",
        )
        for col in ("output", "verdict", "numeric rel err B"):
            at.add_column(col)
        for r in alg_rows:
            verdict = r["status"] if r["status"] != "differs" else f"DIFFERS: {r['detail']}"
            if r["status"] == "differs" and r["accepted"]:
                verdict += " (accepted: numerical equivalence decides)"
            err = r["rel_err_b"]
            at.add_row(r["output"], verdict, "" if err is None else f"{err:.2e}")
        stderr().print(at)

    if kernel_rows:
        kt = Table(title="mlso kernels vs their regions (finite field)", title_justify="left")
        for col in ("node", "verdict", "false-accept bound", "trials"):
            kt.add_column(col)
        for k in kernel_rows:
            kt.add_row(
                k["node"],
                "equivalent" if k["equivalent"] else f"NOT equivalent: {k['detail']}",
                f"{k['bound']:.2e}",
                str(k["trials"]),
            )
        stderr().print(kt)

    if check_rows:
        ct = Table(title="mlso kernels: the checks that ran", title_justify="left")
        for col in ("node", "chain", "field", "float", "lifting", "emulator", "ORT numeric"):
            ct.add_column(col)
        for c in check_rows:
            ct.add_row(
                c["node"], c["chain"], c["field"], c["float"], c["lifting"], c["emulator"], c["ort"]
            )
        stderr().print(ct)

    t = Table(
        title=f"verify: {'PASS' if summary['pass'] else 'FAIL'} ({summary['checks']} checks, "
        f"--seed {summary['seed']})",
        title_justify="left",
    )
    for col in (
        "output",
        "scale",
        "sample",
        "dtype",
        "err A",
        "err B",
        "max |B-ref|",
        "limit",
        "result",
    ):
        t.add_column(col)
    for r in rows:
        t.add_row(
            r["output"],
            f"{r['scale']:g}",
            str(r["sample"]),
            r["dtype"],
            f"{r['rel_err_a']:.2e}",
            f"{r['rel_err_b']:.2e}",
            f"{r['max_abs_err_b']:.2e}",
            f"{r['limit']:g}",
            "ok" if r["pass"] else "FAIL",
        )
    stderr().print(t)
