#!/usr/bin/env bash
# Sets up a fresh machine (dependencies, build) and runs the main job.
#
# Until fully_shard lands, the main job is the planner benchmark; arguments go to it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
"${PYTHON:-python3}" benchmarks/planner.py "$@"
