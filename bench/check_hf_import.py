"""Check the Hugging Face import on a real checkpoint: the ppt model built from the folder gives transformers' logits
in fp32, and scores real English text as a trained model does (bits per byte well below 2).

    python -m bench.check_hf_import --hf-dir PATH          # e.g. SmolLM2-135M (docs/benchmarks.md has a run)

The text is the documentation of the Python standard library's help() topics (`pydoc_data.topics`: English technical
prose that ships with every Python), tokenized with the folder's tokenizer, each topic a document after an EOT, as
prepare_fineweb writes a shard. It goes through a temporary val shard into ppt's data loader, so bits per byte is
`evaluate_bpb` over the batches base_eval would score. The logits of the first batch's rows are compared without a
document mask (transformers knows none); needs the eval extra. Exits with an error line if the logits differ by more
than --atol or the bpb is not below --max-bpb.
"""

from __future__ import annotations

import argparse
import pydoc_data.topics
import tempfile
import time
from itertools import chain
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

import ppt.model
from ppt.common import ArgumentParser, PPTError, positive_float, positive_int, run_cli, token_count
from ppt.data import DataLoader
from ppt.loss_eval import evaluate_bpb
from ppt.model_io import ModelFile, load_run, load_tokenizer_for
from ppt.shards import shard_path, write_shard


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-dir", type=Path, required=True, help="a Hugging Face Llama folder (config.json + safetensors)")
    p.add_argument("--device", default="cpu", help="where both models run, in fp32 (default cpu)")
    p.add_argument("--seq-len", type=positive_int, default=2048, help="tokens per row (default 2048)")
    p.add_argument("--batch-size", type=positive_int, default=2,
                   help="rows per forward; the first batch's logits are compared")  # fmt: skip
    p.add_argument("--eval-tokens", type=token_count, default=2**15, help="text tokens to score (default 32,768)")
    p.add_argument("--atol", type=positive_float, default=1e-3,
                   help="largest |logit difference| accepted (default 1e-3)")  # fmt: skip
    p.add_argument("--max-bpb", type=positive_float, default=2.0,
                   help="bits per byte a trained model stays below (default 2)")  # fmt: skip
    args = p.parse_args(argv)
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as exc:
        raise PPTError("transformers is not installed: uv sync --extra eval") from exc
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 on a GPU too
    device = torch.device(args.device)
    model_file = ModelFile.of(ppt.model)
    run = load_run(hf_dir=args.hf_dir, model_file=model_file)
    model = model_file.build_from_checkpoint(run, device)
    tokenizer, _ = load_tokenizer_for(run)
    reference = AutoModelForCausalLM.from_pretrained(args.hf_dir, dtype=torch.float32).to(device).eval()
    print(f"{args.hf_dir}: {run.config}; torch {torch.__version__}, {device}, fp32")

    texts = [pydoc_data.topics.topics[name] for name in sorted(pydoc_data.topics.topics)]
    stream = np.array([tokenizer.eot_id, *chain.from_iterable(tokenizer.encode_batch(texts))], dtype=np.int64)
    with tempfile.TemporaryDirectory(prefix="ppt_check_hf_") as data_dir:
        write_shard(
            shard_path(data_dir, "val", 0),
            stream,
            vocab_size=tokenizer.vocab_size,
            eot_id=tokenizer.eot_id,
            fingerprint=tokenizer.fingerprint,
            demo=False,
            tokenizer_name=tokenizer.name,
        )
        loader = DataLoader(data_dir, "val", args.batch_size, args.seq_len, device=device)
        inputs, _, _ = next(loader.val_batches(args.batch_size * args.seq_len))
        started = time.perf_counter()
        diff, largest = 0.0, 0.0
        with torch.no_grad():
            for row in inputs.split(1):  # one row at a time: a row's logits alone are T x vocab x 4 bytes
                ours, theirs = model(row), reference(row).logits
                diff = max(diff, (ours - theirs).abs().max().item())
                largest = max(largest, theirs.abs().max().item())
        print(
            f"logits of {len(inputs)} rows x {args.seq_len} tokens: max |ppt - transformers| = {diff:.3g} "
            f"(largest |logit| {largest:.1f}; {time.perf_counter() - started:.0f} s)"
        )
        started = time.perf_counter()
        budget = int(args.eval_tokens)
        batches = tqdm(loader.val_batches(budget), total=-(-budget // (args.seq_len * args.batch_size)), desc="bpb")
        bpb = evaluate_bpb(model, batches, tokenizer.token_bytes().to(device))
    print(
        f"bits per byte {bpb['bpb']:.4f}, NLL {bpb['nll']:.4f} nats/token over {bpb['tokens']:,} tokens "
        f"({bpb['bytes']:,} bytes) of the {len(pydoc_data.topics.topics)} help() topics "
        f"({len(stream):,} tokens), document-masked ({time.perf_counter() - started:.0f} s)"
    )
    failed = [f"logits differ by {diff:.3g} > --atol {args.atol}"] if diff > args.atol else []
    failed += [f"bpb {bpb['bpb']:.4f} is not below --max-bpb {args.max_bpb}"] if not bpb["bpb"] < args.max_bpb else []
    if failed:
        raise PPTError(f"check failed: {'; '.join(failed)}")
    print("check passed")


if __name__ == "__main__":
    run_cli(main)
