"""Load an ONNX model from a path or stdin, fix its symbolic dimensions and infer every shape.

Weights stay where they are: external data is not read into memory (the path-based onnx APIs
keep models over 2 GB working), so partitioning a large model costs only its graph structure.
"""

from __future__ import annotations

import hashlib
import os
import stat
import sys
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError
from onnx import TensorProto

from mlso_cli.errors import InputError, UsageError

FLOAT_TYPES = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE}


@dataclass
class LoadedModel:
    """A model whose graph inputs all have static shapes and whose value_info is complete."""

    model: onnx.ModelProto
    source: str
    base_dir: Path | None
    """Folder that external-data paths are relative to (None for stdin)."""
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    dtypes: dict[str, int] = field(default_factory=dict)
    fold_notes: dict[str, str] = field(default_factory=dict)
    """First output name of each node computed from constants only that did not fold -> why
    (`frontend/fold.py`); `inspect` adds it to the node's reason."""
    bytes_sha256: str | None = None
    """sha256 of the bytes the model was parsed from, when `load_model(digest=True)` read them
    whole (None for a model over 2 GB, read by path). Why: the verdict cache names the original
    by it (pipeline/verdicts.py) instead of loading and serialising the model a second time."""

    @property
    def graph(self) -> onnx.GraphProto:
        return self.model.graph


MAX_DIM = 2**31 - 1
"""The largest dimension --input-shape accepts. Why a limit: a typo such as 4000000000 would
otherwise be taken at face value and fail much later (an allocation of tens of GB, or a crash)."""


def onnx_opset(model: onnx.ModelProto) -> int:
    """The model's default-domain opset (what ops like Softmax mean depends on it)."""
    return max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=21)


def parse_input_shapes(specs: tuple[str, ...] | list[str]) -> dict[str, tuple[int, ...]]:
    """`name=d0,d1,...` strings to a dict; every dim must be a positive integer up to MAX_DIM."""
    out: dict[str, tuple[int, ...]] = {}
    for spec in specs:
        name, sep, dims = spec.partition("=")
        if not sep or not name:
            raise UsageError(
                f"--input-shape '{spec}' is not of the form name=d0,d1,...",
                "Write e.g. --input-shape hidden=1,16,64",
            )
        try:
            shape = tuple(int(d) for d in dims.split(",")) if dims.strip() else ()
        except ValueError:
            raise UsageError(
                f"--input-shape '{spec}' has a dimension that is not an integer",
                "Give whole numbers, e.g. --input-shape hidden=1,16,64",
            ) from None
        if any(d <= 0 for d in shape):
            raise UsageError(
                f"--input-shape '{spec}' has a dimension <= 0", "Dimensions must be positive"
            )
        if any(d > MAX_DIM for d in shape):
            raise UsageError(
                f"--input-shape '{spec}' has a dimension over {MAX_DIM}",
                "Check the number; mlso supports dimensions up to 2**31-1",
            )
        out[name] = shape
    return out


def _read_stdin() -> bytes:
    """stdin's bytes; a closed stdin (`<&-`, or none at all under some launchers) is an error,
    not an AttributeError on None."""
    if sys.stdin is None:
        raise InputError(
            "stdin is closed, so no model can be read from -", "Pipe a model in, or pass its path"
        )
    try:
        return sys.stdin.buffer.read()
    except (OSError, ValueError) as exc:
        raise InputError(
            f"cannot read the model from stdin ({exc})", "Pipe a model in, or pass its path"
        ) from None


FIFO_WAIT_S = 10.0
"""How long a named FIFO may stay silent before its first byte. Why a limit: a FIFO nobody writes
to would otherwise hang the command forever; a writer started before or just after mlso (what a
FIFO is for) has written long before this."""

MAX_STREAM_BYTES = (1 << 31) - 1
"""The most a FIFO or pipe may carry: protobuf parses at most 2 GB from memory, and a larger model
keeps its weights in external data, which only a path can refer to."""

_STREAMS: dict[str, tuple[tuple[int, int], bytes]] = {}
"""Bytes already read from a FIFO or pipe, by source, with the pipe's (st_dev, st_ino). Why: a
pipe can be read only once, but commands read their model more than once (`inspect` reads the
file as it is, then loads it; `verify F F`); every read after the first gets the same bytes from
here. The identity check makes another pipe at the same /dev/fd/N a new read; a named FIFO keeps
its identity, so within one process it is read once."""


def is_stream(source: str) -> bool:
    """Was `source` read from a FIFO or pipe (`<(...)`, /dev/fd/N) rather than a regular file?
    Then its bytes are in memory only: nothing may open the path again (ONNX Runtime, the onnx
    checker), since what was read is gone from the pipe."""
    return source in _STREAMS


def _anonymous_pipe(fd: int) -> bool:
    """An unnamed pipe (bash's `<(...)`, /dev/stdin from a pipe) rather than a FIFO in a folder.
    Its writer is the process that made it, so reading it ends (EOF at the latest once that
    process exits); a named FIFO may have no writer at all."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:")
    except OSError:
        return False


def _read_stream(fd: int, source: str) -> bytes:
    """Every byte of a FIFO or pipe until EOF, read once into memory.

    The descriptor was opened with O_NONBLOCK (so that opening a FIFO without a writer returns),
    hence the poll: on Linux a FIFO that has not had a writer yet polls as not ready rather than as
    EOF, so the wait covers a writer that connects just after mlso opened it."""
    import select

    wait_ms = -1 if _anonymous_pipe(fd) else int(FIFO_WAIT_S * 1000)
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP)
    chunks: list[bytes] = []
    total = 0
    while True:
        if not poller.poll(wait_ms):
            raise InputError(
                f"{source} is a FIFO (not a regular file) and nothing was written to it within "
                f"{FIFO_WAIT_S:g} s",
                "Start the process that writes the model into it, or pass the .onnx file",
            )
        wait_ms = -1  # a writer is there: wait for the rest as long as it takes
        try:
            chunk = os.read(fd, 1 << 20)
        except BlockingIOError:
            continue
        except OSError as exc:
            raise InputError(
                f"cannot read {source}: {exc.strerror or exc}", "Check the pipe's writer"
            ) from None
        if not chunk:
            return b"".join(chunks)
        total += len(chunk)
        if total > MAX_STREAM_BYTES:
            raise InputError(
                f"{source} carries more than 2 GB, more than a model read from a pipe may hold",
                "Pass the model by path (a model this large keeps its weights in external data)",
            )
        chunks.append(chunk)


def _read_file(source: str) -> bytes | None:
    """The file's bytes, or None when it is over 2 GB (only the path-based loader reads those).

    Why open with O_NONBLOCK and fstat the descriptor before reading: a device such as /dev/zero
    must be refused, not read (it never ends), a FIFO without a writer must not block the open,
    and checking the open descriptor rather than the path leaves no window to swap the file in
    between. A FIFO or pipe (`<(...)`) is read once into memory, see `_read_stream`."""
    if source in _STREAMS:
        ident, data = _STREAMS[source]
        try:
            st = os.stat(source)
            if (st.st_dev, st.st_ino) == ident:
                return data
        except OSError:
            pass
        del _STREAMS[source]
    try:
        fd = os.open(source, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise InputError(f"{source}: no such file", "Check the path") from None
    except OSError as exc:
        raise InputError(
            f"cannot read {source}: {exc.strerror or exc}", "Check the path and its permissions"
        ) from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise InputError(f"{source} is a directory, not an ONNX model", "Pass the .onnx file")
        if stat.S_ISFIFO(st.st_mode):
            data = _read_stream(fd, source)
            _STREAMS[source] = ((st.st_dev, st.st_ino), data)
            return data
        if not stat.S_ISREG(st.st_mode):
            raise InputError(
                f"{source} is not a regular file (a device or socket); cannot read a model from it",
                "Pass an .onnx file, or - to read the model from stdin",
            )
        if st.st_size >= (1 << 31):
            return None
        try:
            return f.read()
        except OSError as exc:
            raise InputError(
                f"cannot read {source}: {exc.strerror or exc}", "Check the file"
            ) from None


def read_proto(source: str) -> tuple[onnx.ModelProto, Path | None]:
    """The model at `source` (a path, or "-" for stdin) and the folder of its external data."""
    model, base, _ = _read_model(source)
    return model, base


def _read_model(
    source: str, meanwhile: Callable[[bytes], None] | None = None
) -> tuple[onnx.ModelProto, Path | None, bytes | None]:
    """`read_proto`, and the bytes parsed (None for a model over 2 GB, read by path).
    `meanwhile` is given the bytes read before they are parsed (load_model hashes them in a
    thread while they are)."""
    data, base, where = _read_source(source)
    if meanwhile is not None and data is not None:
        meanwhile(data)
    return _parse(source, data, where), base, data


def _read_source(source: str) -> tuple[bytes | None, Path | None, str]:
    """The bytes of the model at `source` (None for a model over 2 GB: only the path-based
    loader reads it), the folder of its external data, and how errors name it."""
    if source == "-":
        data = _read_stdin()
        base = None
        where = "stdin"
    else:
        data = _read_file(source)
        # a pipe's model cannot refer to external data: the onnx checker, which must see the
        # bytes read, looks for such files relative to the working folder
        base = None if is_stream(source) else Path(source).resolve().parent
        where = source
    if data is not None and len(data) == 0:
        raise InputError(f"{where} is empty", "Pass a complete .onnx file")
    return data, base, where


def _parse(source: str, data: bytes | None, where: str) -> onnx.ModelProto:
    """The model in `data` (by path where `data` is None); InputError for what is no model."""
    try:
        if data is None:  # over 2 GB: only the path-based loader can read it
            model = onnx.load(source, load_external_data=False)
        else:
            model = onnx.load_model_from_string(data)
    except (DecodeError, RuntimeError, ValueError, OSError) as exc:
        raise InputError(
            f"{where} is not a readable ONNX model ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'parse failed'})",
            "The file may be truncated or corrupt; export or download it again",
        ) from None
    if model.ir_version == 0 or not model.HasField("graph") or len(model.graph.node) == 0:
        raise InputError(
            f"{where} does not hold an ONNX model (no IR version or no graph nodes)",
            "The file may be truncated or corrupt; export or download it again",
        )
    return model


def uses_external_data(model: onnx.ModelProto) -> bool:
    """Whether any initializer keeps its bytes in an external file."""
    return any(t.data_location == TensorProto.EXTERNAL for t in model.graph.initializer)


def _check_external_files(model: onnx.ModelProto, base: Path | None, where: str) -> None:
    for t in model.graph.initializer:
        if t.data_location != TensorProto.EXTERNAL:
            continue
        if base is None:
            raise InputError(
                "a model read from stdin, a FIFO or a pipe refers to external data",
                "Pass the model by path so its external data files can be found",
            )
        info = {e.key: e.value for e in t.external_data}
        loc = info.get("location")
        if loc is None or not (base / loc).exists():
            raise InputError(
                f"{where}: external data file '{loc}' for initializer '{t.name}' is missing",
                f"Put it next to the model in {base}",
            )
        _check_external_file(base / loc, info, t.name, where)


def _check_external_file(path: Path, info: dict[str, str], tensor: str, where: str) -> None:
    """Refuse an external-data file that is not a regular file (a FIFO would hang the read) or
    too short for its tensor (a truncated download), before any command reads weights."""
    try:
        st = path.stat()
        end = int(info.get("offset") or 0) + int(info.get("length") or 0)
    except (OSError, ValueError) as exc:
        raise InputError(
            f"{where}: cannot use external data '{path.name}' for '{tensor}' ({exc})",
            "Check the file and the model's external-data entries",
        ) from None
    if not stat.S_ISREG(st.st_mode):
        raise InputError(
            f"{where}: external data '{path.name}' is not a regular file",
            "Replace it with the weights file",
        )
    if end > st.st_size:
        raise InputError(
            f"{where}: external data file '{path.name}' is truncated ({st.st_size} bytes, tensor '{tensor}' needs {end})",
            "Export or download the model and its weights again",
        )


def _apply_input_shapes(model: onnx.ModelProto, fixed: dict[str, tuple[int, ...]]) -> None:
    inits = {t.name for t in model.graph.initializer}
    inputs = {i.name: i for i in model.graph.input if i.name not in inits}
    for name, shape in fixed.items():
        if name not in inputs:
            raise UsageError(
                f"--input-shape names '{name}', which is not a graph input",
                f"Graph inputs are: {', '.join(inputs) or '(none)'}",
            )
        tt = inputs[name].type.tensor_type
        rank = len(tt.shape.dim)
        if tt.HasField("shape") and rank != len(shape):
            raise UsageError(
                f"--input-shape {name} has {len(shape)} dims but the input has rank {rank}",
                f"Give {rank} dimensions",
            )
        tt.shape.ClearField("dim")
        for d in shape:
            tt.shape.dim.add().dim_value = d


def _static_input_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    inits = {t.name for t in model.graph.initializer}
    out: dict[str, tuple[int, ...]] = {}
    for inp in model.graph.input:
        if inp.name in inits:
            continue
        tt = inp.type.tensor_type
        if not tt.HasField("shape"):
            raise UsageError(
                f"input '{inp.name}' has no shape",
                f"Fix it with --input-shape {inp.name}=d0,d1,...",
            )
        dims = []
        for i, d in enumerate(tt.shape.dim):
            if d.HasField("dim_value") and d.dim_value > 0:
                dims.append(d.dim_value)
                continue
            label = f"'{d.dim_param}'" if d.dim_param else "unknown"
            example = ",".join(
                str(x.dim_value) if x.HasField("dim_value") and x.dim_value > 0 else "N"
                for x in tt.shape.dim
            )
            raise UsageError(
                f"input '{inp.name}' has an open dimension {label} (dim {i})",
                f"Fix it with --input-shape {inp.name}={example}, replacing N",
            )
        out[inp.name] = tuple(dims)
    return out


def infer_shapes(model: onnx.ModelProto, *, in_place: bool = False) -> onnx.ModelProto:
    """onnx shape inference with data propagation; never fails the load on unknown ops.
    `in_place`: for a model the caller owns (a load): `model` itself is changed and returned, and
    the C++ pass sees it without its weights (frontend/inference.py), so a large model's bytes
    are not copied for it; else a new model."""
    from mlso_cli.frontend.inference import infer, infer_in_place

    try:
        return infer_in_place(model) if in_place else infer(model)
    except Exception as exc:  # an inconsistent model: report it rather than crash
        raise InputError(
            f"shape inference failed: {str(exc).splitlines()[0]}",
            "The model is inconsistent; check it with onnx.checker",
        ) from None


def collect_types(model: onnx.ModelProto) -> tuple[dict[str, tuple[int, ...]], dict[str, int]]:
    """Static shapes and element types of every tensor shape inference could resolve."""
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, int] = {}
    g = model.graph
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        tt = vi.type.tensor_type
        if tt.elem_type:
            dtypes[vi.name] = tt.elem_type
        if tt.HasField("shape") and all(d.HasField("dim_value") for d in tt.shape.dim):
            shapes[vi.name] = tuple(d.dim_value for d in tt.shape.dim)
    for t in g.initializer:
        shapes[t.name] = tuple(t.dims)
        dtypes[t.name] = t.data_type
    for n in g.node:
        if n.op_type == "Constant" and n.domain in ("", "ai.onnx"):
            for a in n.attribute:
                if a.name == "value":
                    shapes[n.output[0]] = tuple(a.t.dims)
                    dtypes[n.output[0]] = a.t.data_type
    return shapes, dtypes


def available_memory() -> int | None:
    """Bytes of memory available now (Linux MemAvailable), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def external_data_bytes(model: onnx.ModelProto) -> int:
    total = 0
    for t in model.graph.initializer:
        if t.data_location == TensorProto.EXTERNAL:
            total += int(next((e.value for e in t.external_data if e.key == "length"), 0) or 0)
    return total


def require_memory(nbytes: int, what: str) -> None:
    """Fail before loading weights that cannot fit, instead of being killed half-way."""
    free = available_memory()
    if free is not None and nbytes > 0.9 * free:
        raise InputError(
            f"{what} needs {nbytes / 2**30:.1f} GiB of memory but {free / 2**30:.1f} GiB is available",
            "Run on a machine with more memory, or free some",
        )


def with_weights(loaded: LoadedModel) -> onnx.ModelProto:
    """The model with external data read into memory (for ONNX Runtime sessions from bytes)."""
    model = loaded.model
    if loaded.base_dir is None or not any(
        t.data_location == TensorProto.EXTERNAL for t in model.graph.initializer
    ):
        return model
    require_memory(2 * external_data_bytes(model), f"loading {loaded.source} with its weights")
    m = onnx.ModelProto()
    m.CopyFrom(model)
    try:
        onnx.load_external_data_for_model(m, str(loaded.base_dir))
    except (OSError, ValueError) as exc:  # changed on disk since the load checked it
        raise InputError(
            f"cannot read the weights of {loaded.source}: {str(exc).splitlines()[0]}",
            "Export or download the model and its weights again",
        ) from None
    return m


def loaded_from_proto(model: onnx.ModelProto, source: str = "<memory>") -> LoadedModel:
    """A LoadedModel for an in-memory model whose inputs are already static (no folding)."""
    _static_input_shapes(model)
    model = infer_shapes(model)
    shapes, dtypes = collect_types(model)
    return LoadedModel(model=model, source=source, base_dir=None, shapes=shapes, dtypes=dtypes)


def _hash_meanwhile(data: bytes) -> Future[str]:
    """The sha256 of `data`, computed in a thread while the model is parsed and checked. Why:
    hashlib lets go of the GIL while it hashes a large buffer, so on a second core the 478 MB of
    a Phi-3 export are hashed in the parse's time rather than after it (a third of a second)."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(1, thread_name_prefix="mlso-sha256")
    try:
        return pool.submit(lambda: hashlib.sha256(data).hexdigest())
    finally:
        pool.shutdown(wait=False)  # the hash still runs; the pool's thread ends with it


_ITEMSIZE = {
    TensorProto.FLOAT: 4,
    TensorProto.FLOAT16: 2,
    TensorProto.BFLOAT16: 2,
    TensorProto.DOUBLE: 8,
    TensorProto.INT8: 1,
    TensorProto.UINT8: 1,
    TensorProto.INT16: 2,
    TensorProto.UINT16: 2,
    TensorProto.INT32: 4,
    TensorProto.UINT32: 4,
    TensorProto.INT64: 8,
    TensorProto.UINT64: 8,
    TensorProto.BOOL: 1,
}
"""Bytes per element of the types whose weights the checker's stand-ins may replace (whole
bytes per element; packed and float8 types are left to the checker itself)."""

_VALUE_FIELDS = (
    "float_data",
    "int32_data",
    "string_data",
    "int64_data",
    "double_data",
    "uint64_data",
)
"""The TensorProto fields other than raw_data that hold values (the checker wants one)."""


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def _wire_fields(buf: bytes, start: int, end: int):
    """(field number, wire type, start, end of its value) of each field of the message in
    buf[start:end]; ValueError for what is not protobuf wire format (groups included)."""
    i = start
    while i < end:
        key, i = _varint(buf, i)
        wire = key & 7
        if wire == 0:
            j = _varint(buf, i)[1]
        elif wire == 1:
            j = i + 8
        elif wire == 5:
            j = i + 4
        elif wire == 2:
            n, i = _varint(buf, i)
            j = i + n
        else:
            raise ValueError("a group or an invalid wire type")
        if j > end:
            raise ValueError("a field runs past its message")
        yield key >> 3, wire, i, j
        i = j


def _raw_data_sizes(data: bytes) -> list[tuple[bytes, int | None]] | None:
    """Each graph initializer of the ModelProto in `data`, in order: its name (UTF-8) and the
    size of its raw_data (None: it has none), read from the wire without copying any weight.
    None where the bytes are not that plain layout: the graph, or a tensor's name or raw_data,
    given more than once (a parser merges those), a field of an unexpected wire type."""
    try:
        graph = [(w, a, b) for n, w, a, b in _wire_fields(data, 0, len(data)) if n == 7]
        if len(graph) != 1 or graph[0][0] != 2:
            return None
        out: list[tuple[bytes, int | None]] = []
        for n, w, a, b in _wire_fields(data, graph[0][1], graph[0][2]):
            if n != 5:
                continue
            if w != 2:
                return None
            names, sizes = [], []
            for fn, fw, fa, fb in _wire_fields(data, a, b):
                if fn in (8, 9) and fw != 2:
                    return None
                if fn == 8:
                    names.append(data[fa:fb])
                elif fn == 9:
                    sizes.append(fb - fa)
            if len(names) > 1 or len(sizes) > 1:
                return None
            out.append((names[0] if names else b"", sizes[0] if sizes else None))
        return out
    except (ValueError, IndexError):
        return None


def _stand_in_size(t: onnx.TensorProto, raw_size: int | None) -> int:
    """The bytes of one element of `t` when a stand-in may replace it in the checker's view,
    else 0. Why this is safe: onnx's checker reads of an initializer its type, its value
    fields, its data location, its dims and the size of its raw_data, never its bytes (but the
    padding of packed sub-byte types, which are not replaced); a stand-in has the same name, type
    and fields, and `t` is checked here for all the checker would check: inline, raw_data alone
    and exactly the size its dims and type need, a byte-sized type, every dim positive."""
    from mlso_cli.frontend.inference import large_weight

    if raw_size is None or not large_weight(t) or t.data_location == TensorProto.EXTERNAL:
        return 0
    itemsize = _ITEMSIZE.get(t.data_type, 0)
    if not itemsize or any(d <= 0 for d in t.dims):
        return 0
    if any(len(getattr(t, f)) for f in _VALUE_FIELDS):
        return 0
    n = 1
    for d in t.dims:
        n *= int(d)
    return itemsize if raw_size == n * itemsize else 0


def _checker_view(model: onnx.ModelProto, data: bytes) -> onnx.ModelProto | None:
    """What onnx's checker is given instead of the bytes read: `model` with each large weight
    replaced by a stand-in of one element per dim (`_stand_in_size`), its raw_data's size read
    from `data`. None when no weight can be replaced or `data` is not the plain layout.

    Why: the checker parses the bytes it is given into a C++ model, every weight byte copied
    twice (0.6 s of a cached rerun on a 478 MB Phi-3 export, 1.1 s on a busy machine); the
    view's bytes are the graph and a few bytes a weight."""
    from mlso_cli.frontend.inference import copy_except, copy_fields, large_weight

    inits = model.graph.initializer
    if not any(large_weight(t) for t in inits):
        return None
    sizes = _raw_data_sizes(data)
    if sizes is None or len(sizes) != len(inits):
        return None
    view = onnx.ModelProto()
    copy_except(model, view, "graph")
    copy_except(model.graph, view.graph, "initializer")
    replaced = 0
    for t, (name, size) in zip(inits, sizes):
        if name != t.name.encode():
            return None
        itemsize = _stand_in_size(t, size)
        if not itemsize:
            view.graph.initializer.append(t)
            continue
        stand_in = view.graph.initializer.add()
        copy_fields(t, stand_in, lambda fd: fd.name not in ("raw_data", "dims"))
        stand_in.dims.extend([1] * len(t.dims))
        stand_in.raw_data = bytes(itemsize)
        replaced += 1
    return view if replaced else None


def _check(model: onnx.ModelProto, source: str, where: str, data: bytes | None) -> None:
    """onnx's checker on the model read. `data`: the bytes it was parsed from, checked as they
    are (the checker would otherwise serialise the model, or read and parse the file again), or
    first as the view `_checker_view` makes of them: when the view passes, so do they; when it
    does not, the bytes are checked, so a refusal names what the checker finds in the model
    read. `data` is None where the checker must see the file's folder (external data) or the
    model is over 2 GB: then by path, except for a pipe, whose bytes are gone from it (the model
    is serialised)."""
    if data is not None:
        view = _checker_view(model, data)
        if view is not None:
            try:
                onnx.checker.check_model(view)
                return
            except onnx.checker.ValidationError:
                pass
        what: onnx.ModelProto | bytes | str = data
    else:
        what = model if source == "-" or is_stream(source) else source
    try:
        onnx.checker.check_model(what)
    except onnx.checker.ValidationError as exc:
        first = next((ln for ln in str(exc).splitlines() if ln.strip()), "invalid model")
        raise InputError(
            f"{where} is not a valid ONNX model: {first}", "Re-export the model"
        ) from None


def load_model(
    source: str,
    input_shapes: dict[str, tuple[int, ...]] | None = None,
    *,
    fold: bool = True,
    digest: bool = False,
) -> LoadedModel:
    """Read, validate, fix shapes, fold shape arithmetic and infer shapes. `digest`: also hash
    the bytes read (LoadedModel.bytes_sha256).

    Raises InputError for unreadable files and UsageError for open dimensions.
    """
    from mlso_cli.frontend.fold import fold_with_notes

    where = "stdin" if source == "-" else source
    # hashed while the bytes are parsed and checked (hashlib lets go of the GIL)
    hashing: list[Future[str]] = []
    try:
        model, base, data = _read_model(
            source, (lambda d: hashing.append(_hash_meanwhile(d))) if digest else None
        )
        external = uses_external_data(model)
        if external:
            _check_external_files(model, base, where)
        _check(model, source, where, None if external else data)
    finally:
        sha = hashing[0].result() if hashing else None
    del data
    _apply_input_shapes(model, input_shapes or {})
    _static_input_shapes(model)
    model = infer_shapes(model, in_place=True)
    notes: dict[str, str] = {}
    if fold:
        folded = fold_with_notes(model, base)
        model, notes = infer_shapes(folded.model, in_place=True), folded.notes
    shapes, dtypes = collect_types(model)
    return LoadedModel(
        model=model,
        source=where,
        base_dir=base,
        shapes=shapes,
        dtypes=dtypes,
        fold_notes=notes,
        bytes_sha256=sha,
    )
