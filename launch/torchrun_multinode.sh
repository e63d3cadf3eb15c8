#!/usr/bin/env bash
# Run on every node of a job (same command, same shared --save directory), Megatron-style variables:
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0.example MASTER_PORT=29500 GPUS_PER_NODE=8 \
#       launch/torchrun_multinode.sh --user-script my_trainer.py --zero-2-memory-optimization ...
# rapidlite starts torchrun's agent on each node (static rendezvous at MASTER_ADDR:MASTER_PORT).
set -euo pipefail
exec rapidlite \
    --nnodes "${NNODES:?number of nodes}" --node-rank "${NODE_RANK:?rank of this node}" \
    --master-addr "${MASTER_ADDR:?host of node 0}" --master-port "${MASTER_PORT:-29500}" \
    --nproc-per-node "${GPUS_PER_NODE:-$(python -c 'import torch; print(max(torch.cuda.device_count(), 1))')}" \
    "$@"
