#!/usr/bin/env bash
# Here, once: fetch Ray (the `ray` extra's pin) and its dependencies for the GPU machine's Python
# 3.12 into .device-stage/ray/ (git-ignored): the Ray wheel split into parts that fit one call's
# carry limit with the working tree, and the dependency wheels, which the machine installs only
# where its system Python lacks the distribution (benchmarks/gpu_run.sh scaleout).
# Then, on the GPU machine, back to back on a warm machine:
#   carry .device-stage/ray/ray-part-N   run: bash benchmarks/gpu_run.sh ray-stage N   (N = 0, 1)
#   carry .device-stage/ray/deps         run: bash benchmarks/gpu_run.sh scaleout
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
pin=$($PY - <<'PY'
import tomllib
extra = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["ray"]
print(" ".join(extra))
PY
)
stage=.device-stage/ray
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
$PY -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 -d "$tmp" $pin
rm -rf "$stage"; mkdir -p "$stage/deps"
whl=$(ls "$tmp"/ray-*.whl)
# pip installs a wheel only under its own file name: it travels with the dependencies
basename "$whl" > "$stage/deps/ray-wheel-name.txt"
# 40 MiB parts: the working tree (about 21 MB) and one part stay under the 64 MiB a call carries
(cd "$stage" && split -b 40M -d -a 1 "$whl" ray-part-)
rm "$whl"; mv "$tmp"/*.whl "$stage/deps/"
ls "$stage"/ray-part-* | sed 's/^/staged /'
ls "$stage/deps" | wc -l | sed 's/^/dependency wheels: /'
