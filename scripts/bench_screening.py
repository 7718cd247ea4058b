"""Benchmark the screening op on a CUDA GPU, side by side with the seed's varlen kernel when it is available.

Shapes default to the seed's benchmark: 65,536 tokens (16 rows of 4096 here), 16 heads, dK 16, dV 64, windows
exp(linspace(0, ln 256, H)) + 1, rho 2 (r = 0.5), bf16 unit-norm q/k/v. Two packings: `uniform` (one 4096-token
document per row) and `mixed` (log-normal document lengths, median ~450, capped at the row length).

Times are medians of triton.testing.do_bench (warmup, L2 flushed between runs):
  fwd            the op as the model calls it (metadata prebuilt once per batch, as the model does)
  fwd+bwd        forward and autograd backward through the op
  metadata       screening_metadata(doc_pos) alone (ours; the seed rebuilds its metadata inside every call)
The floor is the HBM traffic the op cannot avoid (q, k, v in, h out; backward q, k, v, dh in, dq, dk, dv out) at
--hbm-tbps. The seed's kernel is imported from .ref/multiscreen_gist.py (copy /work/shared/reference there).

Usage: python scripts/bench_screening.py [--tokens 65536] [--row-len 4096] [--sweep]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import types
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.testing

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from ppt.common import ArgumentParser, nonneg_int, positive_float, positive_int  # noqa: E402
from ppt.kernels import screening_triton  # noqa: E402
from ppt.kernels.screening import screening, screening_cost, screening_metadata  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=positive_int, default=65536)
    p.add_argument(
        "--row-len", type=positive_int, default=4096, help="T: tokens per batch row (and the longest document)"
    )
    p.add_argument("--heads", type=positive_int, default=16)
    p.add_argument("--dk", type=positive_int, default=16)
    p.add_argument("--dv", type=positive_int, default=64)
    p.add_argument("--rho", type=positive_float, default=2.0, help="acceptance multiplier 1/r (model init r = 0.5)")
    p.add_argument(
        "--hbm-tbps", type=positive_float, default=4.8, help="HBM bandwidth for the floor estimate (H200: 4.8)"
    )
    p.add_argument("--seed-ref", default=str(ROOT / ".ref"), help="folder holding the seed's multiscreen_gist.py")
    p.add_argument("--sweep", action="store_true", help="first time each kernel over block configs, use the fastest")
    p.add_argument("--seed", type=nonneg_int, default=0)
    return p.parse_args()


def model_init_windows(heads: int) -> torch.Tensor:
    return torch.exp(torch.linspace(0, math.log(256.0), heads)) + 1


def document_lengths(kind: str, tokens: int, row_len: int, seed: int) -> list[list[int]]:
    """Per row, the lengths of its documents (a document never crosses a row)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(tokens // row_len):
        if kind == "uniform":
            rows.append([row_len])
            continue
        lengths, used = [], 0
        while used < row_len:
            n = int(torch.exp(torch.randn((), generator=g) * 1.1 + math.log(450.0)))
            n = min(max(16, n), row_len - used)
            lengths.append(n)
            used += n
        rows.append(lengths)
    return rows


def doc_pos_from_lengths(rows: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n, dtype=torch.int32) for n in lengths]) for lengths in rows])


def bench(fn: Callable[[], object], grad_to_none: list[torch.Tensor] | None = None, rep: int = 200) -> float:
    for _ in range(3):  # compile and warm caches outside the timed region
        fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=rep, grad_to_none=grad_to_none, return_mode="median")


def load_seed(folder: str, args: argparse.Namespace) -> types.ModuleType | None:
    """The seed's module, imported without running its training (its wandb import is stubbed), or None."""
    path = Path(folder) / "multiscreen_gist.py"
    if not path.is_file():
        return None
    os.environ.update(COMPILE_MODEL="0", KEY_DIM=str(args.dk), VALUE_DIM=str(args.dv))  # read at its import
    sys.modules.setdefault("wandb", types.ModuleType("wandb"))
    sys.path.insert(0, str(path.parent))
    import multiscreen_gist

    return multiscreen_gist


def run_packing(
    name: str, rows: list[list[int]], args: argparse.Namespace, seed_module: types.ModuleType | None
) -> list[tuple]:
    B, T, H, dK, dV = len(rows), args.row_len, args.heads, args.dk, args.dv
    g = torch.Generator().manual_seed(args.seed)
    unit = lambda *shape: torch.nn.functional.normalize(torch.randn(*shape, generator=g), dim=-1)
    q, k, v = (x.to("cuda", torch.bfloat16) for x in (unit(B, T, H, dK), unit(B, T, H, dK), unit(B, T, H, dV)))
    grad_out = torch.randn(B, T, H, dV, generator=g).to("cuda", torch.bfloat16)
    window = model_init_windows(H).cuda()
    rho = torch.full((H,), args.rho, device="cuda")
    doc_pos = doc_pos_from_lengths(rows).cuda()
    meta = screening_metadata(doc_pos)
    cost = screening_cost(B, T, H, dK, dV, window, meta, torch.bfloat16)
    results = []

    def add(what: str, ms: float, flops: int, floor_bytes: int) -> None:
        results.append((name, what, ms, flops / ms / 1e9, floor_bytes / (args.hbm_tbps * 1e12) * 1e3))

    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, window, rho)]

    def ours_fwd_bwd():
        screening(*leaves, meta).backward(grad_out)

    add("ours fwd", bench(lambda: screening(q, k, v, window, rho, meta)), cost["fwd_flops"], cost["fwd_bytes"])
    both_flops, both_bytes = cost["fwd_flops"] + cost["bwd_flops"], cost["fwd_bytes"] + cost["bwd_bytes"]
    add("ours fwd+bwd", bench(ours_fwd_bwd, grad_to_none=leaves), both_flops, both_bytes)
    add("ours metadata", bench(lambda: screening_metadata(doc_pos)), 0, 0)

    if seed_module is not None:  # the seed's layout: (H, total tokens, D) and cumulative document lengths
        flat = lambda x: x.reshape(B * T, H, -1).transpose(0, 1).contiguous()
        sq, sk, sv, sgrad = flat(q), flat(k), flat(v), flat(grad_out)
        lengths = [n for row in rows for n in row]
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        pos = seed_module.build_pos_ids_from_cu_seqlens(cu)
        seed_leaves = [x.detach().clone().requires_grad_() for x in (sq, sk, sv, window, rho)]
        sl = seed_leaves

        def seed_fwd_bwd():
            seed_module.varlen_multiscreen(sl[0], sl[1], sl[2], pos, pos, cu, cu, sl[3], sl[4]).backward(sgrad)

        fwd = lambda: seed_module.varlen_multiscreen(sq, sk, sv, pos, pos, cu, cu, window, rho)
        add("seed fwd", bench(fwd), cost["fwd_flops"], cost["fwd_bytes"])
        add("seed fwd+bwd", bench(seed_fwd_bwd, grad_to_none=seed_leaves), both_flops, both_bytes)
        with torch.no_grad():  # same math, different layout: a cross-check of the two implementations
            ours = screening(q, k, v, window, rho, meta).float()
            theirs = fwd().float().transpose(0, 1).reshape(B, T, H, dV)
            print(f"{name}: max |ours - seed| / max |seed| = {(ours - theirs).abs().max() / theirs.abs().max():.2e}")
    print(f"{name}: {B} rows x {T} tokens, {sum(len(r) for r in rows)} documents, {cost['pairs']:.4g} in-window pairs")
    return results


def sweep(args: argparse.Namespace) -> None:
    """Time block configs (BLOCK_M, BLOCK_N, warps, stages) per kernel at the uniform packing; adopt the fastest."""
    B, T, H = args.tokens // args.row_len, args.row_len, args.heads
    q = torch.nn.functional.normalize(torch.randn(B, T, H, args.dk, device="cuda"), dim=-1).bfloat16()
    v = torch.randn(B, T, H, args.dv, device="cuda").bfloat16()
    window, rho = model_init_windows(H).cuda(), torch.full((H,), args.rho, device="cuda")
    meta = screening_metadata(torch.arange(T, dtype=torch.int32, device="cuda").expand(B, T))
    configs = [(16, 16, 1, 1), (16, 16, 2, 1), (16, 32, 1, 1), (16, 32, 2, 1), (32, 16, 1, 1), (32, 16, 2, 1),
               (32, 16, 2, 2), (32, 16, 2, 3), (32, 32, 1, 1), (32, 32, 2, 1), (32, 32, 2, 2), (32, 32, 4, 2),
               (64, 16, 2, 1), (64, 16, 4, 1), (64, 32, 4, 2), (64, 64, 4, 2)]  # fmt: skip
    backward = lambda **blocks: screening_triton.screening_backward(q, q, v, window, rho, *meta, v, **blocks)
    kernels = {  # each backward timing includes the other backward kernel at its current config
        "FORWARD_BLOCKS": lambda c: screening_triton.screening_forward(q, q, v, window, rho, meta[0], blocks=c),
        "DQ_BLOCKS": lambda c: backward(dq_blocks=c),
        "DKDV_BLOCKS": lambda c: backward(dkdv_blocks=c),
    }
    for name, fn in kernels.items():
        timings = []
        for c in configs:
            try:
                timings.append((bench(lambda fn=fn, c=c: fn(c), rep=50), c))
            except Exception as exc:  # a config the compiler cannot fit (shared memory, registers)
                print(f"sweep {name} {c}: {type(exc).__name__}")
        for ms, c in sorted(timings)[:4]:
            print(f"sweep {name:<15} {c}: {ms:.4f} ms")
        setattr(screening_triton, name, min(timings)[1])
        print(f"using {name} = {min(timings)[1]}")


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_screening needs a CUDA GPU (torch.cuda.is_available() is False)")
    if args.tokens % args.row_len:
        sys.exit(f"--tokens {args.tokens} must be a multiple of --row-len {args.row_len}")
    seed_module = load_seed(args.seed_ref, args)
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; triton {triton.__version__}")
    print(f"seed kernel: {'imported from ' + args.seed_ref if seed_module else 'ABSENT (no ' + args.seed_ref + ')'}")
    if args.sweep:
        sweep(args)
    results = []
    for name in ("uniform", "mixed"):
        rows = document_lengths(name, args.tokens, args.row_len, args.seed)
        results += run_packing(name, rows, args, seed_module)
    print(f"\n{'packing':<9} {'what':<15} {'ms':>8} {'TFLOP/s':>8} {'HBM floor ms':>13}")
    for name, what, ms, tflops, floor in results:
        print(f"{name:<9} {what:<15} {ms:8.3f} {tflops:8.2f} {floor:13.3f}")
    print("TFLOP/s counts matmul work on in-window, in-document pairs only (screening_cost).")


if __name__ == "__main__":
    main()
