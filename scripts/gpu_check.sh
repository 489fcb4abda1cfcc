#!/usr/bin/env bash
# The GPU check, in one command, on a machine with a CUDA device (see README, "The GPU check"):
#   1. the CUDA build of veragged._C (scripts/install.sh; fails if no CUDA kernel was built),
#   2. the GoogleTests (CMake/CTest),
#   3. every CUDA kernel against its CPU twin (tests/cuda/test_kernels_cuda.py), also under
#      compute-sanitizer memcheck when it is installed,
#   3b. block-scaled weights on CUDA (tests/cuda/test_quant_cuda.py): the tile kernels against
#      their CPU twins bit for bit, compute="fp8"'s F.scaled_mm (1x128 x 128x128) against its
#      dequantise-then-matmul reference,
#   4. fully_shard on one GPU with NCCL: bitwise against torch's fully_shard, side streams used,
#      no host sync in a step, the profiler's NCCL overlap (tests/cuda/test_fully_shard_cuda.py),
#   5. the GPU benchmarks against torch's fully_shard in the same run, one rank per GPU:
#      benchmarks/host_work.py (launches, host time per phase), benchmarks/fsdp_step.py (step
#      time, phases as issued, what a step allocates and reserves, NCCL time and the part of it
#      hidden behind compute) and, with 4 GPUs or more, benchmarks/fsdp_parallel.py (FSDP x TP,
#      FSDP x EP; the same columns), benchmarks/block_fp8.py (8-bit block-scaled gathers:
#      bytes, collectives, quantisation time against the all-gather, against bf16),
#   6. the CPU-side proofs the GPU design rests on (tests/runtime: happens-before orderings,
#      host syncs, launch counts),
#   7. the whole pytest suite on the GPUs (VERAGGED_TEST_DEVICE=cuda: rank r on GPU r with
#      NCCL; jobs of more ranks than GPUs and CPU-only tests are skipped, with the reason).
# Each stage is bounded by GPU_CHECK_STAGE_S seconds (default 600; the suite by GPU_CHECK_SUITE_S,
# default 1800). Prints one line per stage (PASS/FAIL, seconds) as it ends and a summary table
# naming the device; exits non-zero if any stage failed. Without a CUDA device it says so and
# exits 2.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${GPU_CHECK_OUT:-build/gpu-check}
mkdir -p "$OUT"

device=$("$PY" -c 'import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")' 2>/dev/null)
if [[ -z "$device" ]]; then
  echo "gpu_check: no CUDA device visible to torch (torch.cuda.is_available() is False)" >&2
  exit 2
fi
echo "gpu_check on: $device ($(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1) driver)"

declare -a rows
status=0
STAGE_S=${GPU_CHECK_STAGE_S:-600}
stage() {  # stage NAME COMMAND...: run, log to $OUT/NAME.log, record PASS/FAIL and seconds
  local name=$1; shift
  local t0=$SECONDS
  if timeout "${LIMIT:-$STAGE_S}" "$@" >"$OUT/$name.log" 2>&1; then r=PASS
  else r=FAIL; status=1; fi
  rows+=("| $name | $r | $((SECONDS - t0)) s | $(tail -1 "$OUT/$name.log" | cut -c1-90) |")
  echo "$name: $r ($((SECONDS - t0)) s; log $OUT/$name.log)"
}

stage build bash -c "bash scripts/install.sh && bash scripts/install_test.sh && $PY -c 'import torch, veragged; \
  assert torch._C._dispatch_has_kernel_for_dispatch_key(\"veragged::land_\", \"CUDA\"), \
  \"veragged._C was built without its CUDA kernels\"; print(\"CUDA kernels registered\")'"
stage cpp bash -c "cmake -S tests/cpp -B build/cpp-tests -DCMAKE_BUILD_TYPE=Release >/dev/null \
  && cmake --build build/cpp-tests -j \$(nproc) >/dev/null \
  && ctest --test-dir build/cpp-tests --output-on-failure --timeout 300"
stage kernels "$PY" -m pytest -q tests/cuda/test_kernels_cuda.py
if command -v compute-sanitizer >/dev/null; then
  stage sanitizer compute-sanitizer --tool memcheck --error-exitcode 1 \
    "$PY" -m pytest -q -x tests/cuda/test_kernels_cuda.py
else
  rows+=("| sanitizer | SKIPPED | 0 s | compute-sanitizer not installed |")
fi
stage quant_cuda "$PY" -m pytest -q tests/cuda/test_quant_cuda.py
stage fully_shard "$PY" -m pytest -q tests/cuda/test_fully_shard_cuda.py
ngpu=$("$PY" -c 'import torch; print(min(torch.cuda.device_count(), 8))')
stage host_work_cuda "$PY" benchmarks/host_work.py --device cuda --world "$ngpu"
stage fsdp_step_cuda "$PY" benchmarks/fsdp_step.py --device cuda --world "$ngpu" \
  --optimizers adamw
stage block_fp8_cuda "$PY" -m benchmarks.block_fp8 --device cuda --worlds "$ngpu"
if ((ngpu >= 4)); then
  stage fsdp_parallel_cuda "$PY" benchmarks/fsdp_parallel.py --device cuda
else
  rows+=("| fsdp_parallel_cuda | SKIPPED | 0 s | needs 4 GPUs, $ngpu visible |")
fi
stage runtime "$PY" -m pytest -q tests/runtime
LIMIT=${GPU_CHECK_SUITE_S:-1800} stage suite env VERAGGED_TEST_DEVICE=cuda "$PY" -m pytest -q tests

echo
echo "GPU check on $device, commit $(git rev-parse --short HEAD 2>/dev/null), $(date -u +%F)"
echo "| stage | result | time | last line |"
echo "|---|---|---|---|"
printf '%s\n' "${rows[@]}"
exit $status
