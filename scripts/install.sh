#!/usr/bin/env bash
# Installs what veragged and its main job need (skipping what is already there) and builds
# veragged._C in place. What only the tests need (pytest, CMake, the client stacks) is
# scripts/install_test.sh's.
#
# torch with its CUDA libraries is several GB, so an installed torch in the supported range is
# kept as it is. Environment: see setup.py (VERAGGED_CUDA, TORCH_CUDA_ARCH_LIST, MAX_JOBS).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
t0=$SECONDS

torch_ok() {
  "$PY" - <<'PY' 2>/dev/null
import re, sys, torch
major, minor = (int(x) for x in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())
sys.exit(0 if (major, minor) >= (2, 11) else 1)
PY
}

if ! torch_ok; then
  echo "install: torch>=2.11 from PyPI"
  "$PY" -m pip install --quiet "torch>=2.11"
fi
missing=()
for spec in ninja:ninja numpy:numpy setuptools:setuptools wheel:wheel; do
  "$PY" -c "import ${spec%%:*}" 2>/dev/null || missing+=("${spec##*:}")
done
if ((${#missing[@]})); then
  echo "install: ${missing[*]}"
  "$PY" -m pip install --quiet "${missing[@]}"
fi
# CI builds one CUDA architecture to stay fast; users get torch's default.
if [[ "${CI:-}" == "true" && -z "${TORCH_CUDA_ARCH_LIST:-}" ]]; then
  export TORCH_CUDA_ARCH_LIST=9.0
fi
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
echo "install: building veragged._C"
log=$(mktemp)
if ! "$PY" -m pip install -v --no-build-isolation --no-deps -e . >"$log" 2>&1; then
  cat "$log" >&2
  echo "install: the build failed (log above)" >&2
  exit 1
fi
grep -m1 -o "veragged: .*build (.*)" "$log" || true  # which build it did, and why
rm -f "$log"
"$PY" -c "import veragged" || { echo "install: veragged does not import" >&2; exit 1; }
echo "install: done ($((SECONDS - t0)) s)"
