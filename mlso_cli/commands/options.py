"""Options shared by several commands."""

from __future__ import annotations

import click

input_shape_option = click.option(
    "--input-shape",
    "input_shapes",
    multiple=True,
    metavar="NAME=D0,D1,...",
    help="Fix the symbolic dimensions of a graph input. Repeat for several inputs.",
)
json_option = click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON object per line on stdout."
)
