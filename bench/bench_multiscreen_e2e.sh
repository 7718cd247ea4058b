#!/usr/bin/env bash
# End-to-end Multiscreen training throughput: ppt against the public seed training script, same GPU, the same
# 262,144-token steps of 4096-token rows, synthetic data for both (ppt: bench.bench_train's shards; the seed: its
# own gen_bin_data.py). The seed script is not part of ppt: --ref names the folder that holds its
# multiscreen_gist.py, gen_bin_data.py and wandb_stub/ (default .ref/ of the checkout).
usage() {
    cat <<'EOF'
usage: bash bench/bench_multiscreen_e2e.sh PSI [SEED_ACCUM] [both|ppt|seed] [--ref DIR] [--steps N] [--compile-mode M]

  PSI         Multiscreen size: 16, 24 or 32 (ppt's multiscreen-dPSI, the seed's DEPTH=PSI)
  SEED_ACCUM  the seed's GRAD_ACCUM_STEPS (default 1: one micro-batch of 262,144 tokens; Psi 24 needs 4 on an H200)
  both|ppt|seed  which side to run (default both)
  --ref DIR   the seed's folder (default .ref/ of the checkout)
  --steps N   optimizer steps per side (default 12; the first 5 are warm-up and not measured)
  --compile-mode M  ppt's torch.compile mode (default: default; reduce-overhead replays the step from CUDA graphs)

  bash bench/bench_multiscreen_e2e.sh 16          # ppt, then the seed script, on one GPU
  bash bench/bench_multiscreen_e2e.sh 24 4        # the seed with GRAD_ACCUM_STEPS=4
  bash bench/bench_multiscreen_e2e.sh 24 4 seed --ref /path/to/seed
  bash bench/bench_multiscreen_e2e.sh 16 --compile-mode reduce-overhead
EOF
}
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
fail() { echo "error: $*" >&2; exit 2; }

positional=()
ref="$root/.ref"
steps=12
compile_mode=default
while [ $# -gt 0 ]; do
    case "$1" in
        -h | --help) usage; exit 0 ;;
        --ref) [ $# -ge 2 ] || fail "--ref needs a folder"; ref="$2"; shift 2 ;;
        --ref=*) ref="${1#*=}"; shift ;;
        --steps) [ $# -ge 2 ] || fail "--steps needs a number"; steps="$2"; shift 2 ;;
        --steps=*) steps="${1#*=}"; shift ;;
        --compile-mode) [ $# -ge 2 ] || fail "--compile-mode needs a mode"; compile_mode="$2"; shift 2 ;;
        --compile-mode=*) compile_mode="${1#*=}"; shift ;;
        -*) fail "unknown option $1; see --help" ;;
        *) positional+=("$1"); shift ;;
    esac
done
[ ${#positional[@]} -ge 1 ] || fail "give PSI (16, 24 or 32) as the first argument; see --help"
[ ${#positional[@]} -le 3 ] || fail "too many arguments (${positional[*]}); see --help"
psi="${positional[0]}"
seed_accum="${positional[1]:-1}"
which="${positional[2]:-both}"
case "$psi" in 16 | 24 | 32) ;; *) fail "PSI must be 16, 24 or 32 (ppt has multiscreen-d16/24/32), got $psi" ;; esac
[[ "$seed_accum" =~ ^[1-9][0-9]*$ ]] || fail "SEED_ACCUM must be a positive integer, got $seed_accum"
[[ "$steps" =~ ^[0-9]+$ ]] && [ "$steps" -gt 5 ] || fail "--steps must be more than 5 (the first 5 are not measured)"
case "$which" in both | ppt | seed) ;; *) fail "the third argument must be both, ppt or seed, got $which" ;; esac
case "$compile_mode" in default | reduce-overhead | max-autotune-no-cudagraphs | max-autotune) ;;
    *) fail "--compile-mode must be default, reduce-overhead, max-autotune-no-cudagraphs or max-autotune, got $compile_mode" ;;
esac
if [ "$which" != ppt ]; then
    for f in multiscreen_gist.py gen_bin_data.py wandb_stub; do
        [ -e "$ref/$f" ] || fail "the seed baseline needs $ref/$f: copy the seed's folder there, pass --ref DIR, or run ppt alone (third argument ppt)"
    done
fi
ref="$(cd "$ref" 2>/dev/null && pwd || echo "$ref")"  # absolute: the runs below start in the checkout
cd "$root"
out="${TMPDIR:-/tmp}/ms_e2e_d${psi}"
mkdir -p "$out"

if [ "$which" != seed ]; then
    echo "== ppt multiscreen-d${psi}, compile mode ${compile_mode} =="
    python3 -m bench.bench_train --config "multiscreen-d${psi}" --seq-len 4096 --device-batch-size 32 \
        --total-batch-tokens 262144 --optimizer aurora --steps "$steps" --out "$out/ppt.json" \
        --compile-mode "$compile_mode" 2>&1 | tail -4 || true
fi
[ "$which" != ppt ] || exit 0

echo "== seed script, DEPTH=${psi}, GRAD_ACCUM_STEPS=${seed_accum} =="
data="${TMPDIR:-/tmp}/seed_data"
[ -d "$data" ] || python3 "$ref/gen_bin_data.py" "$data"
DATA_PATH="$data" TRAIN_FILES="fineweb_train_*.bin" VAL_FILES="fineweb_val_*.bin" DEPTH="$psi" TRAIN_STEPS="$steps" \
    TRAIN_BATCH_SIZE=262144 GRAD_ACCUM_STEPS="$seed_accum" TRAIN_MAX_SEQ_LEN=4096 VAL_TOKENS=262144 VAL_BATCH_SIZE=262144 \
    VAL_PERIOD=1000 KERNEL_WARMUP_TRAIN_STEPS=3 KERNEL_WARMUP_VAL_STEPS=1 PYTHONPATH="$ref/wandb_stub" \
    python3 "$ref/multiscreen_gist.py" > "$out/seed.log" 2>&1 || { tail -20 "$out/seed.log"; exit 1; }
python3 - "$out/seed.log" <<'PY'
import re, statistics, sys
times = [float(t) for t in re.findall(r"step:\d+/\d+ train_loss:\S+ .* step_time:([\d.]+)s", open(sys.argv[1]).read())]
measured = times[5:] or times
print(f"seed: {len(measured)} steps measured, median step {statistics.median(measured):.3f}s, "
      f"{262144 / statistics.median(measured):,.0f} tok/s (its log gives step times to the ms)")
PY
