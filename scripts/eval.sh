#!/usr/bin/env bash
# Evaluate a trained checkpoint: FineWeb NLL + bits-per-byte, then the lm-eval suite.
#   bash scripts/eval.sh --model-tag smollm-360m [--protocol ppt|mor] [--tasks a,b] [--limit N]
# Flags go to scripts.base_eval (python -m scripts.base_eval --help lists them).
source "$(dirname "$0")/env.sh"
ppt_help "$0" "$@"
ppt_env --extra "$(ppt_backend)" --extra eval
exec uv run --no-sync python -m scripts.base_eval "$@"
