"""End-to-end training throughput: the real step (loader, forward, backward, optimizer, logging) on synthetic shards.

    python -m bench.bench_train --config smollm-360m --device-batch-size 16 --compile on,off
    python -m bench.bench_train --config multiscreen-d16 --seq-len 4096 --optimizer aurora --doc-masks on
    python -m bench.bench_train --config smollm-360m --steps 15 --profile    # and where the real step's time goes
    python -m bench.bench_train --config d4,multiscreen-d11 --seq-len 1024 --device-batch-size 32 --vocab-size 8192
                                  # architectures side by side: compare their comparison TFLOP/s (SPEC.md's rule)

Each variant runs `scripts.base_train --benchmark` in a fresh process on a synthetic data directory (uniform random
tokens, documents of exponentially distributed length separated by EOT, a byte-level vocabulary of the config's
size), so the numbers need no download. Prints one markdown row per variant and writes them as JSON with --out; a
variant that failed shows its exit status in its row, and the tool then exits 2. With several architectures (config
classes) the final table sets each row's comparison TFLOP/s against another architecture's at its parameter count
(interpolated between two of its rows that bracket it, else its nearest row), with the same compile and document-mask
settings: the per-FLOP rate at equal size.
Flags this script does not know go to every base_train run (for example --compile-mode default,
--loader-prefetch 0, --lr 1e-3).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import CommaList, launcher
from ppt.common import COMPILE_CHOICES, ArgumentParser, Number, PPTError, positive_int, run_cli, token_count
from ppt.model import DEFAULT_CONFIG, get_config
from ppt.optim import OPTIMIZERS
from ppt.synthetic import write_synthetic_data

ON_OFF = ("on", "off")
MEASURED_AFTER = 5  # base_train --benchmark leaves the first 5 steps out of its figures


def run_variant(base_args: list[str], extra: list[str], nproc: int) -> tuple[dict, str]:
    """The benchmark summary of one base_train run, and its stdout."""
    cmd = [*launcher(nproc), "-m", "scripts.base_train", *base_args, *extra, "--benchmark"]
    print("$", " ".join(cmd[1:]), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("benchmark ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        return {"error": f"exit {proc.returncode}"}, proc.stdout
    return json.loads(lines[-1].removeprefix("benchmark ")), proc.stdout


def config_names(text: str) -> list[str]:
    """An argparse `type=` for a comma list of config names, each checked by ppt/model.py's get_config."""
    names = text.split(",")
    try:
        for name in names:
            get_config(name)  # an unknown name raises, listing the valid ones
    except PPTError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return names


def main(argv: list[str] | None = None) -> None:
    # no abbreviations: base_train's flags pass through whole (--device is no short --device-batch-size here)
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument(
        "--config", type=config_names, default=[DEFAULT_CONFIG], help=f"comma list (default {DEFAULT_CONFIG})"
    )
    p.add_argument("--seq-len", type=positive_int, default=2048)
    p.add_argument("--device-batch-size", type=positive_int, default=16)
    p.add_argument("--total-batch-tokens", type=token_count, help="default: one device batch (no accumulation)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    steps_help = f"steps per variant, more than {MEASURED_AFTER}: the first {MEASURED_AFTER} are not measured"
    p.add_argument("--steps", type=Number(int, MEASURED_AFTER + 1), default=20, help=steps_help)
    p.add_argument("--compile", type=CommaList(COMPILE_CHOICES), default="on", help="comma list of on/off/auto")
    p.add_argument("--doc-masks", type=CommaList(ON_OFF), default="on", help="comma list of on (document masks) / off")
    p.add_argument("--nproc", type=positive_int, default=1, help="GPUs: more than 1 launches through torchrun (DDP)")
    p.add_argument("--vocab-size", type=Number(int, 258, 2**32 - 1), default=49152)
    p.add_argument("--mean-doc-len", type=positive_int, default=1024)
    p.add_argument("--profile", action="store_true", help="where steps 6-8's time went (steps 5-9 left out of figures)")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    args, base_train_flags = p.parse_known_args(argv)  # the rest goes to every scripts.base_train run
    if args.profile and args.steps < 10:
        raise PPTError(f"--profile needs --steps of 10 or more (got {args.steps}): steps 5-9 are left out as profiled")

    total_batch = args.total_batch_tokens or args.device_batch_size * args.seq_len * args.nproc
    train_tokens = total_batch * (args.steps + 1) + args.seq_len * args.device_batch_size
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp) / "data"
        write_synthetic_data(data_dir, args.vocab_size, train_tokens, args.mean_doc_len, seed=0)
        base = [
            "--data-dir", str(data_dir), "--seq-len", str(args.seq_len),
            "--device-batch-size", str(args.device_batch_size), "--total-batch-tokens", str(total_batch),
            "--optimizer", args.optimizer, "--max-steps", str(args.steps), "--target-tokens", "1e12",
            "--out-dir", str(Path(tmp) / "out"), "--log-every", "5", *base_train_flags,
        ]  # fmt: skip
        for config, compile_choice, masks in itertools.product(args.config, args.compile, args.doc_masks):
            extra = ["--config", config, "--compile", compile_choice] + ([] if masks == "on" else ["--no-doc-masks"])
            extra += ["--profile"] if args.profile else []
            summary, stdout = run_variant(base, extra, args.nproc)
            result = {"config": config, "compile": compile_choice, "doc_masks": masks, "seq_len": args.seq_len,
                      "device_batch": args.device_batch_size, "total_batch": total_batch, "optimizer": args.optimizer,
                      "base_train_flags": " ".join(base_train_flags), **summary}  # fmt: skip
            results.append(result)
            if args.profile:
                print("\n".join(line for line in stdout.splitlines() if not line.startswith(("step ", "benchmark "))))
            print(format_row(result), flush=True)
    add_shares_at_equal_parameters(results)
    print("\n| config | compile | doc masks | tok/s | comparison TFLOP/s | MFU | MFU (6N) | step s | data | optimizer "
          "| peak GB | against the other architecture at equal parameters |\n" + "|---" * 12 + "|")  # fmt: skip
    for r in results:
        share = r.get("share_at_equal_parameters")
        print(format_row(r) + (f" {100 * share['share']:.0f}% of {share['config']} |" if share else " - |"))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    failed = [f"--config {r['config']} --compile {r['compile']} --doc-masks {r['doc_masks']}" for r in results
              if "error" in r]  # fmt: skip
    if failed:
        raise PPTError(f"{len(failed)} of {len(results)} variants failed ({'; '.join(failed)}); their output is above")


def add_shares_at_equal_parameters(results: list[dict]) -> None:
    """Give each measured row "share_at_equal_parameters": its comparison TFLOP/s over another config class's at its
    parameter count, with the same compile and document-mask settings: interpolated in log(parameters) between that
    class's nearest rows below and above it where it has both, else that of its row nearest in parameters (by
    ratio)."""
    measured = [r for r in results if "error" not in r]
    for r in measured:
        others = [
            o for o in measured
            if type(get_config(o["config"])) is not type(get_config(r["config"]))
            and (o["compile"], o["doc_masks"]) == (r["compile"], r["doc_masks"])
        ]  # fmt: skip
        below = [o for o in others if o["params"] <= r["params"]]
        above = [o for o in others if o["params"] > r["params"]]
        if below and above:
            lo, hi = max(below, key=lambda o: o["params"]), min(above, key=lambda o: o["params"])
            t = math.log(r["params"] / lo["params"]) / math.log(hi["params"] / lo["params"])
            rate = lo["comparison_tflops"] + t * (hi["comparison_tflops"] - lo["comparison_tflops"])
            name = lo["config"] if t == 0 else f"{lo['config']}-{hi['config']} at {r['params'] / 1e6:.1f}M parameters"
        elif others:
            o = min(others, key=lambda o: abs(math.log(o["params"] / r["params"])))
            rate, name = o["comparison_tflops"], o["config"]
        else:
            continue
        r["share_at_equal_parameters"] = {"config": name, "share": r["comparison_tflops"] / rate}


def format_row(r: dict) -> str:
    if "error" in r:
        return f"| {r['config']} | {r['compile']} | {r['doc_masks']} | {r['error']} |"
    shares = [f"{100 * r[key]:.1f}%" if key in r else "-" for key in ("mfu", "mfu_6n", "data_share", "optimizer_share")]
    return (
        f"| {r['config']} | {r['compile']} | {r['doc_masks']} | {r['tok_per_s']:,.0f} | {r['comparison_tflops']:.1f} | "
        f"{shares[0]} | {shares[1]} | "
        f"{r['step_time_s']:.3f} | {shares[2]} | {shares[3]} | {r.get('peak_memory_gb', 0):.1f} |"
    )


if __name__ == "__main__":
    run_cli(main)
