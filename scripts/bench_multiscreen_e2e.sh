#!/usr/bin/env bash
# End-to-end Multiscreen training throughput: ppt against the public seed training script, same GPU, the same
# 262,144-token steps of 4096-token rows, synthetic data for both. The seed script is not part of ppt: copy it (and
# its gen_bin_data.py and wandb_stub/) into .ref/ first.
#   bash scripts/bench_multiscreen_e2e.sh 16        # Psi = 16; also 24, 32
#   bash scripts/bench_multiscreen_e2e.sh 24 4      # the seed in 4 micro-batches (one of 262,144 tokens won't fit)
#   bash scripts/bench_multiscreen_e2e.sh 24 4 seed # only the seed (or: ppt)
source "$(dirname "$0")/env.sh"
ppt_help "$0" "$@"
[ $# -ge 1 ] || { echo "error: say which Psi to run, e.g. bash scripts/bench_multiscreen_e2e.sh 16 (see --help)" >&2; exit 2; }
psi="$1"
seed_accum="${2:-1}"
which="${3:-both}"
out="${TMPDIR:-/tmp}/ms_e2e_d${psi}"
mkdir -p "$out"

if [ "$which" != seed ]; then
    echo "== ppt multiscreen-d${psi} =="
    python3 -m scripts.bench_train --config "multiscreen-d${psi}" --seq-len 4096 --device-batch-size 32 \
        --total-batch-tokens 262144 --optimizer aurora --steps 12 --out "$out/ppt.json" 2>&1 | tail -4 || true
fi
[ "$which" != ppt ] || exit 0

echo "== seed script, DEPTH=${psi}, GRAD_ACCUM_STEPS=${seed_accum} =="
[ -f .ref/multiscreen_gist.py ] || { echo "no .ref/multiscreen_gist.py: seed baseline skipped"; exit 0; }
data="${TMPDIR:-/tmp}/seed_data"
[ -d "$data" ] || python3 .ref/gen_bin_data.py "$data"
DATA_PATH="$data" TRAIN_FILES="fineweb_train_*.bin" VAL_FILES="fineweb_val_*.bin" DEPTH="$psi" TRAIN_STEPS=12 \
    TRAIN_BATCH_SIZE=262144 GRAD_ACCUM_STEPS="$seed_accum" TRAIN_MAX_SEQ_LEN=4096 VAL_TOKENS=262144 VAL_BATCH_SIZE=262144 \
    VAL_PERIOD=1000 KERNEL_WARMUP_TRAIN_STEPS=3 KERNEL_WARMUP_VAL_STEPS=1 PYTHONPATH=.ref/wandb_stub \
    python3 .ref/multiscreen_gist.py > "$out/seed.log" 2>&1 || { tail -20 "$out/seed.log"; exit 1; }
python3 - "$out/seed.log" <<'PY'
import re, statistics, sys
times = [float(t) for t in re.findall(r"step:\d+/\d+ train_loss:\S+ .* step_time:([\d.]+)s", open(sys.argv[1]).read())]
measured = times[5:] or times
print(f"seed: {len(measured)} steps measured, median step {statistics.median(measured):.3f}s, "
      f"{262144 / statistics.median(measured):,.0f} tok/s")
PY
