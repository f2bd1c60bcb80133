"""CUDA C++ text helpers: storage types, fp32 literals, index expressions, an indented writer.

Why index expressions are plain strings built only from coordinate tokens (never temporaries):
the scale analysis (scale.py) compares the coordinates of running-max tensors as strings and asks
whether they mention a loop variable; that is sound only while every coordinate is an expression
over the kernel's tokens, valid wherever those tokens are in scope.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from fractions import Fraction

import numpy as np

from mlso_cli.ir.ops import DType

CTYPE: dict[DType, str] = {DType.F16: "__half", DType.BF16: "__nv_bfloat16", DType.F32: "float"}
"""C storage type of each IR dtype (block compute is always fp32 registers)."""

Coords = tuple[str, ...]

XYZ = ("x", "y", "z")
"""blockIdx's axes, in grid order."""


def c_bool(b: bool) -> str:
    return "true" if b else "false"


def c_float(x: float | int | Fraction) -> str:
    """An fp32 literal that parses to exactly float32(x) (shortest round-tripping digits)."""
    f = np.float32(float(x))
    if math.isnan(f):
        return "__int_as_float(0x7fc00000)"
    if math.isinf(f):
        return "mlso::pos_inf()" if f > 0 else "mlso::neg_inf()"
    text = np.format_float_scientific(f, unique=True, trim="-")
    mant, exp = text.split("e")
    if "." not in mant:
        mant += ".0"
    e = int(exp)
    return f"{mant}f" if e == 0 else f"{mant}e{e}f"


def contiguous(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides, in elements."""
    out = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        out[i] = out[i + 1] * shape[i + 1]
    return tuple(out)


def numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def canon(shape: Sequence[int], coords: Sequence[str]) -> Coords:
    """Coordinates with "0" for every size-1 dim, so equal positions print equally."""
    assert len(shape) == len(coords), (shape, coords)
    return tuple("0" if d == 1 else c for d, c in zip(shape, coords))


def paren(e: str) -> str:
    return e if re.fullmatch(r"[A-Za-z_][A-Za-z_0-9.]*|\d+", e) else f"({e})"


def cdiv(e: str, d: int) -> str:
    if d == 1 or e == "0":
        return e
    return f"({paren(e)} / {d})"


def cmod(e: str, d: int) -> str:
    return f"({paren(e)} % {d})"


def decompose(flat: str, shape: Sequence[int]) -> Coords:
    """Coordinates of a row-major flat index `flat` (0 <= flat < numel) over `shape`."""
    st = contiguous(shape)
    nontrivial = [i for i, d in enumerate(shape) if d != 1]
    out = []
    for i, (d, s) in enumerate(zip(shape, st)):
        if d == 1:
            out.append("0")
            continue
        outer = i == nontrivial[0]
        e = flat if s == 1 else f"({paren(flat)} / {s})"
        out.append(e if outer else cmod(e, d))
    return tuple(out)


def offset(coords: Sequence[str], strides: Sequence[int], base: int = 0) -> str:
    """sum(coord * stride) + base, skipping zero strides and "0" coordinates."""
    terms = []
    for c, s in zip(coords, strides):
        if c == "0" or s == 0:
            continue
        terms.append(c if s == 1 else f"{paren(c)} * {s}")
    if base:
        terms.append(str(base))
    return " + ".join(terms) if terms else "0"


def bcast(src_shape: Sequence[int], out_coords: Sequence[str]) -> Coords:
    """Coordinates of a numpy-broadcast operand of shape src_shape at output coords."""
    lead = len(out_coords) - len(src_shape)
    assert lead >= 0, (src_shape, out_coords)
    return tuple("0" if d == 1 else out_coords[lead + i] for i, d in enumerate(src_shape))


def mentions(expr: str, token: str) -> bool:
    return re.search(rf"\b{re.escape(token)}\b", expr) is not None


class Names:
    """Fresh C identifiers, unique within one kernel."""

    def __init__(self) -> None:
        self._n: dict[str, int] = {}

    def new(self, prefix: str) -> str:
        k = self._n.get(prefix, 0)
        self._n[prefix] = k + 1
        return f"{prefix}{k}"

    def counts(self) -> tuple[tuple[str, int], ...]:
        """The identifiers taken so far: (prefix, how many), in first-use order."""
        return tuple(self._n.items())

    @classmethod
    def after(cls, counts: tuple[tuple[str, int], ...]) -> Names:
        """Fresh identifiers that continue after `counts` (Names.counts of another)."""
        out = cls()
        out._n = dict(counts)
        return out


class Code:
    """Lines of C++ with indentation handled by `block` context managers."""

    def __init__(self, indent: int = 0) -> None:
        self.lines: list[str] = []
        self.ind = indent

    def __call__(self, *lines: str) -> None:
        for s in lines:
            self.lines.append(("  " * self.ind + s) if s else "")

    def extend(self, lines: Sequence[str]) -> None:
        self(*lines)

    @contextmanager
    def block(self, head: str) -> Iterator[None]:
        self(f"{head} {{" if head else "{")
        self.ind += 1
        try:
            yield
        finally:
            self.ind -= 1
            self("}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"
