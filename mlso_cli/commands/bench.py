"""`mlso bench ORIG FAST --gpu N`: latency of both models in ONNX Runtime, and per region.

Whole models run on the CUDA EP with IOBinding (inputs and outputs on the GPU), FAST with the
mlso library registered. Each MlsoKernel region's program is timed by CUDA-graph replay through
PyCUDA, next to the original region (its fallback body) as ONNX Runtime runs it.
"""

from __future__ import annotations

import json

import click

from mlso_cli.commands.options import input_shape_option, json_option
from mlso_cli.console import chatty, stderr
from mlso_cli.frontend.load import load_model, parse_input_shapes, with_weights
from mlso_cli.pipeline.gpu import require_gpu


@click.command("bench")
@click.argument("orig", metavar="ORIG")
@click.argument("fast", metavar="FAST")
@click.option("--gpu", type=int, required=True, help="GPU index to run on.")
@input_shape_option
@json_option
@click.option(
    "--repeats", default=5, show_default=True, help="Timed repeats; the median is reported."
)
@click.option("--iters", default=100, show_default=True, help="Calls per repeat.")
@click.option(
    "--cuda-graph", is_flag=True, help="Also time both models under ONNX Runtime's CUDA graph."
)
def bench_cmd(orig, fast, gpu, input_shapes, as_json, repeats, iters, cuda_graph) -> None:
    """Time ORIG and FAST in ONNX Runtime on the CUDA EP, whole models and per region."""
    info = require_gpu(gpu)
    from mlso_cli import runtime
    from mlso_cli.bench.harness import random_feeds, time_regions, time_session

    shapes = parse_input_shapes(input_shapes)
    a = with_weights(load_model(orig, shapes, fold=False))
    b = with_weights(load_model(fast, shapes, fold=False))
    feeds = random_feeds(a)
    rows = []
    for label, graph_opt in [("ort", False)] + ([("ort-cuda-graph", True)] if cuda_graph else []):
        opts = [
            (
                "CUDAExecutionProvider",
                {"device_id": gpu, "enable_cuda_graph": "1" if graph_opt else "0"},
            )
        ]
        ta = time_session(
            runtime.session(a.SerializeToString(), providers=opts),
            feeds,
            gpu,
            repeats=repeats,
            iters=iters,
        )
        tb = time_session(
            runtime.session(b.SerializeToString(), providers=opts),
            feeds,
            gpu,
            repeats=repeats,
            iters=iters,
        )
        rows.append(
            {
                "type": "model",
                "mode": label,
                "orig_us": ta.median_us,
                "fast_us": tb.median_us,
                "speedup": ta.median_us / tb.median_us,
            }
        )
    for rt in time_regions(b, gpu, repeats=repeats, iters=iters):
        rows.append(
            {
                "type": "region",
                "node": rt.node,
                "orig_us": rt.orig_us,
                "kernel_us": rt.kernel_us,
                "served_us": rt.served_us,
                "speedup": rt.speedup,
            }
        )
    if as_json:
        for r in rows:
            click.echo(json.dumps({**r, "gpu": info.name}))
    if chatty():
        from rich.table import Table

        t = Table(title=f"bench on {info.name} ({info.arch})", title_justify="left")
        for col in ("what", "original µs", "mlso µs", "speedup"):
            t.add_column(col)
        for r in rows:
            what = f"model ({r['mode']})" if r["type"] == "model" else f"region {r['node']}"
            fast_us = r.get("fast_us") or r.get("served_us") or r.get("kernel_us")
            t.add_row(what, f"{r['orig_us']:.1f}", f"{fast_us:.1f}", f"{r['speedup']:.2f}x")
        stderr().print(t)
