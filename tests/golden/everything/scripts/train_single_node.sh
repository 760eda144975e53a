#!/usr/bin/env bash
# Trains with one process per GPU on this machine:
#
#   scripts/train_single_node.sh [--run-dir runs/first --max-steps 5000 ...]
#   NPROC=4 scripts/train_single_node.sh ...
#
# A worker that dies restarts the whole group (up to 3 times), which resumes from the newest
# checkpoint in --run-dir. runtime/launch.py is torchrun with exit statuses a scheduler can read: 143
# or 130 for a stop signal, 2 at once for a refusal (never restarted), 1 with the failed rank's line.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
# torchrun keeps one store for all restarts unless told otherwise; a restarted group would read the
# addresses the dead one left there and fail to connect ("Gloo connectFullMesh failed").
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
# torchrun passes these signals on to its workers, which stop after the step in progress with its
# checkpoint written; SIGUSR1 is not among its defaults (PET_ sets torchrun's --signals-to-handle).
export PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1
nproc="${NPROC:-$(python -c 'import torch; print(max(torch.cuda.device_count(), 1))')}"
# The rendezvous on a free port (0, as torchrun's --standalone), unless MASTER_PORT names one: two
# jobs on one machine sharing 29500 would join each other's rendezvous and fail to connect.
exec python -m everything.runtime.launch --nnodes 1 --nproc-per-node "$nproc" \
    --rdzv-backend c10d --rdzv-endpoint "127.0.0.1:${MASTER_PORT:-0}" --max-restarts 3 \
    -m everything train "$@"
