"""bench_screening's flags and inputs (the seed's benchmark shape, two packings of documents), our kernels or another
commit's kernel file, and their check against float64.

The inputs: 16 rows of 4096 tokens (65,536, the seed's benchmark), 16 heads, dK 16, dV 64, windows
exp(linspace(0, ln 256, H)) + 1 (the model's initial windows), rho 2 (r = 0.5), bf16 unit-norm q/k/v. Two packings:
`uniform` (one document per row) and `mixed` (log-normal document lengths, median ~450, capped at the row length).
"""

from __future__ import annotations

import argparse
import math
import os
import types
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from bench.common import require_cuda
from ppt.common import ArgumentParser, PPTError, nonneg_int, positive_float, positive_int
from ppt.kernels import screening_triton as kernels
from ppt.kernels.screening import screening, screening_metadata, screening_reference

TOLERANCE = 2e-2  # bf16 operands: relative error of h and the gradients against float64
SHIPPED_PLANS = {"forward": kernels.FORWARD_PLAN, "dq": kernels.DQ_PLAN, "dkdv": kernels.DKDV_PLAN}


def parser(doc: str) -> ArgumentParser:
    """bench_screening's parser with the flags of its inputs: the shape, their seed and the device."""
    p = ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=positive_int, default=65536)
    p.add_argument("--row-len", type=positive_int, default=4096, help="T: tokens per row (and the longest document)")
    p.add_argument("--heads", type=positive_int, default=16)
    p.add_argument("--dk", type=positive_int, default=16)
    p.add_argument("--dv", type=positive_int, default=64)
    p.add_argument("--rho", type=positive_float, default=2.0, help="acceptance multiplier 1/r (model init r = 0.5)")
    p.add_argument("--seed", type=nonneg_int, default=0)
    p.add_argument("--device", default="cuda", help="cuda; cpu only under TRITON_INTERPRET=1 (a smoke test)")
    return p


def checked(args: argparse.Namespace) -> argparse.Namespace:
    """args, once the device can run the kernels and the rows divide the tokens."""
    if args.device == "cuda":
        require_cuda("bench_screening")
    elif os.environ.get("TRITON_INTERPRET") != "1":
        raise PPTError(f"--device {args.device} runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
    if args.tokens % args.row_len:
        raise PPTError(f"--tokens {args.tokens} must be a multiple of --row-len {args.row_len}")
    return args


# ----------------------------------------------------------------------------------------------------------------------
# Inputs


def document_lengths(packing: str, rows: int, row_len: int, seed: int) -> list[list[int]]:
    """Per row, the lengths of its documents (a document never crosses a row)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rows):
        if packing == "uniform":
            out.append([row_len])
            continue
        lengths, used = [], 0
        while used < row_len:
            n = int(torch.exp(torch.randn((), generator=g) * 1.1 + math.log(450.0)))
            n = min(max(16, n), row_len - used)
            lengths.append(n)
            used += n
        out.append(lengths)
    return out


def make_case(lengths: list[list[int]], row_len: int, args: argparse.Namespace) -> dict:
    """Unit q, k, v, a gradient (bf16; fp32 in the interpreter), windows, rho, doc_pos and metadata."""
    B, T, H, device = len(lengths), row_len, args.heads, args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the interpreter's dots take fp32
    g = torch.Generator().manual_seed(args.seed)

    def unit(*shape: int) -> torch.Tensor:
        return torch.nn.functional.normalize(torch.randn(*shape, generator=g), dim=-1).to(device, dtype)

    doc_pos = torch.stack([torch.cat([torch.arange(n, dtype=torch.int32) for n in row]) for row in lengths]).to(device)
    windows = torch.exp(torch.linspace(0, math.log(256.0), H)) + 1  # the model's initial windows
    return dict(
        q=unit(B, T, H, args.dk), k=unit(B, T, H, args.dk), v=unit(B, T, H, args.dv),
        grad_out=torch.randn(B, T, H, args.dv, generator=g).to(device, dtype),
        window=windows.to(device), rho=torch.full((H,), args.rho, device=device),
        doc_pos=doc_pos, meta=screening_metadata(doc_pos), lengths=lengths,
    )  # fmt: skip


def cases(args: argparse.Namespace, packings: tuple[str, ...] = ("uniform", "mixed")) -> dict[str, dict]:
    """{packing: case} at the benchmark's shape."""
    rows = args.tokens // args.row_len
    return {p: make_case(document_lengths(p, rows, args.row_len, args.seed), args.row_len, args) for p in packings}


# ----------------------------------------------------------------------------------------------------------------------
# Implementations


@dataclass
class Impl:
    """fwd(c) -> h; bwd(c) -> (dq, dk, dv, d window, d rho); train(c) -> (fwd+bwd as training calls it, the leaves
    whose gradients it fills)."""

    fwd: Callable[[dict], torch.Tensor]
    bwd: Callable[[dict], tuple]
    train: Callable[[dict], tuple[Callable[[], object], list[torch.Tensor]]]


def kernel_file(module: types.ModuleType) -> Impl:
    """A screening_triton.py (ours or another commit's) at its own plans; train: its forward, then its backward."""

    def fwd(c: dict) -> torch.Tensor:
        return module.screening_forward(c["q"], c["k"], c["v"], c["window"], c["rho"], c["meta"][0])

    def bwd(c: dict) -> tuple:
        return module.screening_backward(c["q"], c["k"], c["v"], c["window"], c["rho"], *c["meta"], c["grad_out"])

    return Impl(fwd, bwd, lambda c: ((lambda: (fwd(c), bwd(c))), []))


def ours() -> Impl:
    """Our kernels with the shipped plans. train: the op through autograd, as the model calls it."""

    def train(c: dict) -> tuple[Callable[[], object], list[torch.Tensor]]:
        leaves = [c[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "window", "rho")]
        return lambda: screening(*leaves, c["meta"]).backward(c["grad_out"]), leaves

    return replace(kernel_file(kernels), train=train)


# ----------------------------------------------------------------------------------------------------------------------
# Correctness on the device


def reference_case(args: argparse.Namespace) -> tuple[dict, list[torch.Tensor]]:
    """A smaller case (2 rows of 2048 tokens, or of --row-len if shorter; mixed documents) and its float64 h and
    gradients."""
    T = min(2048, args.row_len)
    case = make_case(document_lengths("mixed", 2, T, args.seed + 1), T, args)
    leaves = [case[n].double().requires_grad_() for n in ("q", "k", "v", "window", "rho")]
    out = screening_reference(*leaves, case["meta"])
    grads = torch.autograd.grad(out, leaves, case["grad_out"].double())
    return case, [out.detach(), *grads]


def passes(label: str, impl: Impl, check: tuple[dict, list[torch.Tensor]]) -> bool:
    """Prints max |error| / max |reference| of h and of the five gradients; True when none is over TOLERANCE."""
    case, refs = check
    errors = {}
    for name, x, ref in zip(("h", "dq", "dk", "dv", "dwindow", "drho"), [impl.fwd(case), *impl.bwd(case)], refs):
        err = (x.double() - ref).abs().max() / ref.abs().max().clamp(min=1e-12)
        errors[name] = float(err) if torch.isfinite(x).all() else math.inf
    worst = max(errors.values())
    verdict = "ok" if worst <= TOLERANCE else f"FAIL (> {TOLERANCE}), not timed"
    print(f"check {label:<22} " + " ".join(f"{k} {v:.1e}" for k, v in errors.items()) + f"  {verdict}", flush=True)
    return worst <= TOLERANCE
