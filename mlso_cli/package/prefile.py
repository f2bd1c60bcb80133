"""The output's temp file, written while the model is hashed, before the run knows it will write it.

Why: on a rerun whose verdict is cached (pipeline/verdicts.py), optimize hashes the packaged
model to find the verdict, then writes the same bytes but for the metadata it sets after the
check. On a 478 MB model the write (0.7 s of copying into the page cache) and its fsync (0.6-0.8 s
of disk) came after the hash; here they run beside it: each piece `package.chunks.serialize`
hashes is handed to `Prefile`, whose thread writes it to a temp file next to the output and
starts its disk write at once. When the model is written, `finish` keeps what was written that
agrees with the bytes to write, piece by piece (the large pieces are the very bytes objects
hashed), truncates the rest, writes what differs (the metadata at the end), fsyncs, and hands
the temp file to `write_model_atomic`, which places it as it places any temp file.

What stays as before: the output appears only by the rename of a complete, fsynced temp file; a
model that is not the one hashed, a write that failed, a model written with external data, or
a verdict missed (the check then runs, for minutes) discards the temp file, and the model is
written from scratch. The temp file has the name `write_model_atomic` gives its own
(`.OUT.mlso-tmp.<pid>.<random>`), so a later write removes it when a `kill -9` left it; Ctrl-C
and any error remove it on the way out (`with Prefile(...)`), and SIGTERM or SIGHUP remove it
and then do what they did before (end the process, or the handler that was set).
"""

from __future__ import annotations

import os
import queue
import signal
import threading
from contextlib import suppress
from pathlib import Path
from typing import IO

from mlso_cli.package.write import (
    _STOP_SIGNALS,
    _temp_in,
    _write_piece,
    _Writeback,
    current_umask,
)


class Prefile:
    """A temp file for the output `out` that the pieces given to it are written to (module
    docstring). Use as a context manager around the run and its write; a `Tee` of
    package/chunks.py."""

    def __init__(self, out: str | os.PathLike[str]) -> None:
        self.out = Path(out)
        self.pieces: list[bytes] = []
        """The pieces given, in order; the file holds them joined once the thread is done."""
        self.tmp: str | None = None
        self._file: IO[bytes] | None = None
        self._queue: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stop = False
        self._closed = False
        self._previous: dict[int, object] = {}

    def __enter__(self) -> Prefile:
        return self

    def __exit__(self, *exc) -> None:
        self.discard()
        self._closed = True

    def __call__(self, piece: bytes) -> None:
        """Write `piece` after the pieces before it (in the thread: this returns at once); the
        first piece creates the temp file. Never raises: a failure only means the model is
        written from scratch later."""
        if self._closed or self._error is not None:
            return
        if self._queue is None:
            try:
                self._open()
            except Exception as exc:  # noqa: BLE001 - the write reports what is wrong
                self._error = exc
                self.discard()
                return
        self.pieces.append(piece)
        self._queue.put(piece)

    def _open(self) -> None:
        folder = self.out.parent if str(self.out.parent) else Path(".")
        self._on_stop_signals()
        self.tmp = _temp_in(folder, self.out.name)
        self._file = open(self.tmp, "r+b")  # noqa: SIM115 - closed by finish or discard
        self._queue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="mlso-prefile", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        assert self._file is not None and self._queue is not None
        writeback, offset = _Writeback(self._file.fileno()), 0
        while True:
            piece = self._queue.get()
            if piece is None:
                return
            if self._stop or self._error is not None:
                continue
            try:
                offset = _write_piece(self._file, piece, writeback, offset)
            except BaseException as exc:  # noqa: BLE001 - kept for finish to see
                self._error = exc

    def _join(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def discard(self) -> None:
        """Stop writing and remove the temp file (the pieces are dropped); nothing given after
        is written."""
        self._stop = self._closed = True
        self._join()
        self.pieces = []
        if self._file is not None:
            with suppress(OSError):
                self._file.close()
            self._file = None
        if self.tmp is not None:
            with suppress(FileNotFoundError):
                os.unlink(self.tmp)
            self.tmp = None
        self._restore_signals()

    def finish(self, payload: list[bytes]) -> str | None:
        """The temp file holding `payload` joined, fsynced and of the mode an output gets, now
        the caller's to place or remove; None (the temp file removed) when nothing was written
        ahead, the write failed, or its first piece is not `payload`'s."""
        if self.tmp is None or self._file is None:
            return None
        self._join()
        kept = size = 0
        for a, b in zip(self.pieces, payload):
            if not (a is b or a == b):
                break
            kept += 1
            size += len(b)
        if self._error is not None or kept == 0:
            self.discard()
            return None
        f, tmp = self._file, self.tmp
        try:
            f.truncate(size)
            f.seek(size)
            writeback, offset = _Writeback(f.fileno()), size
            for piece in payload[kept:]:
                offset = _write_piece(f, piece, writeback, offset)
            f.flush()
            os.fchmod(f.fileno(), 0o666 & ~current_umask())  # mkstemp made it 0600
            os.fsync(f.fileno())
            f.close()
        except BaseException:
            self.discard()
            raise
        self._file, self.tmp, self.pieces = None, None, []  # the caller's from here
        return tmp

    def _on_stop_signals(self) -> None:
        """SIGTERM/SIGHUP remove the temp file, then do what they did before."""
        if threading.current_thread() is not threading.main_thread():
            return
        for s in _STOP_SIGNALS:
            old = signal.getsignal(s)
            if old is not signal.SIG_IGN:
                self._previous[s] = old
                signal.signal(s, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        previous = self._previous.get(signum, signal.SIG_DFL)
        self.discard()  # restores the handlers that were set before
        if callable(previous):
            previous(signum, frame)
        elif previous is not signal.SIG_IGN:
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)

    def _restore_signals(self) -> None:
        """The handlers set before, where this one is still the handler (a write's handlers set
        over it restore it when the write ends; the `with` block's end then restores these)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for s, old in list(self._previous.items()):
            if signal.getsignal(s) == self._on_signal:
                signal.signal(s, old if old is not None else signal.SIG_DFL)
                del self._previous[s]
