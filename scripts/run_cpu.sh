#!/usr/bin/env bash
# No GPU, no network: the whole job shrunk to a few minutes on CPU (or Apple MPS).
# set-up -> prepare the embedded corpus -> train a tiny model -> evaluate bits-per-byte -> show the report.
#   bash scripts/run_cpu.sh                              # the tiny vanilla decoder
#   bash scripts/run_cpu.sh --config multiscreen-tiny    # the tiny Multiscreen model
# Other flags go to scripts.base_train (see python -m scripts.base_train --help).
source "$(dirname "$0")/env.sh"
config=tiny
args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --config) config="$2"; shift 2 ;;
        --config=*) config="${1#*=}"; shift ;;
        *) args+=("$1"); shift ;;
    esac
done
ppt_env --extra cpu --extra eval
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
cache="${PPT_CACHE:-$HOME/.cache/ppt}"
tag="cpu-$config"
run() { uv run --no-sync python "$@"; }

echo "== 1/3 prepare the embedded demo corpus (no network) =="
run -m scripts.prepare_fineweb --source demo --out "$cache/data/demo"

echo "== 2/3 train $config on CPU =="
run -m scripts.base_train --config "$config" --data-dir "$cache/data/demo" --tag "$tag" \
    --seq-len 256 --total-batch-tokens 8192 --device-batch-size 16 --target-tokens 1.2e6 \
    --optimizer adamw --lr 3e-3 --schedule wsd --warmup-tokens 5e4 --eval-every 50 --eval-tokens 65536 \
    --save-every 100 --log-every 10 ${args[@]+"${args[@]}"}

echo "== 3/3 evaluate =="
run -m scripts.base_eval --model-tag "$tag" --data-dir "$cache/data/demo" --eval-tokens 131072 --demo-task
