"""`mlso bench A B [C ...]`: every model against the first, in ONNX Runtime, interleaved.

All the models are opened in one process and given the same inputs. Each round times every
model's `--iters` calls, in an order rotated from round to round and mirrored within it, for
`--repeats` rounds (bench/interleave.py says why). Per model and mode: the median per-call time
over the rounds, its interquartile range, and the speedup against the first model taken round by
round. With `--gpu N`: the CUDA EP with IOBinding (inputs and outputs on the GPU), plain and
under ONNX Runtime's CUDA graph, and then each MlsoKernel region against its original nodes.
Without `--gpu`: the CPU EP, plain only, where MlsoKernel nodes run their fallback bodies.

Models are not checked by mlso's frontend: anything ONNX Runtime can run is accepted,
`com.microsoft` contrib ops included (bench/models.py says why).
"""

from __future__ import annotations

import json

import click

from mlso_cli.commands.options import input_shape_option, json_option
from mlso_cli.console import chatty, line, log, quiet, stderr, summary
from mlso_cli.errors import UsageError

# the names also live in bench/compare.py; repeated here so that `mlso --help` stays cheap
PLAIN = "plain"
CUDA_GRAPH = "cuda-graph"


def _modes(mode: str | None, cuda_graph: bool, gpu: int | None) -> list[str]:
    """The modes to time, from --mode, the deprecated --cuda-graph and whether there is --gpu."""
    if cuda_graph:
        if mode == PLAIN:
            raise UsageError(
                "--cuda-graph and --mode plain contradict each other", "Give one of them"
            )
        log("--cuda-graph is deprecated: both modes are timed by default; use --mode")
        mode = mode or "both"
    if gpu is None:
        if mode in (CUDA_GRAPH, "both"):
            raise UsageError(
                ("--cuda-graph" if cuda_graph else f"--mode {mode}") + " needs --gpu N",
                "ONNX Runtime's CUDA graph runs on the CUDA EP only: add --gpu N, or drop the "
                "flag to time plain runs on the CPU",
            )
        return [PLAIN]
    mode = mode or "both"
    return [PLAIN, CUDA_GRAPH] if mode == "both" else [mode]


def _table(rows: list[dict], title: str) -> None:
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for col in ("mode", "#", "model", "median µs", "IQR µs", "vs first (IQR)"):
        t.add_column(
            col,
            justify="right" if col not in ("mode", "model") else "left",
            no_wrap=col == "model",  # a path cut in two cannot be copied
        )
    models = [r for r in rows if r["type"] == "model"]
    modes = list(dict.fromkeys(r["mode"] for r in models))
    for r in sorted(models, key=lambda r: (modes.index(r["mode"]), r["index"])):
        if "skipped" in r:
            t.add_row(r["mode"], str(r["index"]), r["model"], "—", "—", r["skipped"])
            continue
        q1, q3 = r["iqr_us"]
        vs = _vs(r)
        t.add_row(
            r["mode"],
            str(r["index"]),
            r["model"],
            f"{r['median_us']:.1f}",
            f"{q1:.1f}–{q3:.1f}",
            vs,
        )
    stderr().print(t)
    regions = [r for r in rows if r["type"] == "region"]
    if regions:
        t = Table(title="MlsoKernel regions", title_justify="left")
        for col in ("model", "node", "original µs", "mlso µs", "speedup"):
            t.add_column(col)
        for r in regions:
            fast = r["served_us"] if r["served_us"] is not None else r["kernel_us"]
            t.add_row(
                r["model"], r["node"], f"{r['orig_us']:.1f}", f"{fast:.1f}", f"{r['speedup']:.2f}x"
            )
        stderr().print(t)


def _vs(r: dict) -> str:
    """A model row's comparison with the first, in words where the figures say nothing."""
    if r["index"] == 0:
        return "reference"
    if r.get("speedup") is None:
        return "none: fallback bodies ran (no GPU)"
    s1, s3 = r["speedup_iqr"]
    if r.get("verdict") == "no measurable difference":
        return f"no measurable difference ({s1:.2f}–{s3:.2f})"
    return f"{r['speedup']:.2f}x ({s1:.2f}–{s3:.2f})"


def _summary(rows: list[dict], device: str) -> str:
    """The command's one line for a log: each model against the first, per mode."""
    parts = [
        f"{r['mode']}: {r['model']} vs first: {_vs(r)}"
        for r in rows
        if r["type"] == "model" and r["index"] != 0 and "skipped" not in r
    ]
    return f"bench on {device}: " + ("; ".join(parts) or "nothing timed")


@click.command("bench")
@click.argument("models", nargs=-1, required=True, metavar="ORIG FAST [MODEL]...")
@click.option(
    "--gpu",
    type=int,
    default=None,
    help="GPU index: time on the CUDA EP. Without it: the CPU EP, plain mode only.",
)
@click.option(
    "--mode",
    type=click.Choice([PLAIN, CUDA_GRAPH, "both"]),
    default=None,
    help="Plain ONNX Runtime runs, its CUDA graph replay, or both. [default: both with --gpu, "
    "plain without]",
)
@input_shape_option
@json_option
@click.option(
    "--repeats",
    "--rounds",
    "repeats",
    type=click.IntRange(min=1),
    default=15,
    show_default=True,
    help="Rounds; each times every model once. Medians and spreads are over the rounds.",
)
@click.option(
    "--iters",
    type=click.IntRange(min=1),
    default=50,
    show_default=True,
    help="Calls per model per round.",
)
@click.option(
    "--warmup",
    type=click.IntRange(min=0),
    default=10,
    show_default=True,
    help="Untimed calls per model before the first round.",
)
@click.option(
    "--threads",
    type=click.IntRange(min=1),
    default=None,
    help="ONNX Runtime's intra-op threads per session. [default: ONNX Runtime's choice] On a "
    "busy CPU, 1 gives steadier figures.",
)
@click.option(
    "--regions/--no-regions",
    default=True,
    show_default=True,
    help="With --gpu, also time each MlsoKernel region against its original nodes.",
)
@click.option(
    "--cuda-graph",
    is_flag=True,
    hidden=True,
    help="Deprecated: both modes are timed by default; use --mode.",
)
def bench_cmd(
    models: tuple[str, ...],
    gpu: int | None,
    mode: str | None,
    input_shapes: tuple[str, ...],
    as_json: bool,
    repeats: int,
    iters: int,
    warmup: int,
    threads: int | None,
    regions: bool,
    cuda_graph: bool,
) -> None:
    """Time every model against the first in ONNX Runtime, interleaved round by round."""
    if len(models) < 2:
        raise UsageError(
            "bench needs at least two models", "Give ORIG and FAST (and any more to compare)"
        )
    modes = _modes(mode, cuda_graph, gpu)
    device = "cpu"
    if gpu is not None:
        from mlso_cli.pipeline.gpu import require_gpu

        device = require_gpu(gpu).name
    from mlso_cli.bench.compare import compare
    from mlso_cli.bench.models import open_model, require_same_inputs
    from mlso_cli.frontend.load import parse_input_shapes

    shapes = parse_input_shapes(input_shapes)
    opened = [open_model(src, shapes) for src in models]
    require_same_inputs(opened)
    if gpu is None:
        for m in opened:
            if m.mlso_nodes and not quiet():
                # said even when stderr is not a terminal: it is why no speedup is reported
                line(
                    f"mlso: note: {m.source} has {m.mlso_nodes} MlsoKernel nodes; on the CPU EP "
                    "they run their fallback bodies (the original nodes), not mlso's kernels, "
                    "so no speedup is reported for them (pass --gpu N to time mlso's kernels)"
                )
    rows = compare(
        opened,
        modes,
        gpu,
        device=device,
        rounds=repeats,
        iters=iters,
        warmup=warmup,
        threads=threads,
        regions=regions,
    )
    if as_json:
        for r in rows:
            click.echo(json.dumps(r))
    if chatty():
        _table(
            rows,
            f"bench on {device}: {repeats} rounds x {iters} calls per model, interleaved; "
            "median and interquartile range of the rounds",
        )
    summary(_summary(rows, device))
