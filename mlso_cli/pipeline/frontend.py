"""Stages load -> partition -> lift: a model file becomes its lifted regions (search targets)."""

from __future__ import annotations

from mlso_cli.frontend.analyse import analyse
from mlso_cli.frontend.load import load_model
from mlso_cli.pipeline.artifacts import Lifted


def lift(source: str, input_shapes: dict[str, tuple[int, ...]] | None = None) -> Lifted:
    """Load `source` (a path, or "-" for stdin) with fixed input shapes, partition it, lift each
    region; regions that cannot be lifted are left out with a reason (see `mlso inspect`). The
    bytes read are hashed (LoadedModel.bytes_sha256): the verdict cache names the original by
    them."""
    loaded = load_model(source, input_shapes or {}, digest=True)
    return Lifted(loaded, analyse(loaded))
