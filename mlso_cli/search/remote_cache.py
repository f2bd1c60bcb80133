"""The search cache on storage every node sees: a local or shared directory, or an fsspec URL.

    open_search_cache(location) -> SearchCache

Why: several `mlso optimize` drivers on one Ray cluster (or on several machines) should search a
region once, whichever driver meets it first. The cache is content-addressed (search/cache.py),
so sharing it needs only storage they all reach: a directory on a shared filesystem (NFS, a
mounted volume) works as it is; an object store (`s3://bucket/mlso`, `gs://...`) goes through
fsspec. Either way an entry is placed whole or not at all, and a reader checks its sha256 before
trusting it: two drivers writing the same entry leave one complete copy (the bodies are equal),
and a truncated or corrupted object reads as a miss, so the region is searched again.

Only search results live there: compiled kernels and the custom-op library stay in each node's
local MLSO_CACHE_DIR (they are built for that node's GPU and toolchain).
"""

from __future__ import annotations

import contextlib
import uuid
from pathlib import Path

from mlso_cli.errors import EnvironmentProblem
from mlso_cli.search.cache import CacheKey, SearchCache


def is_url(location: str | Path) -> bool:
    """True for `proto://...` (an fsspec URL), False for a plain path."""
    return isinstance(location, str) and "://" in location


class FsspecSearchCache(SearchCache):
    """SearchCache's entries at `<url>/<digest[:2]>/<digest>.json` on an fsspec filesystem.

    Writes go to a uniquely named temporary object that is then moved into place: a rename on
    local and POSIX-like filesystems; on object stores the object is visible whole or not at
    all either way. Reads that fail for any reason are misses."""

    def __init__(self, url: str) -> None:
        try:
            import fsspec
        except ImportError as exc:
            raise EnvironmentProblem(
                f"the search cache {url} is a URL, which needs fsspec ({exc})",
                "Install it with: pip install 'mlso[ray]' (s3:// also needs s3fs, gs:// gcsfs), "
                "or point MLSO_SEARCH_CACHE at a directory",
            ) from exc
        try:
            self.fs, root = fsspec.core.url_to_fs(url)
        except (ImportError, ValueError) as exc:
            raise EnvironmentProblem(
                f"cannot open the search cache {url}: {exc}",
                "Install the fsspec backend for its protocol (e.g. s3fs), or use a directory",
            ) from exc
        self.url = url
        self.root_path = root.rstrip("/")
        super().__init__(Path(root))

    def location(self, key: CacheKey) -> str:
        d = key.digest
        return f"{self.root_path}/{d[:2]}/{d}.json"

    def _read(self, key: CacheKey) -> bytes | None:
        try:
            return self.fs.cat_file(self.location(key))
        except Exception:  # noqa: BLE001 - absent, unreachable or unreadable: a miss
            return None

    def _write(self, key: CacheKey, data: bytes) -> None:
        path = self.location(key)
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"
        with contextlib.suppress(Exception):  # object stores have no directories to make
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        try:
            self.fs.pipe_file(tmp, data)
            self.fs.mv(tmp, path)
        except BaseException:
            with contextlib.suppress(Exception):
                self.fs.rm(tmp)
            raise


def open_search_cache(location: str | Path) -> SearchCache:
    """The search cache at `location`: a directory (local or shared), or an fsspec URL
    (`file://`, `memory://`, `s3://`, ...)."""
    if is_url(location):
        return FsspecSearchCache(str(location))
    return SearchCache(Path(location))
