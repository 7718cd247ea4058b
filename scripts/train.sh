#!/usr/bin/env bash
# The SmolLM-360M baseline recipe: seq 2048, 524,288-token batches, 20B tokens, one GPU.
# Extra flags go to scripts.base_train (python -m scripts.base_train --help lists them); --resume auto continues a
# stopped or killed run. For several GPUs use
#   torchrun --nproc_per_node=8 -m scripts.base_train --config smollm-360m --target-tokens 20e9
source "$(dirname "$0")/env.sh"
ppt_help "$0" "$@"
ppt_env --extra "$(ppt_backend)"
exec uv run --no-sync python -m scripts.base_train --config smollm-360m --seq-len 2048 \
    --total-batch-tokens 524288 --target-tokens 20e9 --tag smollm-360m "$@"
