#!/usr/bin/env bash
# Fine-tune a Hugging Face model on a text-classification dataset, one process.
# Usage: launch/finetune_sequence_classification.sh MODEL_NAME_OR_DIR DATA_PATH [DATA_NAME] [extra flags...]
#   e.g. launch/finetune_sequence_classification.sh bert-base-cased glue mrpc --save runs/mrpc
set -euo pipefail
model=${1:?model name or directory}
data=${2:?dataset name or local directory}
shift 2
name_args=()
if [ $# -gt 0 ] && [[ "$1" != --* ]]; then
    name_args=(--data-name "$1")
    shift
fi

exec rapidlite --task sequence_classification \
    --pretrained-model-name-or-path "$model" \
    --data-path "$data" "${name_args[@]}" \
    --epochs 3 --micro-batch-size 16 --global-batch-size 64 \
    --lr 2e-5 --lr-decay-style linear --lr-warmup-iters 100 \
    --weight-decay 1e-2 --clip-grad 1.0 --seed 42 \
    --mixed-precision "$@"
