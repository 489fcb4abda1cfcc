#!/usr/bin/env bash
# Installs what veragged needs (skipping what is already there) and builds veragged._C in place.
#
# torch with its CUDA libraries is several GB, so an installed torch in the supported range is
# kept as it is. Environment: see setup.py (VERAGGED_CUDA, TORCH_CUDA_ARCH_LIST, MAX_JOBS).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

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
for spec in ninja:ninja numpy:numpy pytest:pytest pytest_timeout:pytest-timeout matplotlib:matplotlib \
    expecttest:expecttest \
    setuptools:setuptools wheel:wheel; do
  "$PY" -c "import ${spec%%:*}" 2>/dev/null || missing+=("${spec##*:}")
done
if ((${#missing[@]})); then
  echo "install: ${missing[*]}"
  "$PY" -m pip install --quiet "${missing[@]}"
fi
command -v cmake >/dev/null || { echo "install: cmake is needed for the C++ tests" >&2; exit 1; }

# Client stacks for tests/clients, pinned to the versions those tests were run with. torchtitan
# 0.3.0 is installed without its resolver's wishes (spmd_types==0.2.3, wandb, tensorboard,
# torch_checkpointing, HF datasets: the tests do without them; see tests/clients/_titan.py), its
# small imports one by one. torchtune 0.6.1 needs torchao 0.13, which breaks torchtitan's import,
# so it gets its own virtual environment (build/venv-torchtune) that sees this one's packages
# (torch, veragged). VERAGGED_CLIENTS=0 skips this section; the client tests then skip, naming
# the missing package. A failed install fails under CI=true and only warns elsewhere.
TORCHTUNE_VENV=build/venv-torchtune
CLIENTS=(transformers==5.23.0 peft==0.21.2 accelerate==1.15.0 tokenizers==0.23.3
         tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 spmd_types==0.3.1
         torchdata==0.11.0)
NO_DEPS=(torchtitan==0.3.0)
TUNE=(torchtune==0.6.1 torchao==0.13.0)

not_installed() {  # not_installed PYTHON SPEC...: the name==version SPECs it lacks at that version
  local py=$1
  shift
  "$py" - "$@" <<'PY'
import importlib.metadata as m, sys
for spec in sys.argv[1:]:
    name, version = spec.split("==")
    try:
        ok = m.version(name) == version
    except m.PackageNotFoundError:
        ok = False
    if not ok:
        print(spec)
PY
}

client_fail() {
  echo "install: $1" >&2
  if [[ "${CI:-}" == "true" ]]; then exit 1; fi
}

if [[ "${VERAGGED_CLIENTS:-1}" != "0" ]]; then
  start=$SECONDS
  pin=$(mktemp)  # nothing here may replace the installed torch
  # Without the local part (+cu132, +cpu): an older pip in the torchtune venv rejects every
  # candidate torch against a local-version pin, and ==X.Y.Z matches X.Y.Z+anything anyway.
  "$PY" -c "import torch; print('torch==' + torch.__version__.split('+')[0])" >"$pin"
  mapfile -t todo < <(not_installed "$PY" "${CLIENTS[@]}")
  if ((${#todo[@]})); then
    echo "install: client packages ${todo[*]}"
    "$PY" -m pip install --quiet -c "$pin" "${todo[@]}" \
      || client_fail "could not install ${todo[*]}: tests/clients will skip them"
  fi
  mapfile -t todo < <(not_installed "$PY" "${NO_DEPS[@]}")
  if ((${#todo[@]})); then
    echo "install: client packages ${todo[*]} (without dependencies)"
    "$PY" -m pip install --quiet --no-deps "${todo[@]}" \
      || client_fail "could not install ${todo[*]}: tests/clients will skip them"
  fi
  if [[ ! -x "$TORCHTUNE_VENV/bin/python" ]]; then
    echo "install: virtual environment $TORCHTUNE_VENV (system site packages visible)"
    "$PY" -m venv --system-site-packages "$TORCHTUNE_VENV" \
      || client_fail "could not create $TORCHTUNE_VENV: tests/clients/test_torchtune.py will skip"
  fi
  if [[ -x "$TORCHTUNE_VENV/bin/python" ]]; then
    mapfile -t todo < <(not_installed "$TORCHTUNE_VENV/bin/python" "${TUNE[@]}")
    if ((${#todo[@]})); then
      echo "install: ${todo[*]} into $TORCHTUNE_VENV"
      "$TORCHTUNE_VENV/bin/python" -m pip install --quiet -c "$pin" "${todo[@]}" \
        || client_fail "could not install ${todo[*]}: tests/clients/test_torchtune.py will skip"
    fi
  fi
  rm -f "$pin"
  echo "install: client packages ready ($((SECONDS - start)) s)"
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
