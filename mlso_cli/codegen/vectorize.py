"""Rewrite one vector lane's statements of an elementwise pass: wide loads, hoisted invariants.

Why: in a vector pass (`blockpass.elementwise.per_element(vector=True)`) each thread computes `width`
neighbours along the last axis, lane `vj` = 0..width-1 of vector `ev`. The emitter prints one
lane's statements, with index expressions in `ev` and `vj`. nvcc does not merge the lanes'
16-bit shared-memory loads into wide ones, nor does it see that `(ev * 8 + vj) / 128` is the
same for every lane, so a 16 x 512 staging pass issued eight scalar loads (and a row's rsqrt)
where one wide load (and one rsqrt) would do. This module decides, by evaluating each index
expression for every vector and lane, which reads are

- invariant: the same element for every lane (a row's mean): the statement moves out of the
  lane loop, computed once per vector;
- contiguous: element i0 + vj with i0 a multiple of the width (a tile row's neighbours): one
  aligned load of the whole vector before the lane loop, lanes taken from it;

and which stores are contiguous, to be written as one wide store. Anything it cannot evaluate
(an identifier other than ev and vj, a statement of another form) is left as it is, so the
rewrite only ever removes work and never changes a value.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

LINE = re.compile(r"const float (t\d+) = (.*);")
READ = re.compile(r"\b([A-Za-z_]\w*)\[([^\[\]]*)\]")
TEMP = re.compile(r"\bt\d+\b")
WORD = re.compile(r"[A-Za-z_]\w*")
LANE = re.compile(r"\bvj\b")
PER_LANE = re.compile(r"\b(vj|e)\b")
"""Names that differ between lanes: the lane, and the flat element index e = ev * width + vj."""
ITEMSIZE = {"__half": 2, "__nv_bfloat16": 2, "float": 4}
WIDE_BYTES = (4, 8, 16)
"""Vector accesses the hardware does in one instruction (shared memory, aligned)."""


@dataclass
class LanePlan:
    """Statements before the lane loop (per vector) and inside it (per lane)."""

    pre: list[str] = field(default_factory=list)
    lane: list[str] = field(default_factory=list)
    wide_loads: int = 0
    """Reads turned into one wide load per vector."""


Space = int | Mapping[str, int]
"""The vectors a pass walks: a count of flat vectors `ev`, or named index variables and their
extents (a row reduction's output `o` and vector `rv` along the row), every combination taken."""


def _grid(space: Space) -> dict[str, np.ndarray]:
    dims = {"ev": space} if isinstance(space, int) else dict(space)
    axes = np.meshgrid(*(np.arange(n, dtype=np.int64) for n in dims.values()), indexing="ij")
    return {name: a.ravel() for name, a in zip(dims, axes)}


def _values(index: str, space: Space, width: int) -> np.ndarray | None:
    """index evaluated for every vector of `space` and lane vj < width ([width, vectors]), or
    None where it names anything else."""
    grid = _grid(space)
    if not set(WORD.findall(index)) <= {*grid, "vj"}:
        return None
    py = index.replace(" / ", " // ")
    if "/" in py.replace("//", ""):
        return None
    shape = next(iter(grid.values())).shape
    try:
        rows = [
            np.broadcast_to(eval(py, {"__builtins__": {}}, {**grid, "vj": j}), shape)  # noqa: S307
            for j in range(width)
        ]
    except Exception:  # an expression this evaluator does not model: leave it alone
        return None
    return np.stack(rows)


def classify(index: str, space: Space, width: int) -> str:
    """'invariant', 'contiguous' (lane j reads i0 + j, i0 a multiple of width) or 'other'."""
    v = _values(index, space, width)
    if v is None:
        return "other"
    if (v == v[0]).all():
        return "invariant"
    lanes = np.arange(width, dtype=np.int64)[:, None]
    if (v == v[0] + lanes).all() and (v[0] % width == 0).all():
        return "contiguous"
    return "other"


def _wide(ctype: str | None, width: int) -> bool:
    return ctype in ITEMSIZE and ITEMSIZE[ctype] * width in WIDE_BYTES


def plan_lane(
    lines: Sequence[str], space: Space, width: int, ctypes: Mapping[str, str]
) -> LanePlan:
    """Split one lane's statements into per-vector and per-lane ones (see the module doc).
    `ctypes` maps shared-memory buffer names (128-byte aligned) to their C element types."""
    plan = LanePlan()
    parsed = [LINE.fullmatch(s) for s in lines]
    if not all(parsed):
        plan.lane = list(lines)
        return plan
    invariant: set[str] = set()
    loads: dict[tuple[str, str], str] = {}
    for m in parsed:
        name, expr = m.group(1), m.group(2)
        kinds = [(r, classify(r.group(2), space, width)) for r in READ.finditer(expr)]
        rest = READ.sub("", expr)
        if (
            all(k == "invariant" for _, k in kinds)
            and not PER_LANE.search(rest)
            and set(TEMP.findall(rest)) <= invariant
        ):
            invariant.add(name)
            plan.pre.append(f"const float {name} = {LANE.sub('0', expr)};")
            continue
        out = expr
        for r, kind in kinds:
            buf, index = r.group(1), r.group(2)
            if kind == "invariant":
                out = out.replace(r.group(0), f"{buf}[{LANE.sub('0', index)}]")
            elif kind == "contiguous" and _wide(ctypes.get(buf), width):
                key = (buf, index)
                if key not in loads:
                    loads[key] = f"v{name}"
                    plan.wide_loads += 1
                    ct = ctypes[buf]
                    plan.pre.append(
                        f"const mlso::vec<{ct}, {width}> {loads[key]} = "
                        f"*reinterpret_cast<const mlso::vec<{ct}, {width}>*>(&{buf}[{LANE.sub('0', index)}]);"
                    )
                out = out.replace(r.group(0), f"{loads[key]}.v[vj]")
        plan.lane.append(f"const float {name} = {out};")
    return plan


def wide_store(
    dest: str, space: Space, width: int, ctypes: Mapping[str, str]
) -> tuple[str, str] | None:
    """(buffer's C type, first lane's dest) when `dest` is a contiguous, aligned vector of a
    buffer that takes one wide store; else None."""
    m = READ.fullmatch(dest)
    if m is None or not _wide(ctypes.get(m.group(1)), width):
        return None
    if classify(m.group(2), space, width) != "contiguous":
        return None
    return ctypes[m.group(1)], f"{m.group(1)}[{LANE.sub('0', m.group(2))}]"
