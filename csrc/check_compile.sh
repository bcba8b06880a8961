#!/usr/bin/env bash
# Compile every CUDA kernel file (csrc/*.cu: no torch headers) with nvcc -c for sm_90a and sm_100a, with the flags
# that ops.load_cuda_kernels() uses. Needs nvcc only, no GPU. Exits non-zero when any compile fails, or when ptxas
# reports a potential performance loss (e.g. C7511: wgmma instructions serialised for want of registers, which
# silently turns an asynchronous tensor-core pipeline into a serial one).
set -uo pipefail
cd "$(dirname "$0")"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
jobs_=()
for src in *.cu; do
  for arch in 90a 100a; do
    obj="$out/${src%.cu}.${arch}.o"
    (nvcc -c -std=c++17 -O3 "-gencode=arch=compute_${arch},code=sm_${arch}" -Xptxas -v "$src" -o "$obj" \
      >"$obj.log" 2>&1 && ! grep -q "Performance Loss" "$obj.log") &
    jobs_+=("$!:$src:$arch:$obj")
  done
done
status=0
for j in "${jobs_[@]}"; do
  IFS=: read -r pid src arch obj <<<"$j"
  if wait "$pid"; then
    echo "ok   $src sm_$arch"
  else
    echo "FAIL $src sm_$arch"
    grep -v "^ptxas info\|bytes stack frame" "$obj.log"  # the errors (-v's per-function lines left out)
    grep "Performance Loss" "$obj.log"
    status=1
  fi
done
exit $status
