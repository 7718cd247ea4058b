"""Multiscreen's gated output projection, y = sum_head (tanh_norm(h) * tanh(silu(g)))_head @ w_head^T, on one GPU.

    python -m bench.bench_gated_output                       # Multiscreen-d16's micro-batch: 32 x 4096 tokens
    python -m bench.bench_gated_output --tokens 131072 --heads 24 --d-value 64 --d-model 576

Two implementations, fwd and fwd+bwd, bf16, each under torch.compile as the model runs it: the reference (plain
PyTorch: inductor's fused elementwise kernels and two cuBLAS matmuls, one more in the backward) and the op
`ppt::gated_output` (gated_output_triton.py's forward kernel; its backward torch ops fused by inductor). Prints the
device time of each (its kernels' own time by torch.profiler, over 10 calls) and the wall time of a call
(triton.testing.do_bench, median), and the error of each against float64 on a slice of the rows.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial

import torch

from bench.common import kernel_times, median_ms, require_cuda
from ppt.common import ArgumentParser, positive_int, run_cli


def device_ms(fn: Callable[[], object]) -> float:
    """The device time of the kernels one call of fn launches, their own times summed (torch.profiler, 10 calls)."""
    return sum(ms for ms, _ in kernel_times(fn, []).values())


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=positive_int, default=32 * 4096, help="rows of h and g (batch x sequence)")
    p.add_argument("--heads", type=positive_int, default=16)
    p.add_argument("--d-value", type=positive_int, default=64)
    p.add_argument("--d-model", type=positive_int, default=256)
    args = p.parse_args(argv)
    require_cuda("bench_gated_output")
    from ppt.kernels.gated_output import gated_output, gated_output_reference

    torch.manual_seed(0)
    N, H, dV, d = args.tokens, args.heads, args.d_value, args.d_model
    h = (torch.randn(1, N, H, dV, device="cuda") * 0.3).bfloat16()
    g = torch.randn(1, N, H, dV, device="cuda").bfloat16()
    w = (torch.randn(H, d, dV, device="cuda") * 0.05).bfloat16()
    grad_y = torch.randn(1, N, d, device="cuda").bfloat16()
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; {N} tokens, {H} heads, dV {dV}, d {d}, bf16")

    variants = {"reference": torch.compile(gated_output_reference), "ppt::gated_output": torch.compile(gated_output)}
    leaves = [t.detach().requires_grad_() for t in (h, g, w)]

    rows = slice(0, 4096)  # float64 check on a slice: the reference's einsum in float64 over every row is slow
    exact = [t.double().requires_grad_() for t in (h[:, rows], g[:, rows], w)]
    ref_y = gated_output_reference(*exact)
    refs = (ref_y, *torch.autograd.grad(ref_y, exact, grad_y[:, rows].double()))
    for name, fn in variants.items():
        part = [t.detach().requires_grad_() for t in (h[:, rows], g[:, rows], w)]
        y = fn(*part)
        got = (y, *torch.autograd.grad(y, part, grad_y[:, rows]))
        errors = [(a.double() - b).abs().max().item() / b.abs().max().item() for a, b in zip(got, refs)]
        print(f"check {name:22s} " + " ".join(f"{n} {e:.1e}" for n, e in zip(("y", "dh", "dg", "dw"), errors)))

    print("\n| implementation | fwd device ms | fwd+bwd device ms | fwd wall ms | fwd+bwd wall ms |")
    print("|---|---|---|---|---|")
    for name, fn in variants.items():
        forward, train = partial(fn, h, g, w), partial(fwd_bwd, fn, leaves, grad_y)
        print(f"| {name} | {device_ms(forward):.3f} | {device_ms(train):.3f} | {median_ms(forward):.3f} | "
              f"{median_ms(train):.3f} |")  # fmt: skip


def fwd_bwd(fn: Callable, leaves: list[torch.Tensor], grad_y: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The op's forward and backward as training takes them: the gradients of fn(*leaves) for grad_y."""
    return torch.autograd.grad(fn(*leaves), leaves, grad_y)


if __name__ == "__main__":
    run_cli(main)
