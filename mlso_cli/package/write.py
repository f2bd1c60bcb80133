"""Write an ONNX model atomically, never over its input, with external data when needed.

Why: a crash, Ctrl-C or a full disk must never leave a truncated model where a good one (or the
input) was. Everything is written to a temporary file in the destination folder, flushed to disk,
then renamed into place (rename is atomic within one file system). Models over 2 GB cannot be
serialized as one protobuf, and a model whose weights live in external files must not point at
the input's files (a later edit of one would corrupt the other), so those are written with their
own external-data file next to the output, also temp-then-rename. Kernel binaries (mlso_bin_*)
stay inline so that checking a model never needs its weights.

File safety (docs/cli-errors.md): the output must be a new path or a regular file; a symlink,
directory, device or FIFO is refused even when replacing, so `-o /dev/null --force` cannot
replace /dev/null. Without `replace` the output is created with a no-replace rename (a hard link
of the temp file, which fails atomically when another run placed the name first). Temp files are
named `.OUT.mlso-tmp.<pid>.<random>`: SIGTERM and SIGHUP during a write remove them, and a later
write next to the same output removes those whose process is gone (a killed -9 run). Outputs get
the mode 0o666 & ~umask, like any file a user creates.

Speed (a 478 MB model, issue 31): the disk write of the temp file is started every 32 MB
(`_Writeback`) rather than all at the fsync; an output replaced is freed in a thread rather than
inside the rename (`_hold`); and optimize can have the temp file written ahead while it hashes
the model (package/prefile.py), which `write_model_atomic(prefile=)` then completes and places.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import stat
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, TYPE_CHECKING

import onnx
from google.protobuf.message import DecodeError
from onnx import TensorProto, external_data_helper

from mlso_cli.errors import InputError, Interrupted
from mlso_cli.package.chunks import Serialized, serialized_chunks
from mlso_cli.package.rewrite import BINARY_PREFIX

if TYPE_CHECKING:
    from mlso_cli.package.prefile import Prefile

PROTOBUF_LIMIT = 2**31 - 1
_HEADROOM = 64 << 20  # graph structure on top of the tensor bytes
EXTERNAL_THRESHOLD = 1024  # bytes; smaller tensors stay inline, like onnx.save's default
_ALIGN = 64
_SMALL_MODEL = 64 << 20


def _graph_tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield sparse.values
        yield sparse.indices
    for node in graph.node:
        yield from _node_tensors(node)


def _node_tensors(node: onnx.NodeProto) -> Iterator[onnx.TensorProto]:
    for attr in node.attribute:
        if attr.HasField("t"):
            yield attr.t
        yield from attr.tensors
        if attr.HasField("sparse_tensor"):
            yield attr.sparse_tensor.values
            yield attr.sparse_tensor.indices
        if attr.HasField("g"):
            yield from _graph_tensors(attr.g)
        for g in attr.graphs:
            yield from _graph_tensors(g)


def all_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Every tensor stored in the model: initializers, attributes, subgraphs, function bodies."""
    yield from _graph_tensors(model.graph)
    for function in model.functions:
        for node in function.node:
            yield from _node_tensors(node)


def _is_external(t: onnx.TensorProto) -> bool:
    return t.data_location == TensorProto.EXTERNAL


def input_external_files(path: Path) -> set[Path]:
    """The external-data files the model at `path` uses. Only a small .onnx can have any (its
    weights are elsewhere); a large one holds its weights inline and is not parsed again."""
    try:
        st = path.stat()
        # a FIFO or /dev/fd pipe was read once already; reading it again would block forever
        if not stat.S_ISREG(st.st_mode) or st.st_size > _SMALL_MODEL:
            return set()
        return _external_files(
            onnx.load(str(path), load_external_data=False), path.resolve().parent
        )
    except (OSError, ValueError, DecodeError):
        return set()


def _external_files(model: onnx.ModelProto, base_dir: Path) -> set[Path]:
    files = set()
    for t in all_tensors(model):
        if _is_external(t):
            info = external_data_helper.ExternalDataInfo(t)
            files.add((base_dir / info.location).resolve())
    return files


def _same_file(a: Path, b: Path) -> bool:
    if a.resolve() == b.resolve():
        return True
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


_TEMP_MARK = ".mlso-tmp."
_TEMP_RE = re.compile(r"\.mlso-tmp\.(\d+)\.[A-Za-z0-9_]+$")
_STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n))
_NO_HARD_LINKS = {
    errno.EPERM,
    errno.ENOTSUP,
    errno.EOPNOTSUPP,
    errno.ENOSYS,
    errno.EMLINK,
    errno.EXDEV,
}


def current_umask() -> int:
    """The process umask, read without changing it where Linux allows (/proc/self/status), because
    setting and restoring it races with other threads creating files."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


_WRITEBACK_STEP = 32 << 20
"""Bytes written between two starts of writeback (`_Writeback`)."""


class _Writeback:
    """Starts the disk write of what was written so far (Linux `sync_file_range` with
    SYNC_FILE_RANGE_WRITE: it starts the write, waits for nothing), so that the disk writes one
    part while the next is copied into the page cache; the fsync at the end then waits only for
    the rest. Why: on the 2-core machine's disk the fsync of a 478 MB model took 0.7-0.9 s after
    a write of 0.2-1.0 s. Durability is the fsync's, as before; where the call is missing (not
    Linux) this does nothing."""

    def __init__(self, fd: int) -> None:
        self.fd, self.started, self._call = fd, 0, _sync_file_range()

    def written(self, f, upto: int) -> None:
        """`upto` bytes of `f` (the file of `fd`) are written."""
        if self._call is None or upto - self.started < _WRITEBACK_STEP:
            return
        f.flush()
        if self._call(self.fd, self.started, upto - self.started, 2) != 0:  # WRITE
            self._call = None  # refused (a file system without it): the fsync does it all
            return
        self.started = upto


def _sync_file_range():
    try:
        import ctypes

        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call


def _write_piece(f: IO[bytes], piece: bytes, writeback: _Writeback, offset: int) -> int:
    """`piece` written at `offset`, the disk write started every _WRITEBACK_STEP bytes; the
    offset after it."""
    view = memoryview(piece)
    for start in range(0, len(view), _WRITEBACK_STEP):
        part = view[start : start + _WRITEBACK_STEP]
        f.write(part)
        offset += len(part)
        writeback.written(f, offset)
    return offset


def _fsync_write(path: str, chunks: Iterator[bytes] | list[bytes]) -> None:
    with open(path, "wb") as f:
        writeback, offset = _Writeback(f.fileno()), 0
        for chunk in chunks:
            offset = _write_piece(f, chunk, writeback, offset)
        f.flush()
        os.fchmod(f.fileno(), 0o666 & ~current_umask())  # mkstemp made it 0600
        os.fsync(f.fileno())


def _temp_in(folder: Path, name: str) -> str:
    fd, tmp = tempfile.mkstemp(prefix=f".{name}{_TEMP_MARK}{os.getpid()}.", dir=folder)
    os.close(fd)
    return tmp


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, another user's
        return True
    return True


def remove_stale_temps(folder: Path, name: str) -> list[Path]:
    """Remove our temp files for output `name` in `folder` left by runs that were killed (their PID
    is gone); return them. Only regular files of this user are touched; a live PID (or a reused
    one) keeps its file, so the worst case is a stale file kept, never an in-flight one removed."""
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        m = _TEMP_RE.search(entry.name)
        if not (m and entry.name.startswith(f".{name}")):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if (
                stat.S_ISREG(st.st_mode)
                and st.st_uid == os.getuid()
                and not _pid_alive(int(m.group(1)))
            ):
                os.unlink(entry.path)
                removed.append(Path(entry.path))
        except OSError:
            continue
    return removed


def check_output_path(out: Path, *, replace: bool) -> None:
    """Refuse an output that is not a regular file or a new path, and an existing one unless
    `replace`. Why lstat: a symlink (even to a regular file) would redirect the write elsewhere,
    and renaming over a device or FIFO would replace it (as root, /dev/null)."""
    try:
        st = os.lstat(out)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise InputError(
            f"cannot check the output {out}: {exc.strerror or exc}", "Choose another path with -o"
        ) from None
    if stat.S_ISLNK(st.st_mode):
        raise InputError(
            f"{out} is a symbolic link; mlso writes only a regular file or a new path",
            "Give the real path, or another path, with -o",
        )
    if stat.S_ISDIR(st.st_mode):
        raise InputError(
            f"{out} is a directory", "Give a file name for the output model, e.g. -o fast.onnx"
        )
    if not stat.S_ISREG(st.st_mode):
        raise InputError(
            f"{out} is not a regular file (a device, FIFO or socket); mlso will not replace it",
            "Choose a regular file or a new path with -o",
        )
    if not replace:
        raise _exists(out)


def _exists(out: Path) -> InputError:
    return InputError(
        f"{out} already exists (another run may have just written it)",
        "Pass --force to replace it, or choose another path with -o",
    )


def _place(tmp: str, final: Path, replace: bool) -> None:
    """Rename tmp to final. Without replace, a hard link then unlink: link fails atomically with
    FileExistsError if final appeared meanwhile, which os.replace would silently overwrite."""
    if replace:
        check_output_path(final, replace=True)
        held = _hold(final)
        try:
            os.replace(tmp, final)
        finally:
            _release(held)
        return
    try:
        os.link(tmp, final, follow_symlinks=False)
    except FileExistsError:
        raise _exists(final) from None
    except OSError as exc:
        if exc.errno not in _NO_HARD_LINKS:
            raise
        _place_exclusive(tmp, final)
        return
    os.unlink(tmp)


def _hold(path: Path) -> int | None:
    """A descriptor on the large regular file at `path` that a rename is about to replace, or
    None. Why: a file's pages and blocks are freed when its last name and its last descriptor
    are gone; with this one held, not inside the rename (0.3-0.4 s for a 478 MB output, every
    page of it dropped from the page cache) but in `_release`'s thread, while the command
    finishes. The rename itself is the same: the name points at the new file at once."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_size > _SMALL_MODEL and st.st_nlink == 1:
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def _release(fd: int | None) -> None:
    """Close `fd` (`_hold`) in a thread of its own (os.close lets go of the GIL)."""
    if fd is None:
        return

    def close() -> None:
        with suppress(OSError):
            os.close(fd)

    try:
        threading.Thread(target=close, name="mlso-release", daemon=True).start()
    except RuntimeError:  # no thread to be had (interpreter shutting down): close it here
        close()


def _place_exclusive(tmp: str, final: Path) -> None:
    """Where hard links are unsupported (FAT, some network file systems): claim the name with
    O_EXCL, then rename over the claim. A crash between the two leaves an empty file at final."""
    try:
        fd = os.open(
            final, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600
        )
    except FileExistsError:
        raise _exists(final) from None
    os.close(fd)
    os.replace(tmp, final)


class _Flight:
    """One write in progress: its temp files, and whether a stop signal may still abort it (not
    while placing files or cleaning up: then the signal waits until the write is over)."""

    def __init__(self) -> None:
        self.temps: list[str] = []
        self.abortable = True
        self.pending: int | None = None

    def on_signal(self, signum: int, frame: object) -> None:
        if self.abortable:
            self.abortable = False
            raise Interrupted(
                f"stopped by {signal.Signals(signum).name} while writing the output; "
                "its temp files were removed and nothing was written"
            )
        self.pending = signum

    def remove_temps(self) -> None:
        for tmp in self.temps:
            with suppress(FileNotFoundError):
                os.unlink(tmp)


@contextmanager
def _stop_signals_abort(flight: _Flight) -> Iterator[None]:
    """SIGTERM/SIGHUP abort the write (the except path removes the temps) instead of killing the
    process with temp files left; the previous handlers come back afterwards, and a signal that
    arrived while files were being placed is re-raised then. A signal ignored before (nohup) stays
    ignored; outside the main thread Python cannot set handlers, so nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in _STOP_SIGNALS}
    for s, old in previous.items():
        if old is not signal.SIG_IGN:
            signal.signal(s, flight.on_signal)
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old if old is not None else signal.SIG_DFL)
        if flight.pending is not None:
            signal.raise_signal(flight.pending)


def _data_name(out: Path, avoid: set[Path]) -> str:
    name, k = f"{out.name}.data", 1
    while (out.parent / name).resolve() in avoid:
        name = f"{out.name}.{k}.data"
        k += 1
    return name


def _externalize(model: onnx.ModelProto, location: str) -> list[bytes]:
    """Move every large tensor's bytes out of `model`; return them in file order (padded)."""
    chunks: list[bytes] = []
    offset = 0
    for t in all_tensors(model):
        if (
            t.name.startswith(BINARY_PREFIX)
            or not t.HasField("raw_data")
            or len(t.raw_data) < EXTERNAL_THRESHOLD
        ):
            continue
        data = t.raw_data
        pad = (-offset) % _ALIGN
        if pad:
            chunks.append(b"\0" * pad)
            offset += pad
        external_data_helper.set_external_data(t, location, offset=offset, length=len(data))
        t.data_location = TensorProto.EXTERNAL
        t.ClearField("raw_data")
        chunks.append(data)
        offset += len(data)
    return chunks


def _too_big(model: onnx.ModelProto) -> bool:
    inline = sum(len(t.raw_data) for t in all_tensors(model) if t.HasField("raw_data"))
    return inline + _HEADROOM > PROTOBUF_LIMIT


def write_model_atomic(
    model: onnx.ModelProto,
    out_path: str | os.PathLike[str],
    *,
    input_path: str | os.PathLike[str] | None = None,
    external_data: bool | None = None,
    replace: bool = True,
    serialized: Serialized | None = None,
    prefile: Prefile | None = None,
) -> Path:
    """Write `model` to out_path atomically and return the path.

    input_path: the model it came from; never overwritten, and the folder its external data is
    read from. external_data: force (True) or forbid (False) an external-data file; by default
    one is written when the model is over 2 GB or its input kept weights in external files.
    replace: whether an existing regular file at out_path (or its data file) may be replaced;
    the CLI passes --force. Without it, a run that loses a race for the name fails cleanly.
    serialized: `model` serialized already (Outcome.serialized): an inline write takes its
    weights' bytes from there (package/chunks.py `Serialized.pieces_for`). prefile: the temp
    file the run wrote ahead (package/prefile.py); an inline write keeps what of it agrees.
    """
    out = Path(out_path)
    inp = Path(input_path) if input_path is not None else None
    if inp is not None and _same_file(out, inp):
        raise InputError(
            f"writing {out} would overwrite the input model {inp}",
            "Choose another output path with -o",
        )
    check_output_path(out, replace=replace)

    has_external = any(_is_external(t) for t in all_tensors(model))
    if has_external and inp is None:
        raise InputError(
            "the model keeps weights in external files, but no input path was given to read them from",
            "Pass input_path= (the model's original .onnx path)",
        )
    input_files: set[Path] = set()
    if inp is not None:
        input_files = input_external_files(inp)
        if has_external:
            input_files |= _external_files(model, inp.resolve().parent)
        clash = [f for f in input_files if _same_file(out, f)]
        if clash:
            raise InputError(
                f"writing {out} would overwrite the input's external data {clash[0]}",
                "Choose another output path with -o",
            )
    pieces: list[bytes] | None = None
    if external_data is None:
        external_data = has_external or bool(input_files)
        if not external_data:
            pieces = _pieces_if_small(model, serialized)
            external_data = pieces is None and _too_big(model)
    if has_external and not external_data:
        raise InputError(
            "the model keeps weights in external files; it cannot be written inline without loading them",
            "Leave external_data unset",
        )

    folder = out.parent if str(out.parent) else Path(".")
    if not folder.is_dir():
        raise InputError(
            f"cannot write {out}: folder {folder} does not exist",
            "Create the folder or choose another -o",
        )
    remove_stale_temps(folder, out.name)
    flight = _Flight()
    with _stop_signals_abort(flight):
        _write_and_place(
            model,
            out,
            folder,
            inp,
            input_files,
            external_data,
            has_external,
            replace,
            flight,
            pieces,
            prefile,
        )
    return out


def _pieces_if_small(
    model: onnx.ModelProto, serialized: Serialized | None = None
) -> list[bytes] | None:
    """The model's serialisation in pieces (package/chunks.py; from `serialized` where it was
    made from this model) when it fits inline with _HEADROOM to spare: then so do its tensors'
    bytes, and `_too_big` need not copy every one out only to count them (half a second on
    478 MB). None otherwise, or when serialising fails (the write itself then reports that)."""
    try:
        pieces = serialized.pieces_for(model) if serialized is not None else None
        if pieces is None:
            pieces = serialized_chunks(model)
    except ValueError:
        return None
    return pieces if sum(map(len, pieces)) + _HEADROOM <= PROTOBUF_LIMIT else None


def _write_and_place(
    model: onnx.ModelProto,
    out: Path,
    folder: Path,
    inp: Path | None,
    input_files: set[Path],
    use_external: bool,
    has_external: bool,
    replace: bool,
    flight: _Flight,
    pieces: list[bytes] | None = None,
    prefile: Prefile | None = None,
) -> None:
    """The temp files, then the renames; on any failure (or a stop signal) nothing is left.
    `pieces`: the model serialised already (`_pieces_if_small`), for an inline write, which
    finishes `prefile`'s temp file where it has one (package/prefile.py)."""
    data_final: Path | None = None
    data_placed = placed = False
    try:
        if use_external:
            if prefile is not None:
                prefile.discard()  # written inline, the model it holds is not this file's
            work = onnx.ModelProto()
            work.CopyFrom(model)
            if has_external:
                assert inp is not None
                base = str(inp.resolve().parent)
                for t in all_tensors(work):
                    if _is_external(t):
                        external_data_helper.load_external_data_for_tensor(t, base)
                        t.data_location = TensorProto.DEFAULT
                        del t.external_data[:]
            data_name = _data_name(out, input_files | {out.resolve()})
            data_final = folder / data_name
            check_output_path(data_final, replace=replace)
            chunks = _externalize(work, data_name)
            data_tmp = _temp_in(folder, data_name)
            flight.temps.append(data_tmp)
            _fsync_write(data_tmp, chunks)
            del chunks
            payload = [work.SerializeToString()]
        else:
            # in pieces, each large weight's bytes one: serialising a model with hundreds of MB
            # inline as one bytes object costs seconds (package/chunks.py)
            payload = pieces if pieces is not None else serialized_chunks(model)
            if sum(map(len, payload)) > PROTOBUF_LIMIT:  # what SerializeToString would refuse
                raise ValueError("the model is over protobuf's 2 GB limit")
        model_tmp = None
        if prefile is not None and not use_external:
            model_tmp = prefile.finish(payload)
        if model_tmp is not None:
            flight.temps.append(model_tmp)
        else:
            model_tmp = _temp_in(folder, out.name)
            flight.temps.append(model_tmp)
            _fsync_write(model_tmp, payload)
        flight.abortable = False  # from here a stop signal waits: a half-placed pair is worse
        if use_external:
            _place(data_tmp, data_final, replace)
            data_placed = True
        _place(model_tmp, out, replace)
        placed = True
    except BaseException as exc:
        flight.abortable = False
        flight.remove_temps()
        if data_placed and not placed and data_final is not None and data_final.exists():
            data_final.unlink()  # its model never landed; do not leave a half-written pair
        _reraise(exc, out, use_external)


def _reraise(exc: BaseException, out: Path, use_external: bool) -> None:
    """Turn a failed write into the error the user sees: ENOSPC stays an OSError (the CLI names
    it), other OS errors and serialization errors become one-line InputErrors."""
    if isinstance(exc, OSError) and exc.errno != errno.ENOSPC:
        raise InputError(
            f"cannot write {out}: {exc.strerror or exc}",
            "Check that the folder is writable and has space",
        ) from exc
    if isinstance(exc, OSError):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(out)) from exc
    if isinstance(exc, ValueError) and not use_external:
        raise InputError(
            f"cannot serialize the model for {out} ({exc})", "Write it with external_data=True"
        ) from exc
    raise exc
