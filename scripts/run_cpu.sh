#!/usr/bin/env bash
# No GPU, no network: the whole job shrunk to about five minutes on a 2-core CPU (or Apple MPS).
# set-up -> prepare the embedded corpus -> train a tiny model (~2-3 min) -> evaluate bits-per-byte -> show the report.
#   bash scripts/run_cpu.sh                              # the tiny vanilla decoder
#   bash scripts/run_cpu.sh --config multiscreen-tiny    # the tiny Multiscreen model
#   bash scripts/run_cpu.sh --data-dir DIR --tag NAME    # a corpus you prepared (default tag: cpu-<config>-<DIR name>)
#   bash scripts/run_cpu.sh --resume auto                # continue a stopped or killed run
# Other flags go to scripts.base_train (python -m scripts.base_train --help lists them) and override the ones below.
# Each command is printed before it runs, so it can be rerun or changed by hand.
source "$(dirname "$0")/env.sh"
ppt_help "$0" "$@"
config=tiny data_dir="" tag="" out_dir="" args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --config|--data-dir|--tag|--out-dir)
            [ $# -ge 2 ] || { echo "error: $1 needs a value (see --help)" >&2; exit 2; }
            name="${1#--}"; value="$2"; shift 2 ;;
        --config=*|--data-dir=*|--tag=*|--out-dir=*)
            name="${1%%=*}"; name="${name#--}"; value="${1#*=}"; shift ;;
        *) args+=("$1"); shift; continue ;;
    esac
    printf -v "${name//-/_}" '%s' "$value"  # --data-dir sets $data_dir
done
ppt_env --extra cpu --extra eval
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
cache="${PPT_CACHE:-$HOME/.cache/ppt}"
tag="${tag:-cpu-$config${data_dir:+-$(basename "$data_dir")}}"  # a corpus of your own is not the demo run resumed
run() {
    printf '+ uv run --no-sync python'; printf ' %q' "$@"; printf '\n'
    uv run --no-sync python "$@"
}

# The token budget fits about 2-3 minutes of training: ~0.9M tokens is about one epoch of the demo corpus. Every
# architecture trains on 128-token rows and scores the same val tokens, so that scripts.compare sets their runs side by
# side. On CPU Multiscreen's screening runs its plain-PyTorch reference, slower than attention, so it trains on fewer
# tokens (at the higher learning rate it needs) in the same time. An architecture of your own whose CPU path is slower
# gets the vanilla budget: pass --target-tokens to shorten it.
case "$config" in
    multiscreen*) budget=(--seq-len 128 --total-batch-tokens 4096 --target-tokens 5e5 --lr 1e-2 --warmup-tokens 2e4) ;;
    *) budget=(--seq-len 128 --total-batch-tokens 8192 --target-tokens 9e5 --lr 3e-3 --warmup-tokens 4e4) ;;
esac

if [ -z "$data_dir" ]; then
    data_dir="$cache/data/demo"
    echo "== 1/3 prepare the embedded demo corpus (no network) =="
    run -m scripts.prepare_fineweb --source demo --out "$data_dir"
else
    echo "== 1/3 use the prepared corpus in $data_dir =="
fi

echo "== 2/3 train $config on CPU =="
run -m scripts.base_train --config "$config" --data-dir "$data_dir" --tag "$tag" "${budget[@]}" \
    --device-batch-size 32 --optimizer adamw --schedule wsd --eval-every 25 --eval-tokens 16384 \
    --save-every 50 --log-every 5 ${out_dir:+--out-dir "$out_dir"} ${args[@]+"${args[@]}"}

echo "== 3/3 evaluate =="
run -m scripts.base_eval --model-tag "$tag" --data-dir "$data_dir" --demo-task
