"""Multi-GPU check: N ranks under torchrun against one process with the same global batch, and a resume on N ranks.

    python -m bench.check_ddp --config smollm-135m --nproc 2 --steps 20
    python -m bench.check_ddp --config multiscreen-d16 --seq-len 4096 --optimizer aurora --nproc 2

Four runs of `scripts.base_train` on synthetic shards (learnable phrases by default): one process with gradient
accumulation over N micro-batches; N ranks with one micro-batch each (the same rows per optimizer step); N ranks
stopped halfway with a checkpoint; and that run resumed on N ranks. Prints the loss of every step side by side and
the largest differences; exits 1 when they exceed --tolerance. Not a test: it needs several accelerators (on CPU it
runs gloo ranks, for trying it out).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import launcher
from ppt.common import (
    COMPILE_CHOICES,
    ArgumentParser,
    Number,
    PPTError,
    nonneg_float,
    nonneg_int,
    positive_float,
    positive_int,
    run_cli,
)
from ppt.optim import OPTIMIZERS
from ppt.synthetic import write_synthetic_data


def run(cmd: list[str], env: dict[str, str]) -> None:
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-5000:])
        raise PPTError(f"a run exited with status {proc.returncode}; its output is above")


def losses(report: Path) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in json.loads(report.read_text())["history"] if "loss" in h}


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="smollm-135m")
    p.add_argument("--nproc", type=positive_int, default=2)
    p.add_argument("--steps", type=Number(int, 2), default=20, help="at least 2 (the resume run stops halfway)")
    p.add_argument("--seq-len", type=positive_int, default=2048)
    p.add_argument("--device-batch-size", type=positive_int, default=4)
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    p.add_argument("--lr", type=positive_float, help="peak LR (default: the optimizer's); on random tokens a rising "
                   "loss amplifies every rounding difference, so pick one at which the loss falls")  # fmt: skip
    p.add_argument("--phrases", type=nonneg_int, default=1000, help="synthetic text drawn from this many random "
                   "8-token phrases, so the loss falls and gradients carry signal (0: uniform noise)")  # fmt: skip
    p.add_argument("--compile", choices=COMPILE_CHOICES, default="off",
                   help="for every run (off: the check is about DDP, not speed)")  # fmt: skip
    p.add_argument("--tolerance", type=nonneg_float, default=1e-3, help="largest allowed |loss difference| per step")
    args = p.parse_args(argv)

    total_batch = args.device_batch_size * args.seq_len * args.nproc
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = tmp / "data"
        write_synthetic_data(data, 49152, total_batch * (args.steps + 2), 1024, seed=0, phrases=args.phrases)
        env = {**os.environ, "PPT_CACHE": str(tmp / "cache")}
        common = [
            "-m", "scripts.base_train", "--config", args.config, "--data-dir", str(data),
            "--seq-len", str(args.seq_len), "--device-batch-size", str(args.device_batch_size),
            "--total-batch-tokens", str(total_batch), "--optimizer", args.optimizer, "--compile", args.compile,
            "--target-tokens", str(total_batch * args.steps), "--warmup-tokens", str(total_batch * 2),
            "--eval-every", "0", "--eval-tokens", str(args.seq_len * args.nproc), "--save-every", "0", "--keep", "0",
            "--deterministic",  # else two identical GPU runs already differ, and AdamW amplifies it on random tokens
            *(["--lr", str(args.lr)] if args.lr else []),
        ]  # fmt: skip
        run([*launcher(1), *common, "--tag", "one", "--out-dir", str(tmp / "one")], env)
        run([*launcher(args.nproc), *common, "--tag", "ddp", "--out-dir", str(tmp / "ddp")], env)
        resumed = [*common, "--tag", "resumed", "--out-dir", str(tmp / "resumed")]
        run([*launcher(args.nproc), *resumed, "--max-steps", str(args.steps // 2)], env)
        run([*launcher(args.nproc), *resumed, "--resume", "auto"], env)
        one, ddp, res = (losses(tmp / name / f"{name}.json") for name in ("one", "ddp", "resumed"))

    print(f"\n| step | 1 process, accum {args.nproc} | {args.nproc} ranks | difference | {args.nproc} ranks, resumed |")
    print("|---|---|---|---|---|")
    for step in sorted(one):
        print(f"| {step} | {one[step]:.5f} | {ddp[step]:.5f} | {ddp[step] - one[step]:+.2e} | {res[step]:.5f} |")
    ddp_diff = max(abs(ddp[s] - one[s]) for s in one)
    resume_diff = max(abs(res[s] - ddp[s]) for s in ddp)
    print(f"\nmax |loss difference|: {args.nproc} ranks vs 1 process {ddp_diff:.2e}; resumed vs uninterrupted "
          f"{resume_diff:.2e} (tolerance {args.tolerance:g})")  # fmt: skip
    if max(ddp_diff, resume_diff) > args.tolerance:
        sys.exit(1)


if __name__ == "__main__":
    run_cli(main)
