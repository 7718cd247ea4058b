"""The training loss through the tied head: linear_cross_entropy (its gradient taken in the forward) against
F.linear + F.cross_entropy, both compiled, forward and backward under bf16 autocast as training runs them (fp32 x
and weight), at Multiscreen-d16's micro-batch by default (32 rows of 4096 tokens, d 256, vocabulary 49,152).

    python -m bench.bench_cross_entropy              # side by side: kernel time, wall time, peak memory, agreement
    python -m bench.bench_cross_entropy --sweep      # also the op's kernel alone at other blocks

Kernel time is the kernels' own device time per fwd+bwd (torch.profiler), wall time triton's do_bench of the same
call. Needs CUDA.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from bench.common import kernel_times, print_kernel_times, require_cuda
from ppt.common import ArgumentParser, positive_int, run_cli
from ppt.kernels import cross_entropy_triton
from ppt.kernels.cross_entropy import linear_cross_entropy

SWEEP = [(2048, 4), (4096, 8), (4096, 16), (8192, 8), (8192, 16), (16384, 16), (16384, 32)]
GRAD_SCALE = 0.5  # the incoming gradient of two micro-batches of gradient accumulation


def unfused(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The head and loss as autograd takes them: logits, their fp32 log-softmax, the gradient in the backward."""
    return F.cross_entropy(F.linear(x, weight).float().flatten(0, -2), targets.flatten(), ignore_index=-1)


def fwd_bwd(loss_fn: Callable, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> Callable[[], object]:
    def call() -> torch.Tensor:
        with torch.autocast("cuda", torch.bfloat16):
            loss = loss_fn(x, weight, targets)
        (loss * GRAD_SCALE).backward()
        return loss

    return call


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=positive_int, default=32 * 4096, help="rows of logits (default 131,072)")
    p.add_argument("--d-model", type=positive_int, default=256)
    p.add_argument("--vocab-size", type=positive_int, default=49152)
    p.add_argument("--sweep", action="store_true", help="also time the op's kernel alone at other blocks")
    args = p.parse_args(argv)
    require_cuda("bench_cross_entropy")  # the CPU tests check the same op's numbers
    import triton.testing

    g = torch.Generator(device="cuda").manual_seed(0)
    N, d, V = args.tokens, args.d_model, args.vocab_size
    x = torch.randn(N, d, device="cuda", generator=g).requires_grad_()
    weight = (torch.randn(V, d, device="cuda", generator=g) / d**0.5).requires_grad_()
    targets = torch.randint(0, V, (N,), device="cuda", generator=g)
    targets[::97] = -1  # some ignored targets, as document ends give
    print(f"{N:,} rows x vocabulary {V:,}, d {d}, bf16 autocast; {torch.cuda.get_device_name()}, torch "
          f"{torch.__version__}")  # fmt: skip

    results, grads = {}, {}
    for name, loss_fn in [("F.linear + F.cross_entropy", unfused), ("linear_cross_entropy", linear_cross_entropy)]:
        call = fwd_bwd(torch.compile(loss_fn), x, weight, targets)
        x.grad = weight.grad = None
        loss = call()
        grads[name] = (loss.detach(), x.grad.clone(), weight.grad.clone())
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        x.grad = weight.grad = None
        call()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        wall = triton.testing.do_bench(call, grad_to_none=[x, weight], rep=300)
        times = kernel_times(call, [x, weight])
        results[name] = (sum(ms for ms, _ in times.values()), wall, peak)
        print_kernel_times(name, times)

    ref = grads["F.linear + F.cross_entropy"]
    print("\n| loss and head fwd+bwd | kernel ms | wall ms | peak GiB above inputs | rel. diff loss / dx / dW |")
    print("|---|---|---|---|---|")
    for name, (kernel_ms, wall, peak) in results.items():
        diff = [float((a.double() - b.double()).abs().max() / b.double().abs().max()) for a, b in zip(grads[name], ref)]
        print(f"| {name} | {kernel_ms:.3f} | {wall:.3f} | {peak:.2f} | {' / '.join(f'{e:.1e}' for e in diff)} |")

    if args.sweep:
        z = F.linear(x.detach(), weight.detach()).bfloat16()
        print("\n| blocks (BLOCK_V, warps) | op kernel ms |\n|---|---|")
        for blocks in SWEEP:  # z is overwritten in every call
            ms = triton.testing.do_bench(partial(cross_entropy_triton.cross_entropy_grad_, z, targets, blocks), rep=200)
            print(f"| {blocks}{' (default)' if blocks == cross_entropy_triton.FORWARD_BLOCKS else ''} | {ms:.3f} |")


if __name__ == "__main__":
    run_cli(main)
