"""The floor of one ONNX Runtime call: a one-node model, timed the way the harness times models.

Why: a region packaged as one MlsoKernel node measured 8-11 µs more inside ONNX Runtime (under its
CUDA graph) than the same program alone by CUDA-graph replay (benchmarks/RESULTS.md, "optimize
--gpu 0 then bench"). This tells whether that is the custom op's own cost or what any ORT call
costs: it times a one-node Add on a few fp16 values, plain and under ORT's CUDA graph, with
inputs and outputs bound on the GPU (IOBinding, as bench/harness.py does), median of 5 repeats
of 200 calls.

    python3 benchmarks/ort_floor.py [--gpu 0]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import onnx
from onnx import TensorProto, helper


def _model(n: int) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT16, [n])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT16, [n])
    g = helper.make_graph([helper.make_node("Add", ["X", "X"], ["Y"])], "floor", [x], [y])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10  # what ONNX Runtime 1.31 reads (onnx writes 14)
    return m


def _time(graph: bool, gpu: int, n: int) -> float:
    import onnxruntime as ort

    opts = {"device_id": gpu, "enable_cuda_graph": "1" if graph else "0"}
    sess = ort.InferenceSession(
        _model(n).SerializeToString(), providers=[("CUDAExecutionProvider", opts)]
    )
    x = ort.OrtValue.ortvalue_from_numpy(np.ones(n, np.float16), "cuda", gpu)
    y = ort.OrtValue.ortvalue_from_numpy(np.zeros(n, np.float16), "cuda", gpu)
    io = sess.io_binding()
    io.bind_ortvalue_input("X", x)
    io.bind_ortvalue_output("Y", y)
    for _ in range(20):
        sess.run_with_iobinding(io)
    per = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(200):
            sess.run_with_iobinding(io)
        io.synchronize_outputs()
        per.append((time.perf_counter() - t0) / 200 * 1e6)
    return statistics.median(per)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", type=int, default=0)
    args = ap.parse_args()
    for n in (16, 4096):
        row = {"node": "Add", "elements": n}
        row["plain_us"] = round(_time(False, args.gpu, n), 2)
        row["cuda_graph_us"] = round(_time(True, args.gpu, n), 2)
        print(json.dumps(row))


if __name__ == "__main__":
    main()
