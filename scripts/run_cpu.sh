#!/usr/bin/env bash
# No GPU, no network: the whole job shrunk to about five minutes on a 2-core CPU (or Apple MPS).
# set-up -> prepare the embedded corpus -> train a tiny model (~2-3 min) -> evaluate bits-per-byte -> show the report.
#   bash scripts/run_cpu.sh                              # the tiny vanilla decoder
#   bash scripts/run_cpu.sh --config multiscreen-tiny    # the tiny Multiscreen model
# Other flags go to scripts.base_train (see python -m scripts.base_train --help) and override the ones below.
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

# The token budget fits about 2-3 minutes of training: ~0.9M tokens is about one epoch of the demo corpus. On CPU
# Multiscreen's screening runs its plain-PyTorch reference, whose cost grows with the square of the row length, so
# it trains on shorter rows and fewer tokens (at the higher learning rate it needs) in the same time.
case "$config" in
    multiscreen*) budget=(--seq-len 128 --total-batch-tokens 4096 --target-tokens 5e5 --lr 1e-2 --warmup-tokens 2e4) ;;
    *) budget=(--seq-len 256 --total-batch-tokens 8192 --target-tokens 9e5 --lr 3e-3 --warmup-tokens 4e4) ;;
esac

echo "== 1/3 prepare the embedded demo corpus (no network) =="
run -m scripts.prepare_fineweb --source demo --out "$cache/data/demo"

echo "== 2/3 train $config on CPU =="
run -m scripts.base_train --config "$config" --data-dir "$cache/data/demo" --tag "$tag" "${budget[@]}" \
    --device-batch-size 32 --optimizer adamw --schedule wsd --eval-every 25 --eval-tokens 16384 \
    --save-every 50 --log-every 5 ${args[@]+"${args[@]}"}

echo "== 3/3 evaluate =="
run -m scripts.base_eval --model-tag "$tag" --data-dir "$cache/data/demo" --demo-task
