"""Validation bits-per-byte throughput: `evaluate_bpb` over a token budget, the code base_eval and base_train run.

    python -m bench.bench_bpb --config smollm-360m --eval-tokens 10485760 --batch-size 16,32 --compile on,off

Randomly initialised weights (the time does not depend on them) and synthetic val shards (uniform random tokens,
documents of exponentially distributed length), so nothing is downloaded. Each variant first scores one batch to
compile and warm up, then the whole budget, timed; prints one markdown row per variant.
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
import time
from pathlib import Path

import torch

from bench.common import CommaList
from ppt.common import COMPILE_CHOICES, ArgumentParser, init_runtime, maybe_compile, positive_int, run_cli, token_count
from ppt.data import DataLoader
from ppt.loss_eval import DEFAULT_EVAL_TOKENS, evaluate_bpb
from ppt.model import DEFAULT_CONFIG, build_model, get_config
from ppt.synthetic import synthetic_tokenizer, write_synthetic_data


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=DEFAULT_CONFIG, help=f"a config of ppt/model.py (default {DEFAULT_CONFIG})")
    p.add_argument("--seq-len", type=positive_int, default=2048)
    p.add_argument("--batch-size", type=CommaList(positive_int), default="16", help="comma list of rows per forward")
    p.add_argument("--eval-tokens", type=token_count, default=DEFAULT_EVAL_TOKENS)
    p.add_argument("--compile", type=CommaList(COMPILE_CHOICES), default="on", help="comma list of on/off/auto")
    p.add_argument("--mean-doc-len", type=positive_int, default=1024)
    args = p.parse_args(argv)

    rt = init_runtime()
    config = get_config(args.config)
    budget = int(args.eval_tokens)
    with torch.device("meta"):
        model = build_model(config)
    model.to_empty(device=rt.device)
    model.init_weights()
    token_bytes = synthetic_tokenizer(config.vocab_size).token_bytes().to(rt.device)
    print(
        f"{args.config}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, {budget:,} val tokens, "
        f"{rt.device} {str(rt.dtype).removeprefix('torch.')}, torch {torch.__version__}",
        flush=True,
    )
    rows = [
        "| config | compile | batch | tokens | warm-up s | seconds | tok/s | bpb |",
        "|---|---|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp)
        write_synthetic_data(data_dir, config.vocab_size, 65_536, args.mean_doc_len, seed=0, val_tokens=budget + 1)
        for compile_choice, batch in itertools.product(args.compile, args.batch_size):
            torch.compiler.reset()
            scored = maybe_compile(model, compile_choice, rt.device)
            loader = DataLoader(data_dir, "val", batch, args.seq_len, device=rt.device)
            t0 = time.perf_counter()
            evaluate_bpb(scored, loader.val_batches(batch * args.seq_len), token_bytes, rt.dtype)
            warm = time.perf_counter() - t0
            t0 = time.perf_counter()
            result = evaluate_bpb(scored, loader.val_batches(budget), token_bytes, rt.dtype)  # ends in a host sync
            seconds = time.perf_counter() - t0
            row = (
                f"| {args.config} | {compile_choice} | {batch} | {result['tokens']:,} | {warm:.1f} | {seconds:.2f} | "
                f"{result['tokens'] / seconds:,.0f} | {result['bpb']:.4f} |"
            )
            rows.append(row)
            print(row, flush=True)
    print("\n" + "\n".join(rows))


if __name__ == "__main__":
    run_cli(main)
