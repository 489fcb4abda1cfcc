#!/usr/bin/env bash
# Installs what the tests need on top of scripts/install.sh's: pytest and its plugins,
# matplotlib (the plot scripts), and the client stacks of tests/clients; checks for CMake (the
# GoogleTests). pip's own messages are kept in a log and shown only when an install fails (its
# dependency-resolver notes about the client stacks' unused extras are expected, see below).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
t0=$SECONDS

command -v cmake >/dev/null || { echo "install_test: cmake is needed for the C++ tests" >&2; exit 1; }

pip_quiet() {  # pip_quiet PYTHON ARGS...: pip install, its output shown only if it fails
  local py=$1 log
  shift
  log=$(mktemp)
  if "$py" -m pip install --quiet "$@" >"$log" 2>&1; then rm -f "$log"; return 0; fi
  cat "$log" >&2
  rm -f "$log"
  return 1
}

missing=()
for spec in pytest:pytest pytest_timeout:pytest-timeout matplotlib:matplotlib \
    expecttest:expecttest; do
  "$PY" -c "import ${spec%%:*}" 2>/dev/null || missing+=("${spec##*:}")
done
if ((${#missing[@]})); then
  echo "install_test: ${missing[*]}"
  pip_quiet "$PY" "${missing[@]}"
fi

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
  echo "install_test: $1" >&2
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
    echo "install_test: client packages ${todo[*]}"
    pip_quiet "$PY" -c "$pin" "${todo[@]}" \
      || client_fail "could not install ${todo[*]}: tests/clients will skip them"
  fi
  mapfile -t todo < <(not_installed "$PY" "${NO_DEPS[@]}")
  if ((${#todo[@]})); then
    echo "install_test: client packages ${todo[*]} (without dependencies)"
    pip_quiet "$PY" --no-deps "${todo[@]}" \
      || client_fail "could not install ${todo[*]}: tests/clients will skip them"
  fi
  if [[ ! -x "$TORCHTUNE_VENV/bin/python" ]]; then
    echo "install_test: virtual environment $TORCHTUNE_VENV (system site packages visible)"
    "$PY" -m venv --system-site-packages "$TORCHTUNE_VENV" \
      || client_fail "could not create $TORCHTUNE_VENV: tests/clients/test_torchtune.py will skip"
  fi
  if [[ -x "$TORCHTUNE_VENV/bin/python" ]]; then
    mapfile -t todo < <(not_installed "$TORCHTUNE_VENV/bin/python" "${TUNE[@]}")
    if ((${#todo[@]})); then
      echo "install_test: ${todo[*]} into $TORCHTUNE_VENV"
      pip_quiet "$TORCHTUNE_VENV/bin/python" -c "$pin" "${todo[@]}" \
        || client_fail "could not install ${todo[*]}: tests/clients/test_torchtune.py will skip"
    fi
  fi
  rm -f "$pin"
  echo "install_test: client packages ready ($((SECONDS - start)) s)"
fi
echo "install_test: done ($((SECONDS - t0)) s)"
