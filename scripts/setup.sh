#!/usr/bin/env bash
# Sets up a fresh machine (dependencies, build) and runs the main job: training the example
# Llama model with veragged.fully_shard on 4 processes (CPU/gloo, or CUDA/NCCL when 4 GPUs are
# present), saving a DCP checkpoint in ./llama_ckpt and resuming from it on the next run.
# Arguments go to examples/train_llama.py (e.g. --steps 60 --bf16).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
"${PYTHON:-python3}" -m torch.distributed.run --nproc-per-node "${NPROC:-4}" examples/train_llama.py "$@"
