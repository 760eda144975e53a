#!/usr/bin/env bash
# Trains on several machines. Run it on every node with the same MASTER_ADDR (an address of the
# first node that the others reach) and NNODES, and each node's own NODE_RANK:
#
#   MASTER_ADDR=10.0.0.1 NNODES=2 NODE_RANK=0 scripts/train_multi_node.sh --run-dir /shared/runs/a
#   MASTER_ADDR=10.0.0.1 NNODES=2 NODE_RANK=1 scripts/train_multi_node.sh --run-dir /shared/runs/a
#
# --run-dir must be on storage every node sees: rank 0 writes the checkpoints, every rank reads
# them when the group restarts after a failure (up to 3 times) and resumes from the newest one.
# runtime/launch.py is torchrun with exit statuses a scheduler can read: 143 or 130 for a stop
# signal, 2 at once for a refusal (never restarted), 1 with the failed rank's line.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
# torchrun keeps one store for all restarts unless told otherwise; a restarted group would read the
# addresses the dead one left there and fail to connect ("Gloo connectFullMesh failed").
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
# torchrun passes these signals on to its workers, which stop after the step in progress with its
# checkpoint written; SIGUSR1 is not among its defaults (PET_ sets torchrun's --signals-to-handle).
export PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1
nproc="${NPROC_PER_NODE:-$(python -c 'import torch; print(max(torch.cuda.device_count(), 1))')}"
exec python -m everything.runtime.launch --nnodes "${NNODES:?set NNODES}" --node-rank "${NODE_RANK:?set NODE_RANK}" \
    --nproc-per-node "$nproc" --rdzv-id "${RDZV_ID:-everything}" \
    --rdzv-backend c10d --rdzv-endpoint "${MASTER_ADDR:?set MASTER_ADDR}:${MASTER_PORT:-29500}" \
    --max-restarts 3 -m everything train "$@"
