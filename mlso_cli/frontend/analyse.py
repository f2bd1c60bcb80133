"""Partition, then lift: a region that cannot be lifted is not fusable, and its nodes say why."""

from __future__ import annotations

from dataclasses import dataclass

from mlso_cli.frontend.lift import LiftedRegion, lift_all
from mlso_cli.frontend.load import LoadedModel
from mlso_cli.frontend.partition import Excluded, Partition, PartitionBounds, partition


@dataclass
class Analysis:
    partition: Partition
    lifted: list[LiftedRegion]


def analyse(
    loaded: LoadedModel, bounds: PartitionBounds | None = None, merge: bool = True
) -> Analysis:
    """merge: lift sibling projections as one matmul (frontend/siblings.py)."""
    part = partition(loaded, bounds)
    lifted, failed = lift_all(loaded, part.regions, merge)
    if failed:
        nodes = loaded.graph.node
        for region, why in failed:
            for i in region.nodes:
                n = nodes[i]
                part.excluded.append(
                    Excluded(i, n.name or f"#{i}", n.op_type, f"region could not be lifted: {why}")
                )
        part.excluded.sort(key=lambda e: e.index)
        keep = [lr.region for lr in lifted]
        part.regions = keep
    return Analysis(part, lifted)
