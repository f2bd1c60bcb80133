"""Write an ONNX model atomically, never over its input, with external data when needed.

Why: a crash, Ctrl-C or a full disk must never leave a truncated model where a good one (or the
input) was. Everything is written to a temporary file in the destination folder, flushed to disk,
then renamed into place (rename is atomic within one file system). Models over 2 GB cannot be
serialized as one protobuf, and a model whose weights live in external files must not point at
the input's files (a later edit of one would corrupt the other), so those are written with their
own external-data file next to the output, also temp-then-rename. Kernel binaries (mlso_bin_*)
stay inline so that checking a model never needs its weights.
"""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError
from onnx import TensorProto, external_data_helper

from mlso_cli.errors import InputError
from mlso_cli.package.rewrite import BINARY_PREFIX

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
        if path.stat().st_size > _SMALL_MODEL:
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


def _fsync_write(path: str, chunks: Iterator[bytes] | list[bytes]) -> None:
    with open(path, "wb") as f:
        for chunk in chunks:
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())


def _temp_in(folder: Path, name: str) -> str:
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    os.close(fd)
    return tmp


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
) -> Path:
    """Write `model` to out_path atomically and return the path.

    input_path: the model it came from; never overwritten, and the folder its external data is
    read from. external_data: force (True) or forbid (False) an external-data file; by default
    one is written when the model is over 2 GB or its input kept weights in external files.
    """
    out = Path(out_path)
    if out.is_dir():
        raise InputError(
            f"{out} is a directory", "Give a file name for the output model, e.g. -o fast.onnx"
        )
    inp = Path(input_path) if input_path is not None else None
    if inp is not None and _same_file(out, inp):
        raise InputError(
            f"writing {out} would overwrite the input model {inp}",
            "Choose another output path with -o",
        )

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
    if external_data is None:
        external_data = has_external or bool(input_files) or _too_big(model)
    use_external = external_data
    if has_external and not use_external:
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
    temps: list[str] = []
    data_final: Path | None = None
    data_placed = False
    try:
        if use_external:
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
            chunks = _externalize(work, data_name)
            data_tmp = _temp_in(folder, data_name)
            temps.append(data_tmp)
            _fsync_write(data_tmp, chunks)
            del chunks
            payload = work.SerializeToString()
            model_tmp = _temp_in(folder, out.name)
            temps.append(model_tmp)
            _fsync_write(model_tmp, [payload])
            data_final = folder / data_name
            os.replace(data_tmp, data_final)
            data_placed = True
            os.replace(model_tmp, out)
        else:
            payload = model.SerializeToString()
            model_tmp = _temp_in(folder, out.name)
            temps.append(model_tmp)
            _fsync_write(model_tmp, [payload])
            os.replace(model_tmp, out)
    except BaseException as exc:
        for tmp in temps:
            if os.path.exists(tmp):
                os.unlink(tmp)
        if data_placed and data_final is not None and data_final.exists():
            data_final.unlink()  # its model never landed; do not leave a half-written pair
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
        raise
    return out
