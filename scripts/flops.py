"""Where a training step's compute goes, for a config of ppt/model.py: the traced cost table (FLOPs and bytes per
pass and op class), FLOPs per token (MFU convention and comparison rule), a device's peaks, utilization and roofline
time (ppt/flops.py, ppt/roofline.py; docs/flops.md).

    python -m scripts.flops --config smollm-360m --device h100
    python -m scripts.flops --config multiscreen-d16 --seq-len 4096 --batch-size 1 --device h200
    python -m scripts.flops --config multiscreen-d11 --vocab-size 8192 --batch-size 32 --seq-len 1024 --device h200
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch

import ppt.model
from ppt.common import ArgumentParser, PPTError, positive_float, positive_int, run_cli
from ppt.comparison_flops import comparison_flops_rule
from ppt.devices import DEVICES
from ppt.flops import NO_FORMULAS, cost
from ppt.formatting import si
from ppt.model import build_model, get_config
from ppt.roofline import report

OP_FORMULAS = getattr(ppt.model, "OP_FORMULAS", NO_FORMULAS)  # optional in model.py (SPEC.md)


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="a config name ppt.model.get_config resolves (default: the model's DEFAULT_CONFIG)")
    p.add_argument("--depth", type=positive_int, help="the depth dial instead of a named config")
    p.add_argument("--batch-size", type=positive_int, default=8)
    p.add_argument("--seq-len", type=positive_int, help="tokens per row (default: the config's max_seq_len)")
    p.add_argument("--vocab-size", type=positive_int, help="a tokenizer's vocabulary instead of the config's")
    p.add_argument("--device", default="h100", help=f"one of {', '.join(DEVICES)}, a CUDA device name, or cpu")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--duration-sec", type=positive_float, help="a measured step time: adds achieved utilization")
    args = p.parse_args(argv)
    config = get_config(args.config, args.depth)
    config = replace(config, vocab_size=args.vocab_size or config.vocab_size)
    with torch.device("meta"):
        model = build_model(config)
    if sum(p.numel() for p in model.parameters()) <= 100_000_000:
        # small enough to materialize: learned per-head values (e.g. screening windows) are then read at their
        # initial values, so window-limited ops count in-window pairs instead of the every-pair upper bound
        model.to_empty(device="cpu")
        model.init_weights()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    seq_len = args.seq_len or config.max_seq_len
    step = cost(model, args.batch_size, seq_len, dtype, OP_FORMULAS)
    print(report(step, args.device, dtype, args.duration_sec))
    rule = comparison_flops_rule(model, seq_len, OP_FORMULAS)
    if rule.untraced:
        raise PPTError(rule.warning())
    pairs_only = rule.mixers and not rule.dense  # else the warning below says what was not counted by pairs
    counted = "over the pairs they need" if pairs_only else "NOT all over the pairs they need"
    per_token, six_n = rule.per_token(), 6 * rule.params_matmul
    print(
        f"\nFLOPs/token, comparison rule (one document per row): {si(per_token)} = 6N {si(six_n)} + mixers "
        f"{si(per_token - six_n)} {counted} (the MFU convention counts SDPA over all T x T pairs)"
    )
    if warning := rule.warning():
        print(f"warning: {warning}")


if __name__ == "__main__":
    run_cli(main)
