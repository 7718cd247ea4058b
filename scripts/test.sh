#!/usr/bin/env bash
# Set up the environment (uv + CPU extras + eval + slurm + dev) and run the test suite. Extra args go to pytest:
#   bash scripts/test.sh tests/test_data.py -x
source "$(dirname "$0")/env.sh"
ppt_help "$0" "$@"
ppt_env --extra cpu --extra eval --extra slurm --extra dev
# Many tests start Python processes of their own; where PYTHONDONTWRITEBYTECODE is set, each would compile torch's
# sources again (a tiny base_train run: 13.4 s without .pyc files, 8.7 s with them). So a fresh environment gets its
# bytecode compiled once (about a minute on 2 cores; a later sync with --compile-bytecode would redo it every time).
uv run --no-sync python -c 'import importlib.util as u, os, sys
sys.exit(os.path.isdir(os.path.join(u.find_spec("torch").submodule_search_locations[0], "__pycache__")))' &&
    ppt_env --extra cpu --extra eval --extra slurm --extra dev --compile-bytecode
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec uv run --no-sync python -m pytest "$@"
