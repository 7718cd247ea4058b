"""Time the screening kernels on a CUDA GPU, side by side with the seed's kernel (and --baseline), in one command.

    python -m bench.bench_screening                      # ours and the seed's: fwd, fwd+bwd, two packings
    python -m bench.bench_screening --profile --baseline .ref/screening_triton_c4ba8bb.py

The inputs: 16 rows of 4096 tokens (65,536, the seed's benchmark), 16 heads, dK 16, dV 64, windows
exp(linspace(0, ln 256, H)) + 1 (the model's initial windows), rho 2 (r = 0.5), bf16 unit-norm q/k/v, in two packings:
`uniform` (one document per row) and `mixed` (log-normal document lengths, median ~450, capped at the row length). In
order:
  check      every implementation timed below against a float64 reference on the GPU (2 rows of 2048 tokens, mixed
             documents): max |error| / max |reference| of h and of the five gradients; one over 2e-2 is not timed
  times      medians of triton.testing.do_bench (L2 flushed between runs): the op as the model calls it (fwd; fwd and
             autograd backward), the per-batch metadata, the seed's op, and --baseline; and the device time of one
             fwd+bwd (its kernels' own time by torch.profiler: the host's speed left out)
  --profile  the device time of that fwd+bwd by kernel, for every implementation (uniform packing)
The seed's kernel is imported from --ref/multiscreen_gist.py (its wandb import stubbed, nothing trained); copy the
seed's folder there. --baseline takes a ppt/kernels/screening_triton.py of another commit (`git show
REV:ppt/kernels/screening_triton.py > .ref/screening_triton_REV.py`), timed on the same inputs.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch
import triton

from bench.common import kernel_times, load_module, median_ms, print_kernel_times, python_file, require_cuda
from ppt.common import ArgumentParser, PPTError, nonneg_int, positive_float, positive_int, run_cli
from ppt.kernels import screening_triton as kernels
from ppt.kernels.screening import screening, screening_cost, screening_metadata, screening_reference

TOLERANCE = 2e-2  # bf16 operands: relative error of h and the gradients against float64
SHIPPED_PLANS = {"forward": kernels.FORWARD_PLAN, "dq": kernels.DQ_PLAN, "dkdv": kernels.DKDV_PLAN}


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


# ----------------------------------------------------------------------------------------------------------------------
# The seed's kernel


def load_seed(args: argparse.Namespace) -> types.ModuleType | None:
    """The seed's module, imported without running its training (its wandb import is stubbed), or None."""
    path = args.ref / "multiscreen_gist.py"
    if not path.is_file():
        return None
    os.environ.update(COMPILE_MODEL="0", KEY_DIM=str(args.dk), VALUE_DIM=str(args.dv))  # read at its import
    sys.modules.setdefault("wandb", types.ModuleType("wandb"))
    return load_module("multiscreen_gist", path)


def seed_impl(seed: types.ModuleType) -> Impl:
    """The seed's op in its layout, (H, total tokens, D) and cumulative document lengths; its r enters as our rho
    (both compute max(1 - r (1 - s), 0)^2 from the multiplier they are given). It builds its metadata in every call."""

    def flat(x: torch.Tensor) -> torch.Tensor:  # (B, T, H, D) -> (H, B T, D)
        return x.reshape(-1, *x.shape[2:]).transpose(0, 1).contiguous()

    def unflat(x: torch.Tensor, c: dict) -> torch.Tensor:  # (H, B T, D) -> (B, T, H, D)
        return x.transpose(0, 1).reshape(*c["q"].shape[:3], -1)

    def layout(c: dict) -> dict:
        if "seed" not in c:
            lengths = [n for row in c["lengths"] for n in row]
            cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=c["q"].device)
            c["seed"] = dict(q=flat(c["q"]), k=flat(c["k"]), v=flat(c["v"]), grad_out=flat(c["grad_out"]), cu=cu,
                             pos=seed.build_pos_ids_from_cu_seqlens(cu))  # fmt: skip
        return c["seed"]

    def call(s: dict, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, r: torch.Tensor):
        return seed.varlen_multiscreen(q, k, v, s["pos"], s["pos"], s["cu"], s["cu"], w, r)

    def fwd(c: dict) -> torch.Tensor:
        s = layout(c)
        return unflat(call(s, s["q"], s["k"], s["v"], c["window"], c["rho"]), c)

    def bwd(c: dict) -> tuple:
        s = layout(c)
        dq, dk, dv, dw, dr = seed.triton_varlen_multiscreen_backward(
            s["q"], s["k"], s["v"], s["pos"], s["pos"], s["cu"], s["cu"], c["window"], c["rho"], s["grad_out"]
        )
        return unflat(dq, c), unflat(dk, c), unflat(dv, c), dw, dr

    def train(c: dict) -> tuple[Callable[[], object], list[torch.Tensor]]:
        s = layout(c)
        leaves = [x.detach().clone().requires_grad_() for x in (s["q"], s["k"], s["v"], c["window"], c["rho"])]
        return lambda: call(s, *leaves).backward(s["grad_out"]), leaves

    return Impl(fwd, bwd, train)


# ----------------------------------------------------------------------------------------------------------------------
# Timings


def time_packing(packing: str, c: dict, impls: dict, args: argparse.Namespace) -> tuple[list, dict]:
    """Rows of (packing, what, fwd ms, fwd+bwd ms, fwd+bwd device ms) for every implementation on case c, and the
    kernel times of each fwd+bwd. fwd+bwd runs as training calls it (ours: the op
    and autograd). The wall figures (do_bench) include host time wherever the host is slower than the kernels; the
    device figure is the sum of the kernels' own times (torch.profiler)."""
    cost = screening_cost(*c["q"].shape, c["v"].shape[-1], c["window"], c["meta"], torch.bfloat16)
    documents = sum(len(row) for row in c["lengths"])
    print(f"\n{packing}: {len(c['lengths'])} rows x {args.row_len} tokens, {documents} documents, "
          f"{cost['pairs']:.4g} in-window pairs")  # fmt: skip
    rows, profiles = [], {}
    for label, impl in impls.items():
        train, leaves = impl.train(c)
        profiles[label] = kernel_times(train, leaves)
        device_ms = sum(ms for ms, _ in profiles[label].values()) if torch.cuda.is_available() else math.nan
        fwd_ms, both_ms = median_ms(partial(impl.fwd, c)), median_ms(train, grad_to_none=leaves or None)
        rows.append((packing, label, fwd_ms, both_ms, device_ms))
    rows.append((packing, "ours metadata", median_ms(lambda: screening_metadata(c["doc_pos"])), math.nan, math.nan))
    ms_per_byte = 1e3 / (args.hbm_tbps * 1e12)
    both = (cost["fwd_bytes"] + cost["bwd_bytes"]) * ms_per_byte
    rows.append((packing, "HBM floor", cost["fwd_bytes"] * ms_per_byte, both, both))
    return rows, profiles


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=positive_int, default=65536)
    p.add_argument("--row-len", type=positive_int, default=4096, help="T: tokens per row (and the longest document)")
    p.add_argument("--heads", type=positive_int, default=16)
    p.add_argument("--dk", type=positive_int, default=16)
    p.add_argument("--dv", type=positive_int, default=64)
    p.add_argument("--rho", type=positive_float, default=2.0, help="acceptance multiplier 1/r (model init r = 0.5)")
    p.add_argument("--seed", type=nonneg_int, default=0)
    p.add_argument("--device", default="cuda", help="cuda; cpu only under TRITON_INTERPRET=1 (a smoke test)")
    p.add_argument("--hbm-tbps", type=positive_float, default=4.8, help="HBM bandwidth for the floor (H200: 4.8)")
    p.add_argument("--ref", type=Path, default=Path(__file__).resolve().parents[1] / ".ref", help="the seed's folder")
    p.add_argument("--baseline", type=python_file, help="a screening_triton.py of another commit, timed alike")
    p.add_argument("--profile", action="store_true", help="device time of one fwd+bwd by kernel (torch.profiler)")
    args = p.parse_args(argv)
    if args.device == "cuda":
        require_cuda("bench_screening")
    elif os.environ.get("TRITON_INTERPRET") != "1":
        raise PPTError(f"--device {args.device} runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
    if args.tokens % args.row_len:
        raise PPTError(f"--tokens {args.tokens} must be a multiple of --row-len {args.row_len}")
    seed = load_seed(args)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU, Triton interpreter"
    print(f"{device}; torch {torch.__version__}; triton {triton.__version__}")
    print(f"seed kernel: {'imported from ' + str(args.ref) if seed else f'ABSENT (no {args.ref}/multiscreen_gist.py)'}")
    print(f"shipped plans: {SHIPPED_PLANS}")

    impls = {"ours": ours()}
    if args.baseline:
        impls[f"baseline {args.baseline.stem}"] = kernel_file(load_module("baseline_screening_triton", args.baseline))
    if seed:
        impls["seed"] = seed_impl(seed)
    check = reference_case(args)
    impls = {label: impl for label, impl in impls.items() if passes(label, impl, check)}

    results, profiles = [], {}
    for packing, c in cases(args).items():
        rows, profiles[packing] = time_packing(packing, c, impls, args)
        results += rows
    if args.profile:
        for label, times in profiles["uniform"].items():
            print_kernel_times(label, times)

    print(f"\n{'packing':<9} {'what':<36} {'fwd ms':>8} {'fwd+bwd ms':>11} {'device ms':>10}")
    seed_times = {p: (f, b, d) for p, label, f, b, d in results if label == "seed"}
    for packing, label, fwd_ms, both_ms, device_ms in results:
        speedup = ""
        if packing in seed_times and label.startswith(("ours", "baseline")) and not label.endswith("metadata"):
            sf, sb, sd = seed_times[packing]
            speedup = f"   {sf / fwd_ms:5.2f}x / {sb / both_ms:5.2f}x / {sd / device_ms:5.2f}x the seed"
        print(f"{packing:<9} {label:<36} {fwd_ms:8.3f} {both_ms:11.3f} {device_ms:10.3f}{speedup}")
    print("fwd+bwd ms: wall time of a call (do_bench), host included where it is slower than the kernels; device ms: "
          "the kernels' own time per fwd+bwd (torch.profiler)")  # fmt: skip


if __name__ == "__main__":
    run_cli(main)
