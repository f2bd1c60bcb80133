"""`mlso verify A B`: flags and reporting over the verification library (verify/packaged.py).

The checks themselves live in `mlso_cli.verify.packaged.verify_models`, which optimize also runs
on the model it is about to write; this module parses flags, prints the report and turns its
first failure into the exit code. What the library checks:

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
here with exit 3 naming the output, unless --numeric accepts numerical equivalence (the report
then says it was accepted so). This holds whatever B holds, mlso kernels or plain ONNX nodes: a
B that computes a different function from A is not what A computes (a weight changed by 1% is
a different model). A B that does not lift (ORT-fused, or an op with no lifting rule) is
reported as "algebraic: skipped" with the reason, and the numeric comparison decides.

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

from mlso_cli.commands.options import input_shape_option, json_option
from mlso_cli.console import chatty, stderr
from mlso_cli.console import summary as one_line_summary
from mlso_cli.errors import UsageError, VerificationFailed
from mlso_cli.frontend.load import load_model, parse_input_shapes, with_weights
from mlso_cli.verify.liftcheck import EMULATOR_THREADS
from mlso_cli.verify.packaged import VerifyOptions, representable, verify_models

__all__ = ["representable", "verify_cmd"]


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
    options = VerifyOptions(
        seed=seed,
        samples=samples,
        scales=tuple(scale_list),
        rtol=rt_default,
        atol=at_default,
        rtol_per=rt_per,
        atol_per=at_per,
        gpu=gpu,
        field=field,
        lift=lift,
        emulate=emulate,
        trust_binary=trust_binary,
        algebraic=algebraic,
        numeric=numeric,
    )
    report = verify_models(a, b, options, source_a=model_a, source_b=model_b)
    if report.rows:  # a refusal before the comparisons (interfaces, chain) prints nothing
        if as_json:
            for r in report.kernel_rows + report.check_rows + report.rows + report.alg_rows:
                click.echo(json.dumps(r))
            click.echo(json.dumps(report.summary))
        if chatty():
            _print(
                report.rows,
                report.summary,
                report.kernel_rows,
                report.check_rows,
                report.alg_rows,
            )
    if report.failure is not None:
        raise VerificationFailed(report.failure.what, report.failure.fix)
    checks = report.summary.get("checks", 0)
    kernels = report.summary.get("kernels", 0)
    one_line_summary(
        f"verify: B matches A: {checks} output check(s) passed"
        + (f", {kernels} MlsoKernel node(s) equivalent" if kernels else "")
    )


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
