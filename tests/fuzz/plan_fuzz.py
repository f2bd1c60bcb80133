"""Differential fuzzing of the two plan validators: runtime/plan.py (what runtime/check.py runs)
against csrc/mlso_json.h + csrc/mlso_plan.h (what the C++ op runs), plus csrc/mlso_sha256.h.

Why: every packaged MlsoKernel node carries an untrusted plan that the op parses with our own
JSON reader and checks with our own validator. A crafted table (tests/data/plan_cases.json)
pins the rules; this looks for what the table missed: inputs on which the C++ side crashes,
hangs, leaks or trips a sanitizer, or on which the two validators give a different verdict,
reason key or message (then one of them lets through what the other refuses, and the Python
check is no longer a faithful preview of the op's).

How: Atheris (libFuzzer for Python) drives the search. An input is one mode byte (how the node's
declared inputs, outputs and kernels are derived, see `context_for`) and the plan text. A
structure-aware mutator edits plans taken from the crafted table and from real codegen plans:
JSON-level edits (boundary integers, huge numbers, NaN/inf, floats for integers, wrong types,
unknown, renamed and duplicate keys, deep nesting, \\u escapes and surrogates) and byte-level
ones (truncation, stray and invalid UTF-8 bytes, BOMs, trailing text, libFuzzer's own byte
mutations). Every input is judged by the Python validator at once and queued; each batch goes
to tests/fuzz/plan_fuzz_driver.cc, built with g++ -fsanitize=address,undefined, one process per
batch, which prints one verdict line per input.

Coverage feedback sees the Python side only: CI has g++ but no clang, so the C++ code carries
no libFuzzer instrumentation. Atheris steers towards inputs that reach new branches of
plan.py's rules; the C++ side gets the same inputs, which cover its rules as the two are
written in the same order, and the sanitizers catch memory errors on paths the Python coverage
does not tell apart (e.g. the JSON reader's escape and number handling).

    python -m tests.fuzz.plan_fuzz --runs 100000 --seed 7 --out build/plan-fuzz
    python -m tests.fuzz.plan_fuzz --replay build/plan-fuzz/finding-0.json

A finding is written as <out>/finding-<n>.json, in the format of plan_regressions.jsonl (one
case per line, run on every `make test`): add it there once fixed.
"""

from __future__ import annotations

import argparse
import base64
import copy
import hashlib
import json
import os
import random
import re
import shutil
import struct
import subprocess
import sys
import time
import types
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlso_cli.runtime import plan as plan_module
from mlso_cli.runtime.plan import DTYPE_ITEMSIZE, ONNX_DTYPE, PlanProblem, parse_plan, plan_json

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
CSRC = ROOT / "mlso_cli" / "runtime" / "csrc"
DRIVER_SRC = HERE / "plan_fuzz_driver.cc"
REGRESSIONS = HERE / "plan_regressions.jsonl"
CXXFLAGS = (
    "-std=c++17",
    "-g",
    "-O1",
    "-fsanitize=address,undefined,float-cast-overflow",
    "-fno-sanitize-recover=all",
    "-fno-omit-frame-pointer",
    "-D_GLIBCXX_ASSERTIONS",
    "-Wall",
)
SANITIZER_ENV = {
    "ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0:halt_on_error=1",
    "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
}
UNKNOWN_DTYPE = "onnx-dtype-13"
"""A declared dtype no plan dtype equals (ONNX uint64); the C++ side names it the same way."""
NO_MESSAGE_COMPARE = frozenset({"ok", "json"})
"""Reason keys whose messages differ by design (JSON error texts come from different parsers)."""


# ---- one input: the plan text and what the node around it declares ----------------------------

DeclaredType = tuple[str | None, list[int | None] | None]


@dataclass
class Context:
    """The node a plan is checked against. None: not checked (as the op's self-test does).
    Declared inputs and outputs are checked together or not at all, as both validators do."""

    n_inputs: int | None = None
    n_outputs: int | None = None
    declared_inputs: list[DeclaredType | None] | None = None
    declared_outputs: list[DeclaredType | None] | None = None
    kernels: list[str] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "n_inputs": self.n_inputs,
            "n_outputs": self.n_outputs,
            "declared_inputs": self.declared_inputs,
            "declared_outputs": self.declared_outputs,
            "kernels": self.kernels,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Context:
        def decl(v: Any) -> list[DeclaredType | None] | None:
            if v is None:
                return None
            return [None if e is None else (e[0], e[1]) for e in v]

        return cls(
            d.get("n_inputs"),
            d.get("n_outputs"),
            decl(d.get("declared_inputs")),
            decl(d.get("declared_outputs")),
            d.get("kernels"),
        )


def _dtype_code(name: str | None) -> int:
    if name is None:
        return 0
    if name in ONNX_DTYPE:
        return ONNX_DTYPE[name]
    m = re.fullmatch(r"onnx-dtype-([0-9]+)", name)
    if not m:
        raise ValueError(f"declared dtype {name!r} has no ONNX code")
    return int(m.group(1))


def encode(text: bytes, ctx: Context) -> bytes:
    """One record of the C++ driver's input (the layout is in plan_fuzz_driver.cc)."""
    if (ctx.declared_inputs is None) != (ctx.declared_outputs is None):
        raise ValueError("declared inputs and outputs are checked together")
    parts = [struct.pack("<I", len(text)), text]
    parts.append(
        struct.pack(
            "<qq",
            -1 if ctx.n_inputs is None else ctx.n_inputs,
            -1 if ctx.n_outputs is None else ctx.n_outputs,
        )
    )
    for decl in (ctx.declared_inputs, ctx.declared_outputs):
        if decl is None:
            parts.append(struct.pack("<i", -1))
            continue
        parts.append(struct.pack("<i", len(decl)))
        for d in decl:
            dtype, dims = (None, None) if d is None else d
            parts.append(struct.pack("<ii", _dtype_code(dtype), -1 if dims is None else len(dims)))
            parts.extend(struct.pack("<q", -1 if x is None else x) for x in dims or ())
    if ctx.kernels is None:
        parts.append(struct.pack("<i", -1))
    else:
        parts.append(struct.pack("<i", len(ctx.kernels)))
        for k in ctx.kernels:
            kb = k.encode("utf-8", "surrogatepass")
            parts += [struct.pack("<I", len(kb)), kb]
    return b"".join(parts)


def python_verdict(text: bytes, ctx: Context) -> tuple[str, str]:
    """(reason key or "ok", message) from the Python validator, reading the bytes as check.py
    reads the attribute (strict UTF-8). An exception other than PlanProblem is a finding."""
    try:
        s = text.decode("utf-8")
    except UnicodeDecodeError as e:
        return "json", f"is not valid JSON (not UTF-8: {e})"
    try:
        parse_plan(
            s,
            ctx.n_inputs,
            ctx.n_outputs,
            declared_inputs=ctx.declared_inputs,
            declared_outputs=ctx.declared_outputs,
            kernels=ctx.kernels,
        )
    except PlanProblem as e:
        return e.code, str(e)
    except Exception as e:  # noqa: BLE001 - the Python validator crashing is what we look for
        return "python_crash", f"{type(e).__name__}: {e}"
    return "ok", ""


def escape(raw: bytes) -> str:
    """The C++ driver's escaping of a message (printable ASCII kept, other bytes as \\xNN)."""
    return "".join(chr(b) if 0x20 <= b < 0x7F and b != 0x5C else f"\\x{b:02x}" for b in raw)


# ---- the C++ driver ----------------------------------------------------------------------------


def build_driver(out_dir: Path) -> Path:
    """Compile plan_fuzz_driver.cc with ASan and UBSan into out_dir; return the executable."""
    if not shutil.which("g++"):
        raise RuntimeError("g++ is needed to build the C++ fuzz driver")
    out_dir.mkdir(parents=True, exist_ok=True)
    exe = out_dir / "plan_fuzz_driver"
    cmd = ["g++", *CXXFLAGS, f"-I{CSRC}", str(DRIVER_SRC), "-o", str(exe)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"building the fuzz driver failed:\n{proc.stderr[-4000:]}")
    return exe


@dataclass
class DriverRun:
    verdicts: list[tuple[str, str, str]]
    """(reason key, SHA-256 of the text, escaped message), one per record it finished."""
    returncode: int | None
    stderr: str
    timed_out: bool

    @property
    def clean(self) -> bool:
        return self.returncode == 0 and not self.stderr.strip() and not self.timed_out


def run_driver(exe: Path, payload: bytes, timeout: float) -> DriverRun:
    env = {**os.environ, **SANITIZER_ENV}
    proc = subprocess.Popen(
        [str(exe), "-"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    timed_out = False
    try:
        out, err = proc.communicate(payload, timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        proc.kill()
        out, err = proc.communicate()
    verdicts = []
    for line in out.decode("ascii", "replace").splitlines():
        parts = line.split("\t", 2)
        if len(parts) == 3:
            verdicts.append((parts[0], parts[1], parts[2]))
    return DriverRun(verdicts, proc.returncode, err.decode("utf-8", "replace"), timed_out)


# ---- checking a batch --------------------------------------------------------------------------


@dataclass
class Item:
    text: bytes
    ctx: Context
    python: tuple[str, str] = ("", "")

    def judged(self) -> Item:
        self.python = python_verdict(self.text, self.ctx)
        return self


@dataclass
class Finding:
    kind: str
    """reason (different keys), message, sha256, crash, hang, python_crash or expected."""
    item: Item
    cpp: tuple[str, str] = ("", "")
    detail: str = ""

    def as_json(self, name: str) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "python": list(self.item.python),
            "cpp": list(self.cpp),
            "detail": self.detail[-6000:],
            "case": as_case(name, self.item.text, self.item.ctx, self.item.python[0], ""),
        }


def as_case(name: str, text: bytes, ctx: Context, reason: str, found: str) -> dict[str, Any]:
    """An input in the format of plan_regressions.jsonl."""
    case: dict[str, Any] = {"name": name, "found": found, "reason": reason}
    try:
        case["text"] = text.decode("utf-8")
    except UnicodeDecodeError:
        case["text_b64"] = base64.b64encode(text).decode("ascii")
    case.update(ctx.to_json())
    return case


def case_item(case: dict[str, Any]) -> Item:
    text = (
        case["text"].encode("utf-8", "surrogatepass")
        if "text" in case
        else base64.b64decode(case["text_b64"])
    )
    return Item(text, Context.from_json(case)).judged()


def compare(item: Item, verdict: tuple[str, str, str]) -> Finding | None:
    code, sha, msg = verdict
    py_code, py_msg = item.python
    if py_code == "python_crash":
        return Finding("python_crash", item, (code, msg), py_msg)
    if sha != hashlib.sha256(item.text).hexdigest():
        return Finding("sha256", item, (code, msg), f"C++ hashed the text to {sha}")
    if code != py_code:
        return Finding("reason", item, (code, msg))
    if code not in NO_MESSAGE_COMPARE and msg != escape(py_msg.encode("utf-8", "surrogatepass")):
        return Finding("message", item, (code, msg))
    return None


def check_items(exe: Path, items: list[Item], timeout: float = 120.0) -> list[Finding]:
    """Run items through the C++ driver in one process; every disagreement, and the input of a
    crash, hang or sanitizer report (isolated by re-running one input at a time if needed)."""
    if not items:
        return []
    run = run_driver(exe, b"".join(encode(it.text, it.ctx) for it in items), timeout)
    findings = [f for it, v in zip(items, run.verdicts) if (f := compare(it, v)) is not None]
    if run.clean and len(run.verdicts) == len(items):
        return findings
    done = len(run.verdicts)
    if done < len(items):
        kind = "hang" if run.timed_out else "crash"
        findings.append(Finding(kind, items[done], detail=run.stderr))
        return findings
    for it in items:  # every verdict came, then the process failed: a leak report at exit
        single = run_driver(exe, encode(it.text, it.ctx), timeout)
        if not single.clean:
            findings.append(Finding("crash", it, detail=single.stderr))
            return findings
    findings.append(
        Finding("crash", items[-1], detail="only the whole batch fails:\n" + run.stderr)
    )
    return findings


def write_findings(findings: Iterable[Finding], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for f in findings:
        n = len(list(out_dir.glob("finding-*.json")))
        path = out_dir / f"finding-{n}.json"
        path.write_text(json.dumps(f.as_json(f"fuzz_{f.kind}_{n}"), indent=1) + "\n")
        print(
            f"plan fuzz: {f.kind}: python {f.item.python[0]!r}, C++ {f.cpp[0]!r}; "
            f"input written to {path}",
            flush=True,
        )
        paths.append(path)
    return paths


def load_regressions(path: Path = REGRESSIONS) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def check_regressions(exe: Path, cases: list[dict[str, Any]]) -> list[Finding]:
    """Both validators on every regression case: they agree, and give the recorded reason."""
    items = [case_item(c) for c in cases]
    findings = check_items(exe, items)
    for case, it in zip(cases, items):
        if it.python[0] != case["reason"]:
            findings.append(Finding("expected", it, detail=f"recorded reason {case['reason']!r}"))
    return findings


# ---- seeds and the node context ----------------------------------------------------------------

_BASE_INPUTS: list[DeclaredType | None] = [("float16", [2, 256, 64]), ("float32", [64])]
_BASE_OUTPUTS: list[DeclaredType | None] = [("float32", [2, 256, 64])]
_BASE_KERNELS = ["mlso_k0", "mlso_k1"]


def seed_plans() -> list[tuple[str, bytes]]:
    """Every plan of the crafted table, then a real plan from codegen for every small fixture."""
    from mlso_cli.codegen import generate
    from tests.fixtures.ugraphs import SMALL_FIXTURES
    from tests.test_plan_validator import TABLE, case_text

    seeds = [(c["name"], case_text(c).encode("utf-8")) for c in TABLE["cases"]]
    for name, make in sorted(SMALL_FIXTURES.items()):
        seeds.append((f"codegen_{name}", plan_json(generate(make()).plan).encode("utf-8")))
    return seeds


def _loose(text: bytes) -> Any:
    try:
        return json.loads(text.decode("utf-8", "replace"))
    except Exception:  # noqa: BLE001 - any failure means "no structure to borrow"
        return None


def _own_types(plan: Any, key: str) -> list[DeclaredType | None] | None:
    items = plan.get(key) if isinstance(plan, dict) else None
    if not isinstance(items, list) or not items or len(items) > 64:
        return None
    out: list[DeclaredType | None] = []
    for t in items:
        if not isinstance(t, dict):
            out.append((None, None))
            continue
        dtype = t.get("dtype")
        dtype = dtype if isinstance(dtype, str) and dtype in DTYPE_ITEMSIZE else None
        shape = t.get("shape")
        dims: list[int | None] | None = None
        if isinstance(shape, list) and len(shape) <= 64:
            dims = [
                d if isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**62 else None
                for d in shape
            ]
        out.append((dtype, dims))
    return out


def _own_kernels(plan: Any) -> list[str]:
    launches = plan.get("launches") if isinstance(plan, dict) else None
    names = []
    for launch in launches if isinstance(launches, list) else []:
        k = launch.get("kernel") if isinstance(launch, dict) else None
        if isinstance(k, str) and not any(0xD800 <= ord(c) <= 0xDFFF for c in k):
            names.append(k)
    return names


def context_for(mode: int, text: bytes) -> Context:
    """The node a fuzz input is checked against, from its mode byte: the low 3 bits pick a
    variant, the rest seed its choices. The node is built from the plan's own types (read
    leniently), so most inputs get past the count and declared checks to the later rules."""
    variant, rng = mode & 7, random.Random(mode)
    if variant == 0:
        return Context()
    plan = _loose(text)
    ins = _own_types(plan, "inputs") or copy.deepcopy(_BASE_INPUTS)
    outs = _own_types(plan, "outputs") or copy.deepcopy(_BASE_OUTPUTS)
    kernels = _own_kernels(plan) or list(_BASE_KERNELS)
    if variant == 1:
        return Context(len(ins), len(outs))
    if variant == 3:  # unknown parts are not compared
        for lst in (ins, outs):
            for j, d in enumerate(lst):
                r = rng.randrange(4)
                if d is None or r == 0:
                    continue
                dtype, dims = d
                if r == 1:
                    lst[j] = None
                elif r == 2:
                    lst[j] = (None, dims)
                else:
                    lst[j] = (
                        dtype,
                        None
                        if dims is None or rng.random() < 0.5
                        else [None if rng.random() < 0.5 else x for x in dims],
                    )
    elif variant == 4:  # one declared dim or rank differs
        lst = ins if rng.random() < 0.5 else outs
        j = rng.randrange(len(lst))
        dtype, dims = lst[j] or (None, None)
        if not dims:
            dims = [1]
        else:
            dims = list(dims)
            k = rng.randrange(len(dims))
            dims[k] = (dims[k] or 0) + 1 if rng.random() < 0.8 else None
            if rng.random() < 0.3:
                dims.append(1)
        lst[j] = (dtype, dims)
    elif variant == 5:  # one declared dtype differs
        lst = ins if rng.random() < 0.5 else outs
        j = rng.randrange(len(lst))
        _, dims = lst[j] or (None, None)
        lst[j] = (rng.choice([*DTYPE_ITEMSIZE, UNKNOWN_DTYPE]), dims)
    elif variant == 6:  # the node has another number of tensors than the plan
        r = rng.randrange(4)
        if r == 0:
            ins.append(("float32", [1]))
            return Context(len(ins), len(outs), ins, outs, kernels)
        if r == 1:
            outs.pop()
            return Context(len(ins), len(outs), ins, outs, kernels)
        n_in, n_out = len(ins), len(outs)
        (ins if r == 2 else outs).append(("float32", [2]))
        return Context(n_in, n_out, ins, outs, kernels)
    elif variant == 7:  # a kernel is missing from the binary
        r = rng.randrange(3)
        if r == 0:
            kernels.pop(rng.randrange(len(kernels)))
        elif r == 1:
            kernels = []
        else:
            kernels = [k + "_" for k in kernels]
    return Context(len(ins), len(outs), ins, outs, kernels)


def item_from_data(data: bytes) -> Item:
    mode, text = (data[0], data[1:]) if data else (2, b"")
    return Item(text, context_for(mode, text)).judged()


# ---- the mutator -------------------------------------------------------------------------------


class Obj(list):
    """A JSON object as its (key, value) pairs: order and duplicate keys survive a round trip."""


class Raw(str):
    """A token written exactly as given: numbers keep their lexeme (huge, -0, 1e999, NaN, 01)."""


KEYS = [
    "version", "targets", "smem_max", "inputs", "outputs", "scratch", "zero", "launches",
    "dtype", "shape", "bytes", "kind", "index", "kernel", "grid", "block", "smem", "args",
]  # fmt: skip
NEAR_KEYS = ["Version", "version ", " version", "version\n", "version\u0000", "versión",
             "verſion", "entry", "stream", "offset", "", "\u0000", "\ufeffversion", "\ud800",
             "version\udc00", "ver\tsion"]  # fmt: skip
STRINGS = [
    *DTYPE_ITEMSIZE, "float8", "Float32", "float32\n", "float32\u0000", "int4", "",
    "input", "output", "scratch", "inputs", "Input", "output\n", "weights",
    "sm_90a", "sm_80", "compute_90", "sm_", "sm_9x!", "sm_90ab", "SM_90", "sm_90a\n",
    "sm_90\u0000", "sm_\uff19\uff10", "compute_", "sm_1a", "volta",
    "mlso_k0", "mlso_k1", "mlso_k9", "_", "k" * 1024, "k" * 1025, "0k", "k\n", "mlso_k0\u0000x",
    "mlso k0", "mlso-k0", "\u00e9", "\u212a", "\ud800", "\udc00", "\ud83d\ude00", "\u2028",
    "\u0085", "\ufeff", "\\", '"', "\u001f", "\u007f", "a/b\tc\rd\fe\bf\n",
]  # fmt: skip
INTS = [
    0, 1, 2, 3, 4, 7, 15, 16, 17, 63, 64, 65, 255, 256, 1023, 1024, 1025, 4096, 49152, 65535,
    65536, 232447, 232448, 232449, 2**31 - 1, 2**31, 2**32, 2**34, 2**40 - 1, 2**40, 2**40 + 1,
    2**41, 16 * 2**30, 16 * 2**30 + 1, 2**62, 2**63 - 1, 2**63, 2**64, 10**30,
]  # fmt: skip
LEXEMES = [
    "-0", "0.0", "-0.0", "1.0", "1e0", "1E2", "10e-1", "1e999", "-1e999", "1e-999", "0.5", "4e3",
    "1099511627776.0", "1.5e1", "NaN", "Infinity", "-Infinity", "nan", "inf", "01", "00", "1.",
    ".5", "+1", "0x10", "1e", "1e+", "--1", "-", "1_0", "\u0661", "9" * 19, "9" * 20, "-" + "9" * 19,
    "-9223372036854775808", "-9223372036854775809", "9223372036854775807", "9223372036854775808",
    "18446744073709551616", "1" * 4301, "1" * 5000, "1" + "0" * 400, "1e" + "9" * 30, "true",
    "false", "null", "tru", "nul", "True", "None",
]  # fmt: skip
TOKENS = [
    b'"', b"\\", b"{", b"}", b"[", b"]", b",", b":", b"0", b"-", b"e", b".", b"\x00", b"\x1f",
    b"\x7f", b"\x80", b"\xbf", b"\xc0\xaf", b"\xc2", b"\xc2\xa0", b"\xe2\x82", b"\xe2\x82\xac",
    b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xef\xbb\xbf", b"\xf0\x9f\x98\x80", b"\xf4\x90\x80\x80",
    b"\xf5", b"\xff", b" ", b"\t", b"\n", b"\r", b"\x0b", b"\x0c", b"\\u", b"\\ud800",
    b"\\udc00", b"\\ud800\\udc00", b"\\ud800\\u0041", b"\\u0000", b"\\uD83D\\uDE00", b"\\x41",
    b"\\'", b"\\/", b"\\U0041", b"\\u12", b"\\u12g4", b"NaN", b"1e999", b"-", b"\\b", b"\\f",
    b"\\r", b"\\t", b"\\n", b'\\"', b"\\\\", b"\\ud800\\udbff", b"\\udbff\\udfff",
]  # fmt: skip
NUMBER = re.compile(rb"-?[0-9]+(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


def parse_tree(text: bytes) -> Any:
    """The text as a mutable tree (Obj, list, Raw, str, bool, None), or None if it is not JSON."""
    try:
        return json.loads(
            text.decode("utf-8"),
            object_pairs_hook=Obj,
            parse_int=Raw,
            parse_float=Raw,
            parse_constant=Raw,
        )
    except Exception:  # noqa: BLE001 - not JSON (or too deep): mutate the bytes instead
        return None


@dataclass
class Style:
    """How a tree is written back: separators, and how strings are escaped."""

    item_sep: str = ","
    key_sep: str = ":"
    ascii_only: bool = True
    escape_p: float = 0.0
    upper_hex: bool = False

    @classmethod
    def pick(cls, rng: random.Random) -> Style:
        if rng.random() < 0.6:
            return cls()
        ws = ["", " ", "\n", "\t", "\r\n  ", " \n\t\r"]
        return cls(
            rng.choice(ws) + "," + rng.choice(ws),
            rng.choice(ws) + ":" + rng.choice(ws),
            rng.random() < 0.5,
            rng.choice([0.0, 0.0, 0.05, 0.3, 1.0]),
            rng.random() < 0.5,
        )


def _u(o: int, style: Style) -> str:
    h = f"{o:04X}" if style.upper_hex else f"{o:04x}"
    return "\\u" + h


_SHORT = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f"}


def dump_str(s: str, rng: random.Random, style: Style) -> str:
    out = ['"']
    for ch in s:
        o = ord(ch)
        if ch in _SHORT and not (style.escape_p and rng.random() < style.escape_p):
            out.append(_SHORT[ch])
        elif o < 0x20 or 0xD800 <= o <= 0xDFFF or ch in _SHORT:
            out.append(_u(o, style))
        elif (o >= 0x80 and style.ascii_only) or (style.escape_p and rng.random() < style.escape_p):
            if o > 0xFFFF:
                o -= 0x10000
                out.append(_u(0xD800 + (o >> 10), style) + _u(0xDC00 + (o & 0x3FF), style))
            elif ch == "/" and rng.random() < 0.5:
                out.append("\\/")
            else:
                out.append(_u(o, style))
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def dump(v: Any, rng: random.Random, style: Style) -> str:
    if isinstance(v, Raw):
        return str(v)
    if isinstance(v, str):
        return dump_str(v, rng, style)
    if v is True:
        return "true"
    if v is False:
        return "false"
    if v is None:
        return "null"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, Obj):
        return (
            "{"
            + style.item_sep.join(
                dump_str(k, rng, style) + style.key_sep + dump(c, rng, style) for k, c in v
            )
            + "}"
        )
    return "[" + style.item_sep.join(dump(c, rng, style) for c in v) + "]"


def to_bytes(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def _positions(v: Any, out: list[tuple[list, int, int]], depth: int = 0) -> None:
    """Every (container, index, depth of the value there) of a tree, the root excluded."""
    if depth > 80 or len(out) > 4000:
        return
    if isinstance(v, list):  # Obj too
        for i, c in enumerate(v):
            out.append((v, i, depth + 1))
            _positions(c[1] if isinstance(v, Obj) else c, out, depth + 1)


def _get(parent: list, i: int) -> Any:
    return parent[i][1] if isinstance(parent, Obj) else parent[i]


def _set(parent: list, i: int, value: Any) -> None:
    if isinstance(parent, Obj):
        parent[i] = (parent[i][0], value)
    else:
        parent[i] = value


def _nest(v: Any, depth: int, rng: random.Random) -> Any:
    for _ in range(depth):
        v = Obj([("a", v)]) if rng.random() < 0.5 else [v]
    return v


def interesting(rng: random.Random, key: str | None = None) -> Any:
    """A value likely to sit on a rule's boundary, biased by the field it goes into."""
    r = rng.random()
    if key in ("shape", "grid", "block") and r < 0.5:
        n = rng.choice([0, 1, 2, 3, 3, 3, 4, 16, 17])
        return [
            rng.choice(INTS) if rng.random() < 0.3 else rng.choice([1, 2, 64]) for _ in range(n)
        ]
    if key in ("dtype", "kind", "kernel", "targets") and r < 0.5:
        s = rng.choice(STRINGS)
        return [s] if key == "targets" else s
    if key in ("args", "zero") and r < 0.5:
        return [Obj([("kind", rng.choice(["input", "output", "scratch"])),
                     ("index", rng.choice([0, 1, 2, -1]))]) for _ in range(rng.randrange(4))]  # fmt: skip
    if r < 0.35:
        v = rng.choice(INTS)
        return -v if rng.random() < 0.15 else v
    if r < 0.55:
        return Raw(rng.choice(LEXEMES))
    if r < 0.75:
        return rng.choice(STRINGS)
    return rng.choice([True, False, None, [], Obj(), [1, 1, 1], [1], Obj([("bytes", 4)])])


def valid_value(rng: random.Random, key: str | None) -> Any:
    """A value the field accepts (on its own), so that edits also make plans that pass and
    plans that reach the later rules; None for a field without one."""
    if key in ("smem", "smem_max"):
        return rng.choice([0, 1, 49152, 232448, rng.randrange(232449)])
    if key == "grid":
        return [rng.choice([1, 2**31 - 1, rng.randrange(1, 2**31)]),
                rng.choice([1, 65535, rng.randrange(1, 65536)]), rng.choice([1, 65535])]  # fmt: skip
    if key == "block":
        x = rng.choice([1, 32, 128, 256, 1024, rng.randrange(1, 1025)])
        y = rng.randrange(1, 1024 // x + 1)
        return [x, y, rng.randrange(1, min(64, 1024 // (x * y)) + 1)]
    if key == "shape":
        return [rng.choice([0, 1, 2, 64, 256, 2**20]) for _ in range(rng.choice([0, 1, 2, 3, 16]))]
    if key == "dtype":
        return rng.choice(list(DTYPE_ITEMSIZE))
    if key == "bytes":
        return rng.choice([0, 4, 4096, 2**40, rng.randrange(2**20)])
    if key == "index":
        return rng.choice([0, 0, 1, 2])
    if key == "kind":
        return rng.choice(["input", "output", "scratch"])
    if key == "kernel":
        return rng.choice(["mlso_k0", "mlso_k1", "_", "K" * 1024, "mlso_k0_"])
    if key == "targets":
        return [rng.choice(["sm_80", "sm_90a", "compute_90", "sm_1000z"]) for _ in range(3)][
            : rng.randrange(1, 4)
        ]
    if key == "version":
        return 1
    return None


def mutate_tree(root: Any, rng: random.Random, donors: list[bytes]) -> Any:
    """One structural edit of a parsed plan."""
    pos: list[tuple[list, int, int]] = []
    _positions(root, pos)
    if not pos or rng.random() < 0.03:
        return (
            _nest(root, rng.choice([1, 63, 64, 65]), rng)
            if rng.random() < 0.5
            else interesting(rng)
        )
    parent, i, depth = rng.choice(pos)
    key = parent[i][0] if isinstance(parent, Obj) else None
    value = _get(parent, i)
    op = rng.randrange(14)
    if op >= 12 and valid_value(rng, key) is not None:
        _set(parent, i, valid_value(rng, key))
    elif op <= 2:
        _set(parent, i, interesting(rng, key))
    elif op == 3 and isinstance(value, (Raw, int)) and not isinstance(value, bool):
        n = int(value) if re.fullmatch(r"-?[0-9]{1,30}", str(value)) else 1
        n = rng.choice([n + 1, n - 1, -n, n * 2, n * 1024, 0])
        _set(parent, i, Raw(rng.choice([str(n), f"{n}.0", f"{n}e0", f"{n}E+0"])))
    elif op == 4:
        del parent[i]
    elif op == 5 and isinstance(parent, Obj):
        parent.insert(rng.randrange(len(parent) + 1), (parent[i][0], interesting(rng, key)))
    elif op == 6 and isinstance(parent, Obj):
        parent[i] = (rng.choice(KEYS if rng.random() < 0.6 else NEAR_KEYS), value)
    elif op == 7 and isinstance(parent, Obj):
        k = rng.choice(KEYS + NEAR_KEYS)
        parent.insert(rng.randrange(len(parent) + 1), (k, interesting(rng, k)))
    elif op == 8 and not isinstance(parent, Obj):
        count = rng.choice([1, 1, 2, 13, 14, 15, 16, 64, 1025])
        parent[i + 1 : i + 1] = [copy.deepcopy(value) for _ in range(count)]
    elif op == 9:
        # Around the reader's limit (a value at depth 64 passes, at 65 fails), or far past it.
        extra = rng.choice([1, 2, 64 - depth, 65 - depth, 64 - depth, 65 - depth, 1000])
        _set(parent, i, _nest(value, max(1, extra), rng))
    elif op == 10 and donors:
        other = parse_tree(rng.choice(donors))
        opos: list[tuple[list, int, int]] = []
        _positions(other, opos)
        if opos:
            p, j, _ = rng.choice(opos)
            _set(parent, i, _get(p, j))
    elif op == 11 and len(parent) > 1:
        j = rng.randrange(len(parent))
        parent[i], parent[j] = parent[j], parent[i]
    else:
        _set(parent, i, interesting(rng, key))
    return root


def mutate_text(text: bytes, rng: random.Random) -> bytes:
    """One byte-level edit aimed at the JSON reader."""
    op = rng.randrange(10)
    n = len(text)
    at = rng.randrange(n + 1)
    if op == 0:
        return text[:at]
    if op == 1:
        return text[:at] + rng.choice(TOKENS) + text[at:]
    if op == 2:
        return text[:at] + text[at + rng.randrange(1, 9) :]
    if op == 3:
        nums = list(NUMBER.finditer(text))
        if nums:
            m = rng.choice(nums)
            return text[: m.start()] + rng.choice(LEXEMES).encode() + text[m.end() :]
    if op == 4:
        strs = list(STRING.finditer(text))
        if strs:
            m = rng.choice(strs)
            k = rng.randrange(m.start() + 1, m.end())
            return text[:k] + rng.choice(TOKENS) + text[k:]
    if op == 5:
        d = rng.choice([63, 64, 65, 66, 1000, 5000])
        if rng.random() < 0.5:
            return b"[" * d + text + b"]" * d
        return text[:at] + b"[" * d + b"]" * d + text[at:]
    if op == 6:
        return text + rng.choice([b" ", b"\n", b"x", b"{}", b",", b"\x00", b"\xef\xbb\xbf", b"]"])
    if op == 7:
        return rng.choice([b"\xef\xbb\xbf", b" \t\r\n", b"\x0c", b"\xc2\xa0", b"\x00"]) + text
    if op == 8 and n:
        b = rng.randrange(n)
        e = min(n, b + rng.randrange(1, 64))
        return text[:at] + text[b:e] + text[at:]
    return text[:at] + bytes([rng.randrange(256)]) + text[at + 1 :]


def _or_die(fn: Callable[..., bytes], *args: Any) -> bytes:
    """Runs a mutator; a bug in it ends the process at once with exit status 2. Why: libFuzzer
    does not stop on an exception raised in a custom mutator, it waits for its -timeout."""
    try:
        return fn(*args)
    except BaseException:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        print("plan fuzz: the mutator itself failed (a bug in plan_fuzz.py)", flush=True)
        sys.stderr.flush()
        os._exit(2)


class Mutator:
    """libFuzzer's custom mutator and crossover. An input is [mode byte] + plan text."""

    def __init__(self, donors: list[bytes], byte_mutate: Callable[[bytes, int], bytes] | None):
        self.donors = donors
        self.byte_mutate = byte_mutate

    def mutate(self, data: bytes, max_size: int, seed: int) -> bytes:
        return _or_die(self._mutate, data, max_size, seed)

    def crossover(self, data1: bytes, data2: bytes, max_size: int, seed: int) -> bytes:
        return _or_die(self._crossover, data1, data2, max_size, seed)

    def _mutate(self, data: bytes, max_size: int, seed: int) -> bytes:
        rng = random.Random(seed)
        mode, text = (data[0], data[1:]) if data else (2, b"")
        r = rng.random()
        if r < 0.06:
            mode = rng.randrange(256)
        elif r < 0.7:
            tree = parse_tree(text)
            if tree is None and self.donors and rng.random() < 0.7:
                tree = parse_tree(rng.choice(self.donors))  # back to valid JSON, or json wins
            try:
                for _ in range(rng.choice([1, 1, 1, 2, 3]) if tree is not None else 0):
                    tree = mutate_tree(tree, rng, self.donors)
                if tree is not None:
                    text = to_bytes(dump(tree, rng, Style.pick(rng)))
            except RecursionError:  # nested past what dump can write: edit the bytes instead
                tree = None
            if tree is None:
                text = mutate_text(text, rng)
        elif r < 0.93 or self.byte_mutate is None:
            for _ in range(rng.choice([1, 1, 2, 3])):
                text = mutate_text(text, rng)
        else:
            text = self.byte_mutate(text, max(0, max_size - 1))
        return (bytes([mode]) + text)[:max_size]

    def _crossover(self, data1: bytes, data2: bytes, max_size: int, seed: int) -> bytes:
        """A subtree of the second plan grafted into the first (bytes spliced if not JSON)."""
        rng = random.Random(seed)
        mode = data1[0] if data1 else 2
        a, b = parse_tree(data1[1:]), parse_tree(data2[1:])
        pa: list[tuple[list, int, int]] = []
        pb: list[tuple[list, int, int]] = []
        _positions(a, pa)
        _positions(b, pb)
        text = b""
        if pa and pb:
            p, i, _ = rng.choice(pa)
            q, j, _ = rng.choice(pb)
            _set(p, i, _get(q, j))
            try:
                text = to_bytes(dump(a, rng, Style()))
            except RecursionError:
                pa = []
        if not (pa and pb):
            cut1, cut2 = rng.randrange(len(data1) + 1), rng.randrange(len(data2) + 1)
            text = data1[1:cut1] + data2[cut2:]
        return (bytes([mode]) + text)[:max_size]


# ---- a campaign --------------------------------------------------------------------------------


@dataclass
class Campaign:
    """Judges each input in Python, checks them against C++ in batches, stops after `runs`
    inputs or `max_seconds`, on the first batch with a finding, and exits the process (libFuzzer
    never returns): 0 if nothing was found, 1 otherwise."""

    exe: Path
    out: Path
    runs: int
    max_seconds: float
    batch: int = 1000
    pending: list[Item] = field(default_factory=list)
    count: int = 0
    verdicts: Counter = field(default_factory=Counter)
    findings: list[Path] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    cpp_seconds: float = 0.0
    digest: Any = field(default_factory=hashlib.sha256)
    """Of every input in order: equal for two runs of one seed (what the fixed seed promises)."""

    def one_input(self, data: bytes) -> None:
        self.digest.update(hashlib.sha256(data).digest())
        item = item_from_data(data)
        self.pending.append(item)
        self.verdicts[item.python[0]] += 1
        self.count += 1
        if len(self.pending) >= self.batch:
            self.flush()
        if self.count >= self.runs or time.monotonic() - self.started > self.max_seconds:
            self.flush()
            self.finish()

    def flush(self) -> None:
        t = time.monotonic()
        findings = check_items(self.exe, self.pending)
        self.cpp_seconds += time.monotonic() - t
        self.pending = []
        if findings:
            self.findings += write_findings(findings, self.out)
            self.finish()

    def finish(self) -> None:
        summary = {
            "inputs": self.count,
            "seconds": round(time.monotonic() - self.started, 1),
            "cpp_seconds": round(self.cpp_seconds, 1),
            "verdicts": dict(self.verdicts.most_common()),
            "findings": [str(p) for p in self.findings],
            "inputs_sha256": self.digest.hexdigest(),
        }
        (self.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        print("plan fuzz summary: " + json.dumps(summary), flush=True)
        sys.stderr.flush()
        os._exit(1 if self.findings else 0)


def _instrument(module: types.ModuleType, atheris: Any) -> None:
    """Coverage for the Python validator's own code (not json's C scanner, not this file)."""
    for obj in vars(module).values():
        if isinstance(obj, types.FunctionType) and obj.__module__ == module.__name__:
            atheris.instrument_func(obj)


def fuzz(out: Path, runs: int, seed: int, max_seconds: float, exe: Path | None, batch: int) -> None:
    import atheris

    out.mkdir(parents=True, exist_ok=True)
    exe = exe or build_driver(out)
    seeds = seed_plans()
    corpus = out / "corpus"
    shutil.rmtree(corpus, ignore_errors=True)
    corpus.mkdir()
    modes = random.Random(seed)
    for k, (name, text) in enumerate(seeds):  # each plan as packaged, and under another node
        (corpus / f"{k:03d}_{name}"[:80]).write_bytes(bytes([2]) + text)
        (corpus / f"{k:03d}_m_{name}"[:80]).write_bytes(bytes([modes.randrange(256)]) + text)
    for k, case in enumerate(load_regressions()):
        it = case_item(case)
        (corpus / f"r{k:03d}").write_bytes(bytes([0]) + it.text)
    _instrument(plan_module, atheris)
    # Looked up at each call: atheris.Setup rebinds Mutate to the libFuzzer-backed one.
    mutator = Mutator([t for _, t in seeds], lambda data, size: atheris.Mutate(data, size))
    campaign = Campaign(exe, out, runs, max_seconds, batch)
    args = [
        sys.argv[0],
        str(corpus),
        f"-seed={seed}",
        "-len_control=0",
        "-max_len=65536",
        f"-artifact_prefix={out}/",
        "-timeout=300",
        "-rss_limit_mb=4096",
        f"-max_total_time={int(max_seconds) + 600}",
        "-print_final_stats=0",
        # Reproducible for a seed: no timed re-reads of the corpus folder, and the plain
        # schedule (the entropic one diverged between runs of the same seed here).
        "-reload=0",
        "-entropic=0",
    ]
    atheris.Setup(
        args,
        campaign.one_input,
        custom_mutator=mutator.mutate,
        custom_crossover=mutator.crossover,
    )
    atheris.Fuzz()


def replay(paths: list[Path], exe: Path) -> int:
    """Run finding files or regression files through both sides; print what differs."""
    cases = []
    for p in paths:
        if p.suffix == ".jsonl":
            cases += load_regressions(p)
        else:
            d = json.loads(p.read_text())
            cases.append(d.get("case", d))
    items = [case_item(c) for c in cases]
    findings = check_items(exe, items)
    for f in findings:
        print(json.dumps(f.as_json(f.kind), indent=1))
    print(f"{len(items)} inputs, {len(findings)} findings")
    return 1 if findings else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "plan-fuzz")
    ap.add_argument("--runs", type=int, default=100_000, help="inputs to try")
    ap.add_argument("--seed", type=int, default=1, help="libFuzzer's seed (fixed: reproducible)")
    ap.add_argument("--max-seconds", type=float, default=3600.0)
    ap.add_argument("--batch", type=int, default=1000, help="inputs per C++ driver process")
    ap.add_argument("--driver", type=Path, help="an already built driver (default: build one)")
    ap.add_argument("--replay", type=Path, nargs="+", help="finding or .jsonl files to re-check")
    args = ap.parse_args()
    if args.replay:
        exe = args.driver or build_driver(args.out)
        sys.exit(replay(args.replay, exe))
    fuzz(args.out, args.runs, args.seed, args.max_seconds, args.driver, args.batch)


if __name__ == "__main__":
    main()
