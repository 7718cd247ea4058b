"""The vanilla decoder's attention at a config's shapes: forward and forward+backward time of each path.

    python -m bench.bench_attention --config smollm-360m --batch-size 16
    python -m bench.bench_attention --flex-options '{"BLOCK_M": 128, "BLOCK_N": 64}' '{"num_warps": 8}'
    python -m bench.bench_attention --autotune    # and the tiles Inductor's max-autotune picks (it logs them)

Paths: FlexAttention with document masks, compiled as the model compiles it (the block mask built inside the
graph), with its default kernel options and then with each --flex-options set; and SDPA on plain causal rows
through each backend that runs (flash, cuDNN, memory-efficient), the cost of attention without document masks.
doc_pos comes from documents of exponentially distributed length, like bench_train's data. Forwards run with
autograd on, as in training. CUDA only; prints one markdown row per path.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import flex_attention

from bench.common import require_cuda
from ppt.common import ArgumentParser, PPTError, positive_int, run_cli
from ppt.kernels.attention import document_mask
from ppt.model import get_config


def exponential_doc_pos(batch: int, seq_len: int, mean_doc_len: int, generator: torch.Generator) -> torch.Tensor:
    """(batch, seq_len) int32 positions within documents whose lengths are exponential with the given mean."""
    starts = torch.rand(batch, seq_len, generator=generator) < 1.0 / mean_doc_len
    starts[:, 0] = True
    index = torch.arange(seq_len).expand(batch, seq_len)
    last_start = torch.where(starts, index, 0).cummax(dim=1).values
    return (index - last_start).to(torch.int32)


def cuda_time(fn: Callable[[], object], iters: int) -> float:
    """Mean seconds per call, after three warm-up calls."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / iters


def flex_path(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_pos: torch.Tensor, gqa: bool, options: dict
) -> Callable[[], torch.Tensor]:
    """Document-masked FlexAttention compiled as the model compiles it: the block mask built inside the graph."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_pos: torch.Tensor) -> torch.Tensor:
        mask = document_mask(doc_pos, flex=True)
        return flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa, kernel_options=options or None)

    compiled = torch.compile(attend)
    return lambda: compiled(q, k, v, doc_pos)


def sdpa_path(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool, backend: SDPBackend
) -> Callable[[], torch.Tensor]:
    def attend() -> torch.Tensor:
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    return attend


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="smollm-360m")
    p.add_argument("--batch-size", type=positive_int, default=16)
    p.add_argument("--seq-len", type=positive_int, default=2048)
    p.add_argument("--mean-doc-len", type=positive_int, default=1024)
    p.add_argument("--iters", type=positive_int, default=20)
    p.add_argument("--flex-options", nargs="*", default=[], help="JSON dicts of FlexAttention kernel_options to try")
    p.add_argument(
        "--autotune",
        action="store_true",
        help="also FlexAttention under Inductor's max-autotune (slow to compile; logs each config it times)",
    )
    args = p.parse_args(argv)
    option_sets = [{}]
    for text in args.flex_options:
        try:
            options = json.loads(text)
        except json.JSONDecodeError:
            options = None
        if not isinstance(options, dict):
            raise PPTError(f"--flex-options {text!r} is not a JSON dict; write e.g. '{{\"BLOCK_M\": 64}}'")
        option_sets.append(options)
    require_cuda("bench_attention")

    config = get_config(args.config)
    B, T, H, Hkv, D = args.batch_size, args.seq_len, config.n_head, config.n_kv_head, config.head_dim
    g = torch.Generator().manual_seed(0)
    doc_pos = exponential_doc_pos(B, T, args.mean_doc_len, g).cuda()
    q, k, v = (torch.randn(B, h, T, D, generator=g).cuda().bfloat16().requires_grad_() for h in (H, Hkv, Hkv))
    grad_out = torch.randn(B, H, T, D, generator=g).cuda().bfloat16()
    print(
        f"{args.config}: B={B} T={T} heads {H} (kv {Hkv}) head_dim {D}, mean document {args.mean_doc_len} tokens, "
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}",
        flush=True,
    )

    rows = ["| path | forward ms | forward+backward ms |", "|---|---|---|"]

    def report(name: str, attend: Callable[[], torch.Tensor]) -> None:
        try:
            forward = cuda_time(attend, args.iters)
            both = cuda_time(lambda: attend().backward(grad_out), args.iters)
            rows.append(f"| {name} | {1000 * forward:.3f} | {1000 * both:.3f} |")
        except Exception as error:  # a backend that does not run here is a row, not the end of the benchmark
            rows.append(f"| {name} | failed: {type(error).__name__}: {str(error)[:80]} | |")
        print(rows[-1], flush=True)

    gqa = H != Hkv
    for options, autotune in [(options, False) for options in option_sets] + [({}, True)] * args.autotune:
        torch.compiler.reset()
        name = "max-autotune" if autotune else json.dumps(options) if options else "default options"
        with torch._inductor.config.patch(max_autotune=autotune):
            report(f"FlexAttention, document masks, {name}", flex_path(q, k, v, doc_pos, gqa, options))
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        report(f"SDPA {backend.name.lower()}, plain causal", sdpa_path(q, k, v, gqa, backend))
    print("\n" + "\n".join(rows))


if __name__ == "__main__":
    run_cli(main)
