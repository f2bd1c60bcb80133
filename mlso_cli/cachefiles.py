"""Cache entries on disk: atomic writes and self-checking bodies, shared by every cache of mlso.

Why one module: the compile cache (codegen/nvcc.py), the search cache (search/cache.py) and the
verdict cache (pipeline/verdicts.py) all promise the same two things, and each copy of them was a
place for the promise to drift:
  - a reader never sees half an entry: the bytes go to a temporary file in the entry's folder,
    which is then renamed into place (atomic on one filesystem);
  - a corrupt or truncated entry (a crash on a filesystem without atomic rename, a disk error, a
    hand edit) reads as a miss: a sealed entry's first line is the sha256 of the rest.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path


def source_digest(root: Path, subdirs: tuple[str, ...] = ("",), salt: str = "") -> str:
    """sha256 over `salt` and every `*.py` under `root`/each of `subdirs`, by relative path and
    bytes. Why the source and not a version string: an edit to the code a cached entry depends on
    changes the entry's key, and nobody bumps a version for that."""
    h = hashlib.sha256(salt.encode())
    for sub in subdirs:
        for p in sorted((root / sub).rglob("*.py")):
            h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def write_atomic(path: Path, data: bytes) -> None:
    """`data` at `path`, or nothing there at all (the temporary file is removed on any failure)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def seal(body: bytes) -> bytes:
    """The entry as stored: the sha256 of `body` (hex), a newline, then `body`."""
    return hashlib.sha256(body).hexdigest().encode() + b"\n" + body


def unseal(raw: bytes) -> bytes | None:
    """The body of a sealed entry, or None when its checksum line does not match it."""
    head, sep, body = raw.partition(b"\n")
    if not sep or hashlib.sha256(body).hexdigest().encode() != head.strip():
        return None
    return body
