"""The on-disk cache of search results: content-hash keys, atomic writes, self-checking entries.

Why: searching a region takes minutes, and the same region (same structure, same shapes) comes
back in every rerun and in many models. As in Triton's kernel cache, an entry's name is a hash of
everything that can change the result, so a stale entry is never found rather than invalidated:
  - the region's canonical μGraph hash (`mlso_cli.ir.hashing.graph_hash`, names excluded),
  - the options that change the result (`SearchOptions.cache_fields()`),
  - the code generation targets (what the candidates were costed and checked for),
  - the code: the CUDA templates plus the source of code generation and search,
  - which search function ran (a test's fake never answers for the real enumerator),
  - the mlso version.
Each entry stores the sha256 of its own body, so a truncated or corrupt file (a crash mid-write on
a filesystem without atomic rename, a disk error, a hand edit) is detected and read as a miss.
Writes go to a temporary file renamed into place, so concurrent runs never see half an entry.
A partial result (a wall-clock budget or Ctrl-C cut the search short) is never stored: a later
run must search again rather than be served an answer that depended on timing.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from mlso_cli import __version__
from mlso_cli.cachefiles import seal, source_digest, unseal, write_atomic
from mlso_cli.ir.serialize import SchemaError, from_dict, to_dict
from mlso_cli.search.api import Candidate, SearchResult

ENTRY_SCHEMA = 1
_PACKAGE_ROOT = Path(__file__).resolve().parents[1]
_CODE_DIRS = ("codegen", "search")


@cache
def code_digest() -> str:
    """sha256 over the CUDA templates and the Python source of code generation and search (an
    edit to the enumerator or the cost model changes which program wins)."""
    from mlso_cli.codegen.nvcc import templates_digest

    return source_digest(_PACKAGE_ROOT, _CODE_DIRS, templates_digest())


@dataclass(frozen=True)
class CacheKey:
    """Everything a search result depends on; `digest` names the entry."""

    region_hash: str
    options: tuple[tuple[str, Any], ...]
    targets: tuple[str, ...]
    code: str
    search_fn: str
    version: str = __version__

    def as_dict(self) -> dict[str, Any]:
        return {
            "region_hash": self.region_hash,
            "options": dict(self.options),
            "targets": list(self.targets),
            "code": self.code,
            "search_fn": self.search_fn,
            "version": self.version,
        }

    @property
    def digest(self) -> str:
        text = json.dumps(self.as_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()


def make_key(
    region_hash: str, cache_fields: dict[str, Any], targets: tuple[str, ...], search_fn: Any
) -> CacheKey:
    """The key for one region's search (`search_fn` is the callable, named by module and qualname)."""
    name = f"{getattr(search_fn, '__module__', '?')}.{getattr(search_fn, '__qualname__', repr(search_fn))}"
    return CacheKey(
        region_hash, tuple(sorted(cache_fields.items())), tuple(targets), code_digest(), name
    )


def result_to_dict(result: SearchResult) -> dict[str, Any]:
    return {
        "candidates": [
            {
                "graph": to_dict(c.graph),
                "estimate_us": c.estimate_us,
                "kernels": c.kernels,
                "bound": c.bound,
            }
            for c in result.candidates
        ],
        "states": result.states,
        "pruned": result.pruned,
        "verified": result.verified,
        "seconds": result.seconds,
        "bound": result.bound,
        "partial": result.partial,
        "notes": list(result.notes),
    }


def result_from_dict(d: dict[str, Any]) -> SearchResult:
    cands = tuple(
        Candidate(
            from_dict(c["graph"]), float(c["estimate_us"]), int(c["kernels"]), float(c["bound"])
        )
        for c in d["candidates"]
    )
    if not cands:
        raise ValueError("a search result needs at least one candidate")
    return SearchResult(
        cands,
        int(d["states"]),
        int(d["pruned"]),
        int(d["verified"]),
        float(d["seconds"]),
        float(d["bound"]),
        bool(d["partial"]),
        tuple(str(n) for n in d["notes"]),
    )


class SearchCache:
    """Search results under `root`, one file per key: `<root>/<digest[:2]>/<digest>.json`.

    File layout: the first line is the sha256 of the rest (hex), the rest is the JSON body holding
    the key and the result. Anything that does not check out is a miss."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def path(self, key: CacheKey) -> Path:
        d = key.digest
        return self.root / d[:2] / f"{d}.json"

    def get(self, key: CacheKey) -> SearchResult | None:
        """The stored final result for `key`, or None (absent, corrupt, truncated or partial)."""
        raw = self._read(key)
        if raw is None:
            return None
        body = unseal(raw)
        if body is None:
            return None
        try:
            doc = json.loads(body)
            if doc.get("schema") != ENTRY_SCHEMA or doc.get("key") != key.as_dict():
                return None
            result = result_from_dict(doc["result"])
        except (ValueError, KeyError, TypeError, SchemaError):
            return None
        return None if result.partial else result

    def put(self, key: CacheKey, result: SearchResult) -> bool:
        """Store a final result atomically; a partial one is refused (returns False)."""
        if result.partial:
            return False
        body = json.dumps(
            {"schema": ENTRY_SCHEMA, "key": key.as_dict(), "result": result_to_dict(result)},
            sort_keys=True,
            separators=(",", ":"),
        ).encode()
        self._write(key, seal(body))
        return True

    def _read(self, key: CacheKey) -> bytes | None:
        """The entry's bytes as stored, or None when it cannot be read (storage: see
        search/remote_cache.py for another)."""
        try:
            return self.path(key).read_bytes()
        except OSError:
            return None

    def _write(self, key: CacheKey, data: bytes) -> None:
        """Place the entry's bytes atomically: a temporary file renamed into place."""
        write_atomic(self.path(key), data)
