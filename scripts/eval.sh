#!/usr/bin/env bash
# Evaluate a trained checkpoint: FineWeb NLL + bits-per-byte, then the lm-eval suite.
#   bash scripts/eval.sh --model-tag smollm-360m [--protocol ppt|mor] [--tasks a,b] [--limit N]
source "$(dirname "$0")/env.sh"
ppt_env --extra "$(ppt_backend)" --extra eval
exec uv run --no-sync python -m scripts.base_eval "$@"
