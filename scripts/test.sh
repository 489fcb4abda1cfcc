#!/usr/bin/env bash
# Runs every test: installs/builds if needed (scripts/install.sh, then the test-only
# dependencies: scripts/install_test.sh), then GoogleTest (CMake/CTest), then pytest.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

bash scripts/install.sh
bash scripts/install_test.sh

echo "== C++ tests (GoogleTest via CTest)"
build=build/cpp-tests
cmake -S tests/cpp -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" -j "$(nproc)" >/dev/null
ctest --test-dir "$build" --output-on-failure --timeout 300
"$build/planner_tests" --gtest_filter='PlannerOptimality.*' | grep '^\[ planner \]' || true

echo "== Python tests (pytest)"
set +e
"$PY" -m pytest tests -q "$@"
status=$?
set -e
if ((status == 5)); then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit $status
