#!/usr/bin/env bash
# Here, after the GPU machine's staging script filled .device-stage/: re-split the onnxruntime-gpu
# wheel into 40 MiB parts. Why: one call carries at most 64 MiB, the working tree is about 21 MB,
# and the staging script's parts are 52 MB, so a call carrying one of them with the tree is
# refused. Seven parts then travel in seven calls (`gpu.sh stage N`, N = 0 ... 6), as before.
set -euo pipefail
cd "$(dirname "$0")/../.device-stage"
ls ort-part-? >/dev/null
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
cat ort-part-? > "$tmp/ort.whl"
before=$(wc -c < "$tmp/ort.whl")
rm ort-part-?
split -b 40M -d -a 1 "$tmp/ort.whl" ort-part-
after=$(cat ort-part-? | wc -c)
[ "$before" = "$after" ] || { echo "resplit_ort.sh: parts hold $after bytes, the wheel $before" >&2; exit 1; }
ls -la ort-part-?
