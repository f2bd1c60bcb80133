#!/usr/bin/env bash
# One call on the GPU machine (after onnxruntime-gpu and PyCUDA were staged there into .device-stage/, see docs/benchmarks.md): the GPU test
# suite, the fixture kernel timings, the searched programs' timings and the model-level benchmark,
# with logs under $OUT.
#   carry: .device-stage/gpu.sh .device-stage/onnxruntime .mlso-cache (.mlso-cache-gpu for searched_models)
set -u
source .device-stage/gpu.sh env
export PYTHONPATH="$PWD:$PYTHONPATH" PYTHONUNBUFFERED=1
export MLSO_CACHE_DIR="${MLSO_CACHE_DIR:-$PWD/.mlso-cache}" MLSO_ORT_INCLUDE="$PWD/.device-stage/onnxruntime"
# cuBLASLt headers for the library GEMMs (the machine has no registry to fetch the wheel from):
# carried as .device-stage/cublas_include, the include folder of runtime/cublas_headers.py's wheel
[ -d .device-stage/cublas_include ] && export MLSO_CUBLAS_INCLUDE="$PWD/.device-stage/cublas_include"
OUT=${OUT:-/tmp/mlso-out}; mkdir -p "$OUT"
# At most 8 files come back from $OUT (the device tool's limit): a `real` run writes a dozen
# (logs, peers, records, profiles), and what is over the limit is dropped without a word. So
# they travel as one archive, $OUT/real.tar.gz, with the bench table beside it to read at once.
# Why: on 2026-12-07 the Phi-3 call lost its records.json and optimize log that way, and a Qwen2
# bench cut short by its timeout lost the partial results `real_decoders.py record` could keep.
bundle_real() {
  tar -czf "$OUT/real.tar.gz" -C "$OUT" real && mv "$OUT/real/bench.md" "$OUT/real_bench.md" 2>/dev/null
  rm -rf "$OUT/real"
}
what=${1:-all}
if [ "$what" = ray-stage ]; then
  # keep carried part $2 of the Ray wheel (benchmarks/stage_ray.sh) for `scaleout`
  mkdir -p /tmp/ray-parts && cp ".device-stage/ray/ray-part-$2" /tmp/ray-parts/ && ls -la /tmp/ray-parts
  exit 0
fi
if [ "$what" = pycuda ]; then
  # Without the onnxruntime-gpu parts (a short device budget): PyCUDA and its pure-Python
  # dependencies only (carry .device-stage/wheels), then the launcher's GPU tests of code
  # generation and library GEMMs, and the library GEMM benchmark. ORT tests skip.
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/mlso-site .device-stage/wheels/*.whl
  # PYCUDA_TESTS: which test files (a short budget can take only tests/test_libgemm_gpu.py)
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -m gpu ${PYCUDA_TESTS:-tests/test_libgemm_gpu.py tests/test_codegen_gpu.py} \
    -p no:cacheprovider -rfEs > "$OUT/gpu_tests.log" 2>&1
  tail -25 "$OUT/gpu_tests.log"
  what=gemm
fi
if [ "$what" = nort ]; then
  # Without the onnxruntime-gpu parts (one call, no staging calls): PyCUDA only, the GPU tests
  # that need no ONNX Runtime (launcher, codegen, library GEMMs, row kernels, selections, the
  # sm_90a GEMM), then issue 33's table (the `hopper` mode below; its carry). ORT's tests skip.
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/mlso-site .device-stage/wheels/*.whl
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -m gpu ${NORT_TESTS:-tests/test_launcher.py \
    tests/test_codegen_gpu.py tests/test_libgemm_gpu.py tests/test_codegen_rows.py \
    tests/test_codegen_selection.py tests/test_sm90_gemm.py} -p no:cacheprovider -rfEs \
    > "$OUT/gpu_tests.log" 2>&1
  tail -25 "$OUT/gpu_tests.log"
  what=hopper
fi
{ date -u; echo "commit ${MLSO_BENCH_COMMIT:-$(git log -1 --format=%H 2>/dev/null)}"; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv; } > "$OUT/machine.txt" 2>&1
if [ "$what" = sm90 ]; then
  # The sm_90a weight-streaming GEMM (docs/hopper.md), first run on a GPU: its GPU tests, then
  # its timings against torch.matmul in fp16 and bf16 (PyCUDA staged: carry .device-stage/wheels).
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/mlso-site .device-stage/wheels/*.whl
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -m gpu tests/test_sm90_gemm.py -x \
    -p no:cacheprovider -rfE > "$OUT/sm90_tests.log" 2>&1
  tail -25 "$OUT/sm90_tests.log"
  for dt in float16 bfloat16; do
    timeout ${GEMM_TIMEOUT:-120} python3 benchmarks/sm90_gemm.py --dtype $dt --out "$OUT/sm90_$dt.json" \
      --record > "$OUT/sm90_$dt.md" 2>&1
    tail -20 "$OUT/sm90_$dt.md"
  done
  # the records (benchmarks/results/sm90_gemm.json): copy them over this tree's file to keep them
  cp benchmarks/results/sm90_gemm.json "$OUT/sm90_records.json" 2>/dev/null
  exit 0
fi
if [ "$what" = ncu ]; then
  # What bounds issue 33's rows that miss their target (benchmarks/ncu_rows.py): each row's mlso
  # candidates under Nsight Compute (Speed of Light, launch statistics, occupancy), one CSV per
  # row, bundled as $OUT/ncu.tar.gz. carry: .device-stage/gpu.sh .device-stage/wheels
  # .device-stage/cublas_include .mlso-cache-h33. NCU_ROWS: comma-separated row names.
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/mlso-site .device-stage/wheels/*.whl
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  mkdir -p "$OUT/ncu"
  for row in $(echo "${NCU_ROWS:?name the rows}" | tr , ' '); do
    MLSO_CACHE_DIR="${HOPPER_CACHE:-$PWD/.mlso-cache-h33}" timeout ${NCU_ROW_TIMEOUT:-40} "$NCU" \
      --clock-control none --section SpeedOfLight --section LaunchStats --section Occupancy \
      --csv --page details python3 benchmarks/ncu_rows.py --rows "$row" \
      > "$OUT/ncu/$row.csv" 2> "$OUT/ncu/$row.err"
    echo "$row rc=$? $(grep -c '"Duration"' "$OUT/ncu/$row.csv") kernels profiled"
  done
  tar -czf "$OUT/ncu.tar.gz" -C "$OUT" ncu && rm -rf "$OUT/ncu"
  exit 0
fi
if [ "$what" = hopper ]; then
  # Issue 33's table (benchmarks/hopper_table.py). carry: .device-stage/gpu.sh .device-stage/wheels
  # .device-stage/onnxruntime .device-stage/cublas_include .mlso-cache-h33 (hopper_table.py compile)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/mlso-site .device-stage/wheels/*.whl
  MLSO_CACHE_DIR="${HOPPER_CACHE:-$PWD/.mlso-cache-h33}" timeout ${HOPPER_TIMEOUT:-570} python3 benchmarks/hopper_table.py run \
    --compile --record --json "$OUT/hopper_table.json" ${HROWS:+--rows "$HROWS"} ${HOPPER_ARGS:-} \
    > "$OUT/hopper_table.md" 2> "$OUT/hopper_table.err"
  tail -45 "$OUT/hopper_table.md"
  cp benchmarks/results/hopper_rows.json "$OUT/hopper_records.json" 2>/dev/null
  exit 0
fi
if [ "$what" = scaleout ]; then
  if ! python3 -c "import ray" 2>/dev/null && [ -d /tmp/ray-parts ]; then
    # Ray from the staged parts; a dependency only where the system Python lacks it, so that
    # nothing the machine's torch or onnx rely on is shadowed
    deps=.device-stage/ray/deps; name=$(cat "$deps/ray-wheel-name.txt")
    cat /tmp/ray-parts/ray-part-* > "/tmp/$name"
    need=$(for w in "$deps"/*.whl; do d=$(basename "$w" | cut -d- -f1)
      python3 -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" "$d" 2>/dev/null || echo "$w"; done)
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/mlso-site "/tmp/$name" $need
    python3 -c "import ray, sys; print('ray', ray.__version__, 'with', ' '.join(sys.argv[1:]) or 'no extra wheels')" $need
  fi
  # The search on a local Ray cluster against the process pool, per CPU count, most CPUs first so
  # that a run cut at its timeout keeps the rows that matter (benchmarks/scaleout.py; Ray staged by
  # benchmarks/stage_ray.sh and `ray-stage N`). Rows are printed and recorded as measured.
  # SCALE_PART=specs|model|all, SCALE_SPECS, SCALE_CPUS, SCALE_STATES (default: optimize's budget).
  states=""; [ -n "${SCALE_STATES:-}" ] && states="--max-states $SCALE_STATES"
  if [ "${SCALE_PART:-all}" != model ]; then
    specs=""; for s in ${SCALE_SPECS:-gqa:1 gated_mlp:1 lora:1 mla:1 ntrans:1 qknorm_gqa:1}; do specs="$specs --spec $s"; done
    timeout ${SPECS_TIMEOUT:-300} python3 -m benchmarks.scaleout $specs --cpus ${SCALE_CPUS:-16,8,4,2,1} \
      $states --record --json "$OUT/scale_specs.json" > "$OUT/scale_specs.md" 2> "$OUT/scale_specs.err"
    cat "$OUT/scale_specs.md"
  fi
  if [ "${SCALE_PART:-all}" != specs ]; then
    PYTHONPATH="$PWD" timeout ${EXPORT_TIMEOUT:-90} python3 benchmarks/real_decoders.py export \
      --no-peers --families qwen2 --out /tmp/real > "$OUT/export.log" 2>&1
    timeout ${MODEL_TIMEOUT:-300} python3 -m benchmarks.scaleout /tmp/real/qwen2_real2l_fp16.onnx \
      --input-shape input_ids=1,128 --cpus ${SCALE_CPUS:-16,8,4,2,1} $states --record \
      --json "$OUT/scale_qwen2.json" > "$OUT/scale_qwen2.md" 2> "$OUT/scale_qwen2.err"
    cat "$OUT/scale_qwen2.md"
  fi
  cp benchmarks/results/scaleout.json "$OUT/scaleout_records.json" 2>/dev/null
  exit 0
fi
python3 -m models.build_models > "$OUT/models.log" 2>&1 || echo "models build failed"
if [ "$what" = all ] || [ "$what" = tests ]; then
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -m gpu tests -p no:cacheprovider -rfE > "$OUT/gpu_tests.log" 2>&1
  tail -40 "$OUT/gpu_tests.log" 2>/dev/null
fi
if [ "$what" = all ] || [ "$what" = gemm ]; then
  # library GEMM launches against generated matmuls and torch.matmul (benchmarks/library_gemm.py)
  timeout ${GEMM_TIMEOUT:-200} python3 benchmarks/library_gemm.py --record --out "$OUT/library_gemm.json" \
    --skip-generated-over ${GEMM_SKIP_GENERATED:-2000000000} > "$OUT/library_gemm.md" 2>&1
  tail -12 "$OUT/library_gemm.md"
  cp benchmarks/results/library_gemm.json "$OUT/library_gemm_records.json" 2>/dev/null
fi
if [ "$what" = all ] || [ "$what" = kernels ]; then
  timeout ${KERNEL_TIMEOUT:-150} python3 benchmarks/fixture_kernels.py --fixtures tests.fixtures.ugraphs --out "$OUT/fixture_kernels.json" > "$OUT/fixture_kernels.md" 2>&1
  tail -40 "$OUT/fixture_kernels.md"
fi
if [ "$what" = all ] || [ "$what" = searched ]; then
  # the programs benchmarks/search_bench.py --save chose, timed like the fixtures and checked
  # against the float64 interpreter
  timeout ${SEARCHED_TIMEOUT:-200} python3 benchmarks/fixture_kernels.py --graphs benchmarks/searched_programs --verify --out "$OUT/searched_kernels.json" > "$OUT/searched_kernels.md" 2>&1
  tail -30 "$OUT/searched_kernels.md"
fi
if [ "$what" = searched_models ]; then
  # optimize --gpu 0 + verify + bench --cuda-graph on the rows in $SROWS, served the search results
  # that benchmarks/search_bench.py --keep-cache $SEARCH_CACHE wrote on the CPU machine (carried)
  MLSO_CACHE_DIR="${SEARCH_CACHE:-$PWD/.mlso-cache-gpu}" timeout ${SMODEL_TIMEOUT:-400} \
    python3 benchmarks/searched_models.py --rows "$SROWS" --out "$OUT/searched_models.json" > "$OUT/searched_models.md" 2>&1
  tail -30 "$OUT/searched_models.md"
fi
if [ "$what" = all ] || [ "$what" = models ]; then
  timeout ${MODEL_TIMEOUT:-200} python3 benchmarks/model_bench.py --out "$OUT/model_bench.json" ${ROWS:+--rows $ROWS} > "$OUT/model_bench.md" 2>&1
  tail -40 "$OUT/model_bench.md"
fi
if [ "$what" = real ]; then
  # Real exported decoders (benchmarks/real_decoders.py): export and torch peers in the system
  # Python (torch, transformers, onnxscript; the staged onnxruntime-gpu kept off its path), then
  # optimize/verify/bench with the staged onnxruntime-gpu. REAL_FAMILIES, REAL_OPT_ARGS optional.
  # At the default search budget one family fits a call: run REAL_FAMILIES=qwen2, =llama, =phi3
  # (pass MLSO_BENCH_COMMIT=<commit>: the copy of .git there is stale)
  # back to back on the warm machine (each call records its own rows; /tmp/real is kept).
  # REAL_FAMILIES is comma-separated. REAL_EXPORT=0: no export, bench every family that earlier
  # calls exported into /tmp/real (their peers.json entries accumulate), with their caches warm.
  # REAL_OPTIMIZE_ONLY=1: export without torch peers, then only optimize --gpu 0 per family (the
  # per-region table of each region's library baseline against ORT), no verify, bench or profile.
  mkdir -p "$OUT/real"
  only=""; peers=""
  [ "${REAL_OPTIMIZE_ONLY:-0}" = 1 ] && only="--optimize-only" && peers="--no-peers"
  if [ "${REAL_EXPORT:-1}" = 1 ]; then
    PYTHONPATH="$PWD" timeout ${EXPORT_TIMEOUT:-240} python3 benchmarks/real_decoders.py export $peers \
      --out /tmp/real ${REAL_FAMILIES:+--families $REAL_FAMILIES} > "$OUT/real/export.log" 2>&1
    tail -5 "$OUT/real/export.log"
  fi
  timeout ${REAL_TIMEOUT:-420} python3 benchmarks/real_decoders.py bench --out /tmp/real --record $only \
    $([ "${REAL_EXPORT:-1}" = 1 ] && [ -n "${REAL_FAMILIES:-}" ] && echo --families "$REAL_FAMILIES") \
    ${REAL_OPT_ARGS:+--optimize-args "$REAL_OPT_ARGS"} > "$OUT/real/bench.md" 2>&1
  tail -30 "$OUT/real/bench.md"
  cp benchmarks/results/real_decoder_regions.json "$OUT/real/region_records.json" 2>/dev/null
  # where the time goes inside each optimized model (benchmarks/kernel_profile.py, ~15 s a family)
  [ -n "$only" ] && { cp /tmp/real/*.json /tmp/real/*.log "$OUT/real/" 2>/dev/null; bundle_real; exit 0; }
  for fam in $(echo "${REAL_FAMILIES:-qwen2,llama,phi3}" | tr , ' '); do
    [ -f "/tmp/real/${fam}_real2l_fp16.mlso.onnx" ] || continue
    timeout ${PROFILE_TIMEOUT:-90} python3 benchmarks/kernel_profile.py --cuda-graph \
      "/tmp/real/${fam}_real2l_fp16.mlso.onnx" "/tmp/real/${fam}_real2l_fp16.onnx" \
      --input-shape input_ids=1,128 --runs 20 --top 30 --json "$OUT/real/kernels_${fam}.json" \
      > "$OUT/real/kernels_${fam}.md" 2> "$OUT/real/kernels_${fam}.err"
    grep -A3 "^| model" "$OUT/real/kernels_${fam}.md"
  done
  cp /tmp/real/*.json /tmp/real/*.log "$OUT/real/" 2>/dev/null
  cp benchmarks/results/real_decoders.json "$OUT/real/records.json" 2>/dev/null
  bundle_real
fi
