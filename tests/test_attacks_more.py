"""The attacks of the chain-of-trust issue that had no test yet, each written as the attack.

1. A zero-size weight, or a region with a tensor over 2**31-1 elements (also only inside a
   decomposed node: Attention's score matrix), used to abort `optimize` in the search or in
   codegen. Now `optimize` exits 0 and keeps those nodes as they are, `inspect --json` gives
   each one's reason, and `verify`/`bench` end in one line, not a traceback. The models are
   shapes only: every CLI run here has its address space capped (RLIMIT_AS), so an attempt to
   allocate such a tensor fails fast with MemoryError instead of taking the machine's memory.
2. A model given as a FIFO or as bash process substitution (`<(cat model.onnx)`, a /dev/fd/N
   pipe) loads in `inspect`, `optimize` and `verify`, read once into memory.
3. Attacks the sweep of the issue's list found uncovered: parts of another model's kernel
   spliced in (binary, plan and hashes; or the whole node), a causal mask set to all ones, a
   μGraph whose input names are not its node's inputs, a fallback body whose internal tensor is
   named like an input, a character device as `-o` with --force as root, and the field check's
   per-trial bound on GPT-2-sized regions.

Every attack here fails as it should. (The sweep found seven that succeeded: MemoryError
tracebacks in bench and verify, optimize hanging on a FIFO, and the two μGraph/body name attacks
under --numeric and --no-algebraic; cli.py, package/write.py, runtime/check.py and
bench/harness.py were fixed for them.)
"""

from __future__ import annotations

import json
import math
import os
import resource
import shlex
import stat
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.helpers import ROOT, SMALL

GQA = next(p for p in SMALL if p.stem == "gqa")
FAST = ["--max-states", "2000", "--jobs", "1", "--min-speedup", "0"]
ADDRESS_SPACE = 8 << 30
"""Cap on each CLI run's address space: far below the 8-32 GiB the huge models here would take,
far above what mlso needs for them when it does not allocate them."""


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


def _cli(*args: str, shell: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """mlso in a subprocess with its address space capped; `shell`: a bash command line instead,
    where `mlso` is the CLI (for `<(...)`)."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
    }
    mlso = [sys.executable, "-m", "mlso_cli"]
    if shell:
        cmd = ["bash", "-c", shell.replace("mlso ", shlex.join(mlso) + " ")]
    else:
        cmd = [*mlso, *args]
    return subprocess.run(
        cmd,
        cwd=ROOT,
        env=env,
        capture_output=True,
        timeout=timeout,
        preexec_fn=_limit_memory,
    )


def _ok(r: subprocess.CompletedProcess) -> None:
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    assert b"Traceback" not in r.stderr


def _error_line(r: subprocess.CompletedProcess) -> str:
    """The run's one error line; ONNX Runtime's own log lines may precede it, never a traceback."""
    err = r.stderr.decode()
    assert "Traceback" not in err, err[-3000:]
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("mlso: error:")]
    assert len(lines) == 1 and err.strip().splitlines()[-1] == lines[0], err[-3000:]
    return lines[0]


def _save(model: onnx.ModelProto, path: Path) -> Path:
    model.ir_version = 10
    onnx.save(model, str(path))
    return path


def _vi(name: str, shape, dtype=TensorProto.FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, shape)


def _model(nodes, inputs, outputs, inits=(), opset: int = 18) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "attack", inputs, outputs, list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _left_out(r: subprocess.CompletedProcess) -> dict[str, str]:
    rows = [json.loads(x) for x in r.stdout.decode().splitlines()]
    return {x["node"]: x["reason"] for x in rows if x["type"] == "left_out"}


def _regions(r: subprocess.CompletedProcess) -> list[list[str]]:
    rows = [json.loads(x) for x in r.stdout.decode().splitlines()]
    return [x["nodes"] for x in rows if x["type"] == "region"]


def _signature(model: onnx.ModelProto) -> list[tuple]:
    return [(n.op_type, n.domain, list(n.input), list(n.output)) for n in model.graph.node]


def _by_name(model: onnx.ModelProto) -> dict[str, tuple]:
    return {n.name: s for n, s in zip(model.graph.node, _signature(model))}


# ---- 1. zero-size weights and tensors over 2**31-1 elements -------------------------------------


def _zero_weight(path: Path) -> Path:
    """x @ w with w of shape (64, 0), then Relu: empty tensors. A Sigmoid * x branch beside it
    is an ordinary region and must still be found."""
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["m"], name="empty_mm"),
        helper.make_node("Relu", ["m"], ["y"], name="empty_relu"),
        helper.make_node("Sigmoid", ["x"], ["s"], name="sig"),
        helper.make_node("Mul", ["s", "x"], ["z"], name="silu"),
    ]
    model = _model(
        nodes,
        [_vi("x", [2, 64])],
        [_vi("y", [2, 0]), _vi("z", [2, 64])],
        [numpy_helper.from_array(np.ones((64, 0), np.float32), "w")],
    )
    return _save(model, path)


def _huge_elementwise(path: Path, dynamic: bool = False) -> Path:
    """A (65536, 65536) fp16 input through Relu, Mul, Add: 2**32 elements (8 GiB) per tensor."""
    dims = ["n", "m"] if dynamic else [65536, 65536]
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="relu"),
        helper.make_node("Mul", ["a", "two"], ["b"], name="mul"),
        helper.make_node("Add", ["b", "x"], ["y"], name="add"),
    ]
    model = _model(
        nodes,
        [_vi("x", dims, TensorProto.FLOAT16)],
        [_vi("y", dims, TensorProto.FLOAT16)],
        [numpy_helper.from_array(np.array(2.0, np.float16), "two")],
    )
    return _save(model, path)


def _huge_scores(path: Path) -> Path:
    """Causal Attention over 65536 positions, one head of 8: Q, K, V and the output are 512 Ki
    elements each, but the score matrix lifting decomposes it into has 2**32 (and the causal
    mask lifting builds in memory would take 16 GiB)."""
    shape = [1, 1, 65536, 8]
    nodes = [
        helper.make_node("Attention", ["q", "k", "v"], ["o"], is_causal=1, name="attn"),
        helper.make_node("Relu", ["o"], ["y"], name="relu_after"),
    ]
    ins = [_vi(n, shape, TensorProto.FLOAT16) for n in ("q", "k", "v")]
    model = _model(nodes, ins, [_vi("y", shape, TensorProto.FLOAT16)], opset=23)
    return _save(model, path)


SIZE_CASES = {  # name: (builder, extra args, {node: words its reason must hold})
    "zero_weight": (
        _zero_weight,
        [],
        {
            "empty_mm": "tensor 'w' has no elements (shape [64, 0])",
            "empty_relu": "tensor 'm' has no elements",
        },
    ),
    "huge_static": (
        _huge_elementwise,
        [],
        {
            n: "4294967296 elements (shape [65536, 65536]), over 2^31-1"
            for n in ("relu", "mul", "add")
        },
    ),
    "huge_by_input_shape": (
        lambda p: _huge_elementwise(p, dynamic=True),
        ["--input-shape", "x=65536,65536"],
        {n: "over 2^31-1" for n in ("relu", "mul", "add")},
    ),
    "huge_scores": (
        _huge_scores,
        [],
        {
            n: "region could not be lifted: Attention: its score matrix has 4294967296 elements"
            for n in ("attn", "relu_after")
        },
    ),
}


@pytest.mark.parametrize("case", sorted(SIZE_CASES))
def test_inspect_gives_the_reason_a_size_leaves_nodes_out(tmp_path, case):
    build, extra, reasons = SIZE_CASES[case]
    path = build(tmp_path / f"{case}.onnx")
    r = _cli("inspect", str(path), "--json", *extra)
    _ok(r)
    left = _left_out(r)
    for node, words in reasons.items():
        assert words in left[node], (node, left[node])
    regions = _regions(r)
    assert regions == ([["sig", "silu"]] if case == "zero_weight" else [])


@pytest.mark.parametrize("case", sorted(SIZE_CASES))
def test_optimize_keeps_the_nodes_a_size_leaves_out(tmp_path, case):
    """It aborted before: ZeroDivisionError in the search (zero size), "has more than 2^31-1
    elements" from codegen (exit 1), or a 16 GiB causal mask built while lifting."""
    build, extra, reasons = SIZE_CASES[case]
    path = build(tmp_path / f"{case}.onnx")
    out = tmp_path / "out.onnx"
    r = _cli("optimize", str(path), "-o", str(out), *extra, *FAST)
    _ok(r)
    before, after = _by_name(onnx.load(str(path))), _by_name(onnx.load(str(out)))
    for node in reasons:  # left as they were: same op, same tensors, not in a kernel
        assert after[node] == before[node]


def test_verify_and_bench_on_a_zero_size_model_pass(tmp_path):
    path = _zero_weight(tmp_path / "zero.onnx")
    out = tmp_path / "out.onnx"
    _ok(_cli("optimize", str(path), "-o", str(out), *FAST))
    _ok(_cli("verify", str(path), str(out), "--samples", "1"))
    _ok(_cli("bench", str(path), str(out), "--repeats", "2", "--iters", "2"))


def test_verify_refuses_a_huge_input_for_its_memory_in_one_line(tmp_path):
    """8 GiB inputs: verify needs 8x that (inputs, outputs, the fp64 reference) and says so."""
    from mlso_cli.frontend.load import available_memory

    free = available_memory()
    if free is None or free > 70 << 30:
        pytest.skip("this machine has the memory to try; the cap would make it a MemoryError")
    path = _huge_elementwise(tmp_path / "huge.onnx")
    r = _cli("verify", str(path), str(path))
    assert r.returncode == 1
    assert "GiB of memory" in _error_line(r)


@pytest.mark.parametrize(
    ("command", "build"),
    [("bench", _huge_elementwise), ("verify", _huge_scores)],
    ids=["bench-huge-input", "verify-huge-scores"],
)
def test_bench_and_verify_on_huge_models_end_in_one_line(tmp_path, command, build):
    path = build(tmp_path / "huge.onnx")
    extra = ["--repeats", "2", "--iters", "2"] if command == "bench" else ["--samples", "1"]
    r = _cli(command, str(path), str(path), *extra)
    assert r.returncode == 1
    _error_line(r)


def test_bench_on_huge_scores_ends_in_one_line(tmp_path):
    """ONNX Runtime fails to allocate the score matrix; its own log line may precede mlso's."""
    path = _huge_scores(tmp_path / "huge.onnx")
    r = _cli("bench", str(path), str(path), "--repeats", "2", "--iters", "2")
    assert r.returncode == 1
    assert "ONNX Runtime cannot run" in _error_line(r)


# ---- 2. FIFOs and process substitution --------------------------------------------------------


def _feed_fifo(path: Path, data: bytes, times: int = 1) -> threading.Thread:
    """A FIFO at `path` and a thread that writes `data` into it `times` times (each write waits
    for a reader to open it, as a producer started before mlso would)."""
    os.mkfifo(path)

    def write() -> None:
        for _ in range(times):
            try:
                with open(path, "wb") as f:
                    f.write(data)
            except OSError:  # the reader went away (a failing test): nothing to do
                return

    t = threading.Thread(target=write, daemon=True)
    t.start()
    return t


def _release(path: Path, t: threading.Thread) -> None:
    """Let a writer still waiting for a reader go (when mlso did not read it)."""
    if t.is_alive():
        os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
        t.join(5)


@pytest.mark.parametrize("command", ["inspect", "optimize", "verify"])
def test_a_model_in_a_fifo_loads(tmp_path, command):
    fifo = tmp_path / "model.onnx"
    t = _feed_fifo(fifo, GQA.read_bytes())
    try:
        if command == "inspect":
            r = _cli("inspect", str(fifo), "--json")
            _ok(r)
            assert r.stdout == _cli("inspect", str(GQA), "--json").stdout
        elif command == "optimize":
            out = tmp_path / "out.onnx"
            _ok(_cli("optimize", str(fifo), "-o", str(out), *FAST, timeout=60))
            assert _signature(onnx.load(str(out))) == _signature(
                onnx.load(str(_optimized(tmp_path)))
            )
        else:
            _ok(_cli("verify", str(fifo), str(GQA), "--samples", "1"))
    finally:
        _release(fifo, t)


def _optimized(tmp_path: Path) -> Path:
    out = tmp_path / "from_file.onnx"
    _ok(_cli("optimize", str(GQA), "-o", str(out), *FAST))
    return out


# slow (25 s: three CLI runs that search); CI runs the slow set too
@pytest.mark.slow
def test_process_substitution_loads_in_inspect_optimize_and_verify(tmp_path):
    g = str(GQA)
    r = _cli(shell=f"mlso inspect <(cat {g}) --json")
    _ok(r)
    assert r.stdout == _cli("inspect", g, "--json").stdout
    out = tmp_path / "out.onnx"
    _ok(_cli(shell=f"mlso optimize <(cat {g}) -o {out} {' '.join(FAST)}"))
    assert _signature(onnx.load(str(out))) == _signature(onnx.load(str(_optimized(tmp_path))))
    _ok(_cli(shell=f"mlso verify <(cat {g}) <(cat {out}) --samples 1"))


@pytest.mark.parametrize(
    ("producer", "word"),
    [("true", "is empty"), ("head -c 300 {g}", "not a readable ONNX model")],
    ids=["empty", "truncated"],
)
def test_a_broken_model_through_a_pipe_is_one_line_exit_1(producer, word):
    r = _cli(shell=f"mlso inspect <({producer.format(g=GQA)})")
    assert r.returncode == 1
    assert word in _error_line(r)


def _external(tmp_path: Path) -> Path:
    path = tmp_path / "ext.onnx"
    model = _model(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        [_vi("x", [2, 64])],
        [_vi("y", [2, 64])],
        [numpy_helper.from_array(np.ones((64, 64), np.float32), "w")],
    )
    model.ir_version = 10
    onnx.save(model, str(path), save_as_external_data=True, location="ext.data", size_threshold=0)
    return path


def test_external_data_through_a_pipe_or_fifo_is_refused_in_one_line(tmp_path):
    """A pipe's bytes are in memory only, and the onnx checker looks for external data of a
    model in memory relative to the working folder: such a model must be passed by path."""
    path = _external(tmp_path)
    r = _cli(shell=f"mlso inspect <(cat {path})")
    assert r.returncode == 1
    assert "a FIFO or a pipe refers to external data" in _error_line(r)
    fifo = tmp_path / "fifo.onnx"
    t = _feed_fifo(fifo, path.read_bytes())
    try:
        r = _cli("verify", str(fifo), str(path), "--samples", "1")
        assert r.returncode == 1
        assert "a FIFO or a pipe refers to external data" in _error_line(r)
    finally:
        _release(fifo, t)


def test_the_same_fifo_given_twice_is_read_once(tmp_path):
    """`verify F F`: the second read gets the bytes of the first (the pipe is empty by then)."""
    fifo = tmp_path / "model.onnx"
    t = _feed_fifo(fifo, GQA.read_bytes())
    try:
        _ok(_cli("verify", str(fifo), str(fifo), "--samples", "1"))
    finally:
        _release(fifo, t)


def test_a_character_device_is_still_refused_before_any_read():
    r = _cli("inspect", "/dev/zero")
    assert r.returncode == 1
    assert "not a regular file" in _error_line(r)


# ---- 3. attacks the sweep found without a test --------------------------------------------------


def _mlso_node(model: onnx.ModelProto) -> onnx.NodeProto:
    return next(n for n in model.graph.node if n.domain == "ai.mlso")


def _attr(node: onnx.NodeProto, name: str) -> onnx.AttributeProto:
    return next(a for a in node.attribute if a.name == name)


def _packaged(path: Path, program=None) -> onnx.ModelProto:
    """`path`'s one region packaged with its lifted μGraph (or `program`) and a placeholder
    binary: verified with --trust-binary, no nvcc time."""
    from mlso_cli.frontend.analyse import analyse
    from mlso_cli.frontend.load import load_model
    from tests.fixtures.packaging import package_fixture, placeholder

    if program is None:
        (lr,) = analyse(load_model(str(path))).lifted
        program = lr.graph
    return package_fixture(str(path), program, placeholder(program))


def _verify(a: Path, b: Path, *extra: str) -> subprocess.CompletedProcess:
    return _cli("verify", str(a), str(b), "--samples", "1", "--trust-binary", *extra)


def _ln_softmax(path: Path, eps: float = 1e-5, scale: float = 0.125, axis: int = -1) -> Path:
    """LayerNormalization, a projection, a scale and a Softmax: one region. The A' variants
    differ from A only in eps, the scale or the softmax axis; the weights are the same."""
    rng = np.random.default_rng(7)
    nodes = [
        helper.make_node("LayerNormalization", ["x", "g", "b"], ["n"], axis=-1, epsilon=eps),
        helper.make_node("MatMul", ["n", "w"], ["m"]),
        helper.make_node("Mul", ["m", "scale"], ["s"]),
        helper.make_node("Softmax", ["s"], ["y"], axis=axis),
    ]
    inits = [
        numpy_helper.from_array(rng.standard_normal(64).astype(np.float32), "g"),
        numpy_helper.from_array(rng.standard_normal(64).astype(np.float32), "b"),
        numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32) / 8, "w"),
        numpy_helper.from_array(np.array(scale, np.float32), "scale"),
    ]
    model = _model(nodes, [_vi("x", [1, 16, 64])], [_vi("y", [1, 16, 64])], inits)
    return _save(model, path)


A_PRIME = {
    "softmax_wrong_axis": {"axis": 1},
    "eps_1e-3": {"eps": 1e-3},
    "scale_1_over_sqrt_65": {"scale": 1 / math.sqrt(65)},
}
SPLICED = {  # what is taken from optimize(A')'s node: the chain check or the field check sees it
    "binary_plan_hashes": (("binary_sha256", "source_sha256", "plan"), "source_sha256"),
    "whole_node": (("binary_sha256", "source_sha256", "plan", "ugraph"), "does not compute"),
}


def _splice(target: onnx.ModelProto, donor: onnx.ModelProto, attrs: tuple[str, ...]) -> None:
    """Copy the donor kernel's binary and the attributes `attrs` into the target's kernel."""
    node, other = _mlso_node(target), _mlso_node(donor)
    for name in attrs:
        _attr(node, name).s = _attr(other, name).s
    binary = next(t for t in target.graph.initializer if t.name == node.input[0])
    binary.CopyFrom(next(t for t in donor.graph.initializer if t.name == other.input[0]))
    binary.name = node.input[0]


def test_the_honest_packaging_of_the_splice_target_passes(tmp_path):
    a = _ln_softmax(tmp_path / "a.onnx")
    b = _save(_packaged(a), tmp_path / "b.onnx")
    _ok(_verify(a, b))


@pytest.mark.parametrize("parts", sorted(SPLICED))
@pytest.mark.parametrize("variant", sorted(A_PRIME))
def test_parts_spliced_from_the_kernel_of_a_slightly_different_model_fail(tmp_path, variant, parts):
    """B = optimize(A) with its kernel's binary, plan and hashes (or the whole node, μGraph
    included) taken from optimize(A'), A' differing in one detail: exit 3 either way."""
    a = _ln_softmax(tmp_path / "a.onnx")
    a_prime = _ln_softmax(tmp_path / "a_prime.onnx", **A_PRIME[variant])
    b = _packaged(a)
    attrs, word = SPLICED[parts]
    _splice(b, _packaged(a_prime), attrs)
    r = _verify(a, _save(b, tmp_path / "b.onnx"))
    assert r.returncode == 3, r.stderr.decode()[-3000:]
    assert word in _error_line(r)


def _masked_softmax(path: Path, padded: bool = False) -> Path:
    """Where(causal mask, x, -inf) then Softmax; `padded`: key 1 hidden too, a padding position
    (a mask that is no index predicate, so the kernel reads it: codegen/indexmask.py)."""
    mask = np.tril(np.ones((8, 16), dtype=bool))
    if padded:
        mask[:, 1] = False
    nodes = [
        helper.make_node("Where", ["mask", "x", "ninf"], ["m"]),
        helper.make_node("Softmax", ["m"], ["y"], axis=-1),
    ]
    inits = [
        numpy_helper.from_array(mask, "mask"),
        numpy_helper.from_array(np.array(-np.inf, np.float32), "ninf"),
    ]
    return _save(_model(nodes, [_vi("x", [2, 8, 16])], [_vi("y", [2, 8, 16])], inits), path)


def test_a_kernels_mask_set_to_all_ones_fails(tmp_path):
    """The kernel reads the 0/1 mask lifting derived; all ones lets every future position in.
    The fallback body (what ONNX Runtime on the CPU runs) still reads the original boolean mask,
    and the field check takes the mask as an input by name: only comparing the constant with
    what lifting derives sees it. (A causal mask alone is computed from indices in the kernel,
    so there the chain check already refuses the changed constant: test_codegen_indexmask.)"""
    a = _masked_softmax(tmp_path / "a.onnx", padded=True)
    b = _packaged(a)
    init = next(t for t in b.graph.initializer if t.name.startswith("mlso_mask_"))
    mask = numpy_helper.to_array(init)
    init.CopyFrom(numpy_helper.from_array(np.ones_like(mask), init.name))
    masked = int((mask == 0).sum())
    assert masked > 0
    r = _verify(a, _save(b, tmp_path / "b.onnx"), "--no-emulate")
    assert r.returncode == 3, r.stderr.decode()[-3000:]
    assert f"constant '{init.name}': {masked} of {mask.size} elements differ" in _error_line(r)


def _sub_relu(path: Path) -> Path:
    """relu(a - b): two inputs of one shape, so exchanging them keeps every shape check happy."""
    nodes = [
        helper.make_node("Sub", ["a", "b"], ["t"], name="sub"),
        helper.make_node("Relu", ["t"], ["y"], name="relu"),
    ]
    return _save(_model(nodes, [_vi("a", [4, 64]), _vi("b", [4, 64])], [_vi("y", [4, 64])]), path)


def _swapped_node_inputs(a: Path) -> onnx.ModelProto:
    """The node's inputs exchanged (b, a) and its function's formals with them, so the fallback
    body still computes relu(a - b); the μGraph is untouched, its input_names still (a, b). The
    kernel takes its inputs by position: on the GPU it computes relu(b - a)."""
    b = _packaged(a)
    node, fn = _mlso_node(b), b.functions[0]
    assert list(node.input[1:]) == list(fn.input[1:]) == ["a", "b"]
    node.input[1], node.input[2] = "b", "a"
    fn.input[1], fn.input[2] = "b", "a"
    return b


def _formals_only_region_model(model: onnx.ModelProto, node: onnx.NodeProto) -> onnx.ModelProto:
    """region_model as it was before the fix: the formals renamed to the node's tensors, the
    body's internal tensors left as they are (so an internal 'a' collides with input 'a')."""
    from mlso_cli.package.regionmodel import standalone as _standalone
    from mlso_cli.package.unpack import fallback_function

    fn = fallback_function(model, node)
    rename = dict(zip(fn.input, node.input))
    rename.update(zip(fn.output, node.output))
    body = []
    for n in fn.node:
        c = onnx.NodeProto()
        c.CopyFrom(n)
        c.input[:] = [rename.get(x, x) for x in n.input]
        c.output[:] = [rename.get(x, x) for x in n.output]
        body.append(c)
    opsets = [o for o in model.opset_import if o.domain in ("", "ai.onnx")]
    return _standalone(model, node, body, "misread", None, opset_imports=opsets)


def _internal_named_like_an_input(a: Path) -> onnx.ModelProto:
    """A fallback body with formals (p, q) that computes relu(p + (-q)) through an internal
    tensor named 'a', like the node's first input. ONNX Runtime runs it right: relu(a - b).
    region_model renames the formals only, so the standalone body reads `a = Neg(b); Add(a, a)`,
    which lifts to relu(-2b); the μGraph is made to compute exactly that."""
    from mlso_cli.frontend.lift import lift_whole_graph, with_input_order
    from mlso_cli.frontend.load import loaded_from_proto
    from mlso_cli.ir import dumps, loads
    from mlso_cli.runtime.plan import plan_json
    from tests.fixtures.packaging import placeholder

    b = _packaged(a)
    node, fn = _mlso_node(b), b.functions[0]
    fn.input[1], fn.input[2] = "p", "q"
    del fn.node[:]
    fn.node.extend(
        [
            helper.make_node("Neg", ["q"], ["a"]),
            helper.make_node("Add", ["p", "a"], ["t"]),
            helper.make_node("Relu", ["t"], ["y"]),
        ]
    )
    honest = loads(_attr(node, "ugraph").s.decode())
    misread = lift_whole_graph(loaded_from_proto(_formals_only_region_model(b, node))).graph
    program = with_input_order(misread, ["a", "b"], honest)
    built = placeholder(program)
    _attr(node, "ugraph").s = dumps(program).encode()
    _attr(node, "plan").s = plan_json(built.plan).encode()
    _attr(node, "source_sha256").s = built.source_sha256.encode()
    return b


BODY_ATTACKS = {
    "ugraph_input_names_not_the_node_inputs": _swapped_node_inputs,
    "internal_tensor_named_like_an_input": _internal_named_like_an_input,
}


@pytest.mark.parametrize(
    "flags",
    [
        pytest.param((), id="default"),
        pytest.param(("--numeric",), id="numeric"),
        pytest.param(("--no-algebraic",), id="no-algebraic"),
    ],
)
@pytest.mark.parametrize("attack", sorted(BODY_ATTACKS))
def test_a_ugraph_that_reads_other_inputs_than_its_node_gives_fails(tmp_path, attack, flags):
    a = _sub_relu(tmp_path / "a.onnx")
    b = _save(BODY_ATTACKS[attack](a), tmp_path / "b.onnx")
    r = _verify(a, b, *flags)
    # names that disagree are refused as tampering when the node is read (1); a body whose
    # internal tensor shadows an input is read right and then fails as a wrong program (3)
    assert r.returncode in (1, 3), r.stderr.decode()[-3000:]
    _error_line(r)


def test_a_character_device_as_output_is_refused_even_with_force_as_root(tmp_path):
    """`-o /dev/null --force` as root: a rename would replace the device with a model file. The
    device here is a copy of /dev/null made in tmp_path, so a regression breaks nothing else."""
    from mlso_cli.errors import InputError
    from mlso_cli.package.write import write_model_atomic

    if os.geteuid() != 0:
        pytest.skip("making a device node needs root")
    dev = tmp_path / "null"
    try:
        os.mknod(dev, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except OSError as exc:
        pytest.skip(f"cannot make a device node here: {exc}")
    r = _cli("optimize", str(GQA), "-o", str(dev), "--force", *FAST)
    assert r.returncode == 1
    assert "not a regular file" in _error_line(r)
    with pytest.raises(InputError, match="not a regular file"):
        write_model_atomic(onnx.load(str(GQA)), dev, replace=True)
    assert stat.S_ISCHR(os.lstat(dev).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["null"]


def _gpt2_regions(tmp_path: Path) -> dict[str, Path]:
    """GPT-2 (124M) blocks at their real widths: ln_1 with c_attn, causal attention of 12 heads
    (over 256 positions: the causal mask must be a constant lifting reads, at most 2**16), and
    the MLP with GPT-2's tanh GELU (x + 0.044715 x^3: the degree that used to exhaust the bound)."""
    rng = np.random.default_rng(0)
    f32 = np.float32

    def const(name, value):
        return numpy_helper.from_array(np.asarray(value, f32), name)

    s, d, h = 1024, 768, 12
    ln = _model(
        [
            helper.make_node("LayerNormalization", ["x", "g", "b"], ["n"], axis=-1, epsilon=1e-5),
            helper.make_node("MatMul", ["n", "w"], ["m"]),
            helper.make_node("Add", ["m", "bias"], ["y"]),
        ],
        [_vi("x", [1, s, d])],
        [_vi("y", [1, s, 3 * d])],
        [
            const("g", rng.standard_normal(d)),
            const("b", rng.standard_normal(d)),
            const("w", rng.standard_normal((d, 3 * d))),
            const("bias", rng.standard_normal(3 * d)),
        ],
    )
    sa = 256
    attention = _model(
        [
            helper.make_node("MatMul", ["q", "kt"], ["s"]),
            helper.make_node("Div", ["s", "eight"], ["sd"]),
            helper.make_node("Where", ["mask", "sd", "ninf"], ["sm"]),
            helper.make_node("Softmax", ["sm"], ["p"], axis=-1),
            helper.make_node("MatMul", ["p", "v"], ["o"]),
        ],
        [_vi("q", [1, h, sa, 64]), _vi("kt", [1, h, 64, sa]), _vi("v", [1, h, sa, 64])],
        [_vi("o", [1, h, sa, 64])],
        [
            const("eight", 8.0),
            numpy_helper.from_array(np.tril(np.ones((sa, sa), bool)), "mask"),
            const("ninf", -np.inf),
        ],
    )
    mlp = _model(
        [
            helper.make_node("MatMul", ["x", "w1"], ["h0"]),
            helper.make_node("Add", ["h0", "b1"], ["h"]),
            helper.make_node("Pow", ["h", "three"], ["h3"]),
            helper.make_node("Mul", ["h3", "k"], ["h3k"]),
            helper.make_node("Add", ["h", "h3k"], ["inner"]),
            helper.make_node("Mul", ["inner", "s2pi"], ["arg"]),
            helper.make_node("Tanh", ["arg"], ["t"]),
            helper.make_node("Add", ["t", "one"], ["t1"]),
            helper.make_node("Mul", ["h", "half"], ["hh"]),
            helper.make_node("Mul", ["hh", "t1"], ["gelu"]),
            helper.make_node("MatMul", ["gelu", "w2"], ["y0"]),
            helper.make_node("Add", ["y0", "b2"], ["y"]),
        ],
        [_vi("x", [1, s, d])],
        [_vi("y", [1, s, d])],
        [
            const("w1", rng.standard_normal((d, 4 * d))),
            const("b1", rng.standard_normal(4 * d)),
            const("three", 3.0),
            const("k", 0.044715),
            const("s2pi", math.sqrt(2 / math.pi)),
            const("one", 1.0),
            const("half", 0.5),
            const("w2", rng.standard_normal((4 * d, d))),
            const("b2", rng.standard_normal(d)),
        ],
    )
    return {
        name: _save(m, tmp_path / f"{name}.onnx")
        for name, m in (("ln_c_attn", ln), ("attention", attention), ("mlp", mlp))
    }


def test_gpt2_sized_regions_get_a_bound_the_field_check_can_reach(tmp_path):
    """GPT-2's kernels were rejected by the field check with "no useful bound: the per-trial
    bound is 1 (too high a degree ...)". Here each GPT-2-sized region's lifted μGraph (what the
    field check lifts the fallback body to) against itself: the per-trial bound must be below 1
    on every prime drawn, and reach the target for a 12-layer model's 36 kernels (2^-60 split
    over them) within check_equivalent's 32 trials. A searched candidate only adds to the risk,
    so this is the floor; the degree analysis alone runs, no field arithmetic at full size."""
    from mlso_cli.frontend.analyse import analyse as partition_and_lift
    from mlso_cli.frontend.load import load_model
    from mlso_cli.verify import equivalence as eq
    from mlso_cli.verify.degree import analyse
    from mlso_cli.verify.field import Field

    kernels = 36
    target = 2.0**-60 / (kernels * (kernels + 1))
    rng = np.random.default_rng(3)
    fields = [Field.draw(rng) for _ in range(4)]
    for name, path in _gpt2_regions(tmp_path).items():
        (lr,) = partition_and_lift(load_model(str(path))).lifted
        profile = analyse(lr.graph)
        eps = max(eq.trial_bound(profile, profile, f) for f in fields)
        assert eps < 1, name
        assert math.ceil(math.log(target) / math.log(eps)) <= 32, (name, eps)
