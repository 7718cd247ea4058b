#!/usr/bin/env bash
# Set up the environment (uv + CPU extras + eval + dev) and run the test suite. Extra args go to pytest:
#   bash scripts/test.sh tests/test_data.py -x
source "$(dirname "$0")/env.sh"
ppt_help "$0" "$@"
ppt_env --extra cpu --extra eval --extra dev
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec uv run --no-sync python -m pytest "$@"
