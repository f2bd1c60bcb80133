"""The cache of verdicts of the check before writing: a rerun does not verify the same bytes again.

Why: with every region's search served from the cache, the check before writing is most of a
rerun (on a 2-layer Llama-width export, about a minute of float64 reference and field checks),
and it would check exactly what it checked before. The check is a deterministic function of
  - the original model (A, with its weights): named by the sha256 of the file's bytes, the input
    shapes and the onnx version where A is loaded from those bytes alone (no external data), so
    a rerun need not load A again; else by the sha256 of A serialised (`original_id`),
  - the model about to be written (B, first packaging round: kernels, binaries, constants),
  - the check's seed, where the user fixed it (`--seed`); with a fresh seed (the default) a
    verdict obtained under any earlier fresh seed is as good as a new one, so the key leaves it
    out and the seed reported is the one that ran,
  - the code that runs it (every source file of mlso and its CUDA templates),
so its outcome is stored under a sha256 of all four, as the search cache stores search results:
one file per key, the sha256 of its body on the first line (a corrupt or truncated entry is a
miss), written to a temporary file and renamed into place.

What is stored is the outcome, not a claim: which regions stayed packaged, each one's reason,
bound and one-line checks, the bound written, and the sha256 of the model that passed. On a hit
the choices are rebuilt from it and packaged again, and the result is used only when that model
hashes to the stored digest; otherwise the check runs in full. `--no-cache` skips this cache too.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

import onnx

from mlso_cli import __version__
from mlso_cli.cachefiles import seal, source_digest, unseal, write_atomic
from mlso_cli.pipeline.artifacts import Choice

SCHEMA = 2
"""2: the original is named by `original_id` (1 named it by A serialised, always)."""
_PACKAGE_ROOT = Path(__file__).resolve().parents[1]


@cache
def code_digest() -> str:
    """sha256 over every Python source of mlso and the CUDA templates: any edit to a check, to
    code generation (which the check regenerates and compares) or to packaging is a new key."""
    from mlso_cli.codegen.nvcc import templates_digest

    return source_digest(_PACKAGE_ROOT, ("",), templates_digest())


def model_digest(model: onnx.ModelProto) -> str:
    """sha256 of the model's serialisation, hashed piece by piece (package/chunks.py: a 478 MB
    model serialised whole costs seconds)."""
    from mlso_cli.package.chunks import serialized_sha256

    return serialized_sha256(model)


def original_id(
    bytes_sha256: str, input_shapes: dict[str, tuple[int, ...]] | None, from_stdin: bool
) -> str:
    """The original A named without loading it: A is what the loader makes of the bytes read
    (their sha256), the input shapes fixed, the code (the key's own `code` part) and onnx's
    parser and shape inference (its version). Read from stdin, A is the folded model, not the
    file as written (pipeline/run.py `_original`), so that is part of the name too."""
    text = json.dumps(
        {
            "bytes": bytes_sha256,
            "input_shapes": sorted((k, list(v)) for k, v in (input_shapes or {}).items()),
            "onnx": onnx.__version__,
            "stdin": from_stdin,
        },
        sort_keys=True,
    )
    return "file:" + hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class RegionVerdict:
    """One choice as the check left it (only the fields the check may change)."""

    packaged: bool
    why: str
    bound: float | None
    checks: str


@dataclass(frozen=True)
class Verdict:
    """The outcome of one check before writing."""

    regions: tuple[RegionVerdict, ...]
    bound: float
    model_sha256: str
    seed: int
    """The seed the check ran with."""

    @staticmethod
    def of(choices: Sequence[Choice], bound: float, model_sha256: str, seed: int) -> Verdict:
        """`model_sha256`: the `model_digest` of the model that passed."""
        regions = tuple(RegionVerdict(c.packaged, c.why, c.bound, c.checks) for c in choices)
        return Verdict(regions, float(bound), model_sha256, int(seed))

    def applied(self, choices: Sequence[Choice]) -> tuple[Choice, ...] | None:
        """The choices as the check left them, or None when the stored verdict is for other
        choices (another count, or a region packaged now that was not packaged then)."""
        if len(choices) != len(self.regions):
            return None
        out = []
        for c, r in zip(choices, self.regions):
            if r.packaged and not c.packaged:
                return None
            out.append(replace(c, packaged=r.packaged, why=r.why, bound=r.bound, checks=r.checks))
        return tuple(out)

    def to_dict(self) -> dict:
        return {
            "regions": [
                {"packaged": r.packaged, "why": r.why, "bound": r.bound, "checks": r.checks}
                for r in self.regions
            ],
            "bound": self.bound,
            "model_sha256": self.model_sha256,
            "seed": self.seed,
        }

    @staticmethod
    def from_dict(d: dict) -> Verdict:
        regions = tuple(
            RegionVerdict(
                bool(r["packaged"]),
                str(r["why"]),
                None if r["bound"] is None else float(r["bound"]),
                str(r["checks"]),
            )
            for r in d["regions"]
        )
        return Verdict(regions, float(d["bound"]), str(d["model_sha256"]), int(d["seed"]))


class VerdictCache:
    """Verdicts under `root`: `<root>/<key[:2]>/<key>.json` (module docstring)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    @staticmethod
    def key(original_sha256: str, packaged_sha256: str, seed: int | None) -> str:
        """`original_sha256`: A by its `original_id` or `model_digest`; `packaged_sha256`: B by
        its `model_digest`; `seed`: the fixed seed, or None for a fresh one (module docstring)."""
        text = json.dumps(
            {
                "schema": SCHEMA,
                "version": __version__,
                "code": code_digest(),
                "original": original_sha256,
                "packaged": packaged_sha256,
                "seed": None if seed is None else int(seed),
            },
            sort_keys=True,
        )
        return hashlib.sha256(text.encode()).hexdigest()

    def path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.json"

    def get(self, key: str) -> Verdict | None:
        """The stored verdict, or None (absent, unreadable, corrupt or for another key)."""
        try:
            raw = self.path(key).read_bytes()
        except OSError:
            return None
        body = unseal(raw)
        if body is None:
            return None
        try:
            doc = json.loads(body)
            if doc.get("schema") != SCHEMA or doc.get("key") != key:
                return None
            return Verdict.from_dict(doc["verdict"])
        except (ValueError, KeyError, TypeError):
            return None

    def put(self, key: str, verdict: Verdict) -> None:
        """Store atomically; a cache that cannot be written (read-only, full disk) is skipped:
        the verdict was for this run, and the model is still written."""
        body = json.dumps(
            {"schema": SCHEMA, "key": key, "verdict": verdict.to_dict()}, sort_keys=True
        ).encode()
        with contextlib.suppress(OSError):
            write_atomic(self.path(key), seal(body))
