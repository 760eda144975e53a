#!/usr/bin/env bash
# Trains with one process per GPU on this machine:
#
#   scripts/train_single_node.sh [--run-dir runs/first --max-steps 5000 ...]
#   NPROC=4 scripts/train_single_node.sh ...
#
# A worker that dies restarts the whole group (up to 3 times), which resumes from the newest
# checkpoint in --run-dir. The rendezvous is explicit (c10d on 127.0.0.1), not --standalone: a
# --standalone group fails to re-form after a worker dies.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
nproc="${NPROC:-$(python -c 'import torch; print(max(torch.cuda.device_count(), 1))')}"
exec torchrun --nnodes 1 --nproc-per-node "$nproc" \
    --rdzv-backend c10d --rdzv-endpoint "127.0.0.1:${MASTER_PORT:-29500}" --max-restarts 3 \
    -m everything train "$@"
