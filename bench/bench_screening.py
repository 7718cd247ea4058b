"""Benchmark the screening kernels on a CUDA GPU, side by side with the seed's kernel, in one command.

    python -m bench.bench_screening                      # ours and the seed's: fwd, fwd+bwd, two packings
    python -m bench.bench_screening --sweep --profile --optimizer --baseline .ref/screening_triton_c4ba8bb.py

Shapes default to the seed's benchmark: 65,536 tokens (16 rows of 4096 here), 16 heads, dK 16, dV 64, windows
exp(linspace(0, ln 256, H)) + 1 (the model's initial windows), rho 2 (r = 0.5), bf16 unit-norm q/k/v. Two packings:
`uniform` (one 4096-token document per row) and `mixed` (log-normal document lengths, median ~450, capped at the row
length).

In order:
  check      every implementation timed below against a float64 reference on the GPU (2 rows of 2048 tokens, mixed
             documents): max |error| / max |reference| of h and of the five gradients; one over 2e-2 is not timed
  --sweep    each kernel's tile sizes per window class (spans up to 16, 32, 64 and above, or one class), each class
             timed on its own launch, then the fastest plan per kernel, then register caps on its classes; it is
             checked, and timed as "ours (swept)"
  times      medians of triton.testing.do_bench (L2 flushed between runs): the op as the model calls it (fwd; fwd and
             autograd backward), each kernel launch alone, the per-batch metadata, the seed's op, and --baseline;
             and the device time of one fwd+bwd (its kernels' own time by torch.profiler: the host's speed left out)
  --profile  the device time of that fwd+bwd by kernel, for every implementation (uniform packing)
  work       per kernel: FLOPs of the in-window pairs and of the pairs its tiles compute, the HBM bytes it cannot avoid
             and the bytes its tiles read from L2, for the plans timed
  --optimizer  one Aurora step over multiscreen-d16's parameters (random gradients): device and host time per step,
             elementwise and fused Newton-Schulz (and --baseline-optim, an optim.py from another commit)
  --launch-once  instead of all the above, each kernel of ours and of --baseline launched once on the uniform case,
             the program to profile:  ncu --clock-control none --kernel-name regex:'_(forward|dq|dkdv)_kernel'
             --set full python -m bench.bench_screening --launch-once --baseline FILE
  --blocks KIND=M,N,WARPS,STAGES[,MAXNREG] ...  instead of all the above, each given kernel's launch over all heads
             (one class) with those blocks, timed on both packings: a sweep of your own, e.g.
             --blocks forward=32,16,1,4,168 forward=16,16,1,3,128 dq=32,16,1,2,168 dkdv=16,32,1,3
The seed's kernel is imported from --ref/multiscreen_gist.py (its wandb import stubbed, nothing trained); copy the
seed's folder there. --baseline takes a ppt/kernels/screening_triton.py of another commit (`git show
REV:ppt/kernels/screening_triton.py > .ref/screening_triton_REV.py`), timed on the same inputs.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.testing

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.kernel_stats import parse_blocks  # noqa: E402
from ppt.common import ArgumentParser, PPTError, nonneg_int, positive_float, positive_int, run_cli  # noqa: E402
from ppt.kernels import screening_triton as kernels  # noqa: E402
from ppt.kernels.screening import screening, screening_cost, screening_metadata, screening_reference  # noqa: E402

TOLERANCE = 2e-2  # bf16 operands: relative error of h and the gradients against float64

# Candidate (BLOCK_M queries, BLOCK_N keys, num_warps, num_stages[, maxnreg]) per kernel and window class for
# --sweep. Small tiles compute fewer masked-out pairs and hold fewer registers (the kernels are latency-bound at 8-18
# warps per SM, by an sm_90 compile's register counts); one warp over 32 queries with 168 registers is the shipped
# forward and dQ; 64-row tiles with 4 warps get wgmma. Configs that spill are left out.
SHORT = {
    "forward": [(16, 16, 1, 2), (16, 16, 1, 3), (32, 16, 1, 3, 168), (32, 16, 1, 4, 168), (32, 16, 2, 3),
                (16, 32, 1, 2), (32, 32, 2, 2)],
    "dq": [(16, 16, 1, 2), (16, 16, 1, 3), (32, 16, 1, 2, 168), (32, 16, 1, 3, 168), (32, 16, 2, 3), (16, 32, 1, 2),
           (64, 16, 4, 2)],
    "dkdv": [(16, 16, 1, 1), (16, 16, 1, 3), (16, 32, 1, 1), (16, 32, 1, 3), (16, 32, 2, 2), (32, 32, 2, 3)],
}  # fmt: skip
LONG = {
    "forward": [(16, 16, 1, 2), (32, 16, 1, 4, 168), (32, 16, 2, 3), (64, 16, 4, 3), (32, 32, 2, 2), (64, 32, 4, 3),
                (64, 64, 4, 3), (128, 64, 8, 3)],
    "dq": [(16, 16, 1, 2), (32, 16, 1, 2, 168), (32, 16, 2, 2), (64, 16, 4, 2), (32, 32, 2, 2), (64, 32, 4, 2),
           (64, 64, 4, 2)],
    "dkdv": [(16, 16, 1, 2), (16, 32, 1, 1), (16, 32, 1, 3), (16, 32, 1, 4), (16, 64, 2, 3), (32, 64, 4, 3)],
}  # fmt: skip
BOUNDARIES = (16, 32, 64)  # largest span of the short class, besides one class for all
ALL_SPANS = (-(2**31), 2**31 - 1)  # every int32 span: one class
MAXNREG = (80, 96, 128, 168)  # register caps tried on the fastest plan's blocks (replacing a fifth number)
PLAN_NAMES = {"forward": "FORWARD_PLAN", "dq": "DQ_PLAN", "dkdv": "DKDV_PLAN"}


def kernel_blocks(text: str) -> tuple[str, tuple[int, ...]]:
    """'dq=32,16,1,2,168' -> ('dq', (32, 16, 1, 2, 168)); the numbers as kernel_stats --blocks reads them."""
    kind, _, numbers = text.partition("=")
    try:
        blocks = parse_blocks(numbers)
    except argparse.ArgumentTypeError:
        blocks = None
    if kind not in PLAN_NAMES or blocks is None:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give KIND=BLOCK_M,BLOCK_N,WARPS,STAGES[,MAXNREG] with KIND one of {', '.join(PLAN_NAMES)}, "
            "e.g. forward=32,16,1,4,168"
        )
    return kind, blocks


def parse_args(argv: list[str] | None) -> argparse.Namespace:
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
    p.add_argument("--ref", "--seed-ref", dest="ref", type=Path, default=ROOT / ".ref", help="the seed's folder")
    p.add_argument("--baseline", type=Path, help="a screening_triton.py of another commit, timed on the same inputs")
    p.add_argument("--baseline-optim", type=Path, help="an optim.py of another commit, for --optimizer")
    p.add_argument("--sweep", action="store_true", help="time tile sizes per window class, report the fastest plans")
    p.add_argument("--profile", action="store_true", help="device time of one fwd+bwd by kernel (torch.profiler)")
    p.add_argument(
        "--launch-once",
        action="store_true",
        help="launch each kernel of ours and --baseline once and stop, nothing timed: for Nsight Compute",
    )
    p.add_argument("--optimizer", action="store_true", help="time an Aurora step on multiscreen-d16's parameters")
    p.add_argument(
        "--blocks",
        type=kernel_blocks,
        nargs="+",
        help="KIND=BLOCK_M,BLOCK_N,WARPS,STAGES[,MAXNREG] (KIND: forward, dq, dkdv): time these launches and stop",
    )
    p.add_argument("--seed", type=nonneg_int, default=0)
    p.add_argument(
        "--device", default="cuda", help="cuda; cpu only under TRITON_INTERPRET=1 (a smoke test of this script)"
    )
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise PPTError("bench_screening needs a CUDA GPU (torch.cuda.is_available() is False)")
    if args.device != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise PPTError(f"--device {args.device} runs the kernels only in Triton's interpreter: set TRITON_INTERPRET=1")
    if args.tokens % args.row_len:
        raise PPTError(f"--tokens {args.tokens} must be a multiple of --row-len {args.row_len}")
    for flag in ("baseline", "baseline_optim"):
        path = getattr(args, flag)
        if path is not None and not path.is_file():
            raise PPTError(f"--{flag.replace('_', '-')} {path} is not a file; write it with git show REV:PATH > FILE")
    return args


# ----------------------------------------------------------------------------------------------------------------------
# Inputs


def model_init_windows(heads: int) -> torch.Tensor:
    return torch.exp(torch.linspace(0, math.log(256.0), heads)) + 1


def document_lengths(kind: str, rows: int, row_len: int, seed: int) -> list[list[int]]:
    """Per row, the lengths of its documents (a document never crosses a row)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rows):
        if kind == "uniform":
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
    unit = lambda *shape: torch.nn.functional.normalize(torch.randn(*shape, generator=g), dim=-1).to(device, dtype)
    doc_pos = torch.stack([torch.cat([torch.arange(n, dtype=torch.int32) for n in row]) for row in lengths])
    doc_pos = doc_pos.to(device)
    return dict(
        q=unit(B, T, H, args.dk), k=unit(B, T, H, args.dk), v=unit(B, T, H, args.dv),
        grad_out=torch.randn(B, T, H, args.dv, generator=g).to(device, dtype),
        window=model_init_windows(H).to(device), rho=torch.full((H,), args.rho, device=device),
        doc_pos=doc_pos, meta=screening_metadata(doc_pos), lengths=lengths,
    )  # fmt: skip


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bench(fn: Callable[[], object], grad_to_none: list[torch.Tensor] | None = None, rep: int = 200) -> float:
    """Median ms of fn: triton's do_bench on CUDA; a single timed call elsewhere (the interpreter's smoke test)."""
    for _ in range(3 if torch.cuda.is_available() else 1):  # compile and warm caches outside the timed region
        fn()
    synchronize()
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return triton.testing.do_bench(fn, warmup=25, rep=rep, grad_to_none=grad_to_none, return_mode="median")


# ----------------------------------------------------------------------------------------------------------------------
# Implementations


@dataclass
class Impl:
    """fwd(c) -> h; bwd(c) -> (dq, dk, dv, d window, d rho); train(c) -> (fwd+bwd as training calls it, the leaves
    whose gradients it fills)."""

    fwd: Callable[[dict], torch.Tensor]
    bwd: Callable[[dict], tuple]
    train: Callable[[dict], tuple[Callable[[], object], list[torch.Tensor]]]


def ours(plans: dict | None = None) -> Impl:
    """The kernels called directly with the given plans (default: the shipped ones); train goes through the op and
    autograd, as the model calls it, with the module's plans set to these."""
    plans = plans or {name: getattr(kernels, constant) for name, constant in PLAN_NAMES.items()}

    def fwd(c: dict) -> torch.Tensor:
        return kernels.screening_forward(c["q"], c["k"], c["v"], c["window"], c["rho"], c["meta"][0], plans["forward"])

    def bwd(c: dict) -> tuple:
        return kernels.screening_backward(
            c["q"], c["k"], c["v"], c["window"], c["rho"], *c["meta"], c["grad_out"], plans["dq"], plans["dkdv"]
        )

    def train(c: dict) -> tuple[Callable[[], object], list[torch.Tensor]]:
        leaves = [c[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "window", "rho")]
        step = lambda: screening(*leaves, c["meta"]).backward(c["grad_out"])
        return lambda: with_plans(plans, step), leaves

    return Impl(fwd, bwd, train)


def baseline(module: types.ModuleType) -> Impl:
    """A kernel file of another commit: screening_forward / screening_backward with its own defaults."""
    fwd = lambda c: module.screening_forward(c["q"], c["k"], c["v"], c["window"], c["rho"], c["meta"][0])
    bwd = lambda c: module.screening_backward(c["q"], c["k"], c["v"], c["window"], c["rho"], *c["meta"], c["grad_out"])
    return Impl(fwd, bwd, lambda c: ((lambda: (fwd(c), bwd(c))), []))


def seed_impl(seed: types.ModuleType) -> Impl:
    """The seed's op in its layout, (H, total tokens, D) and cumulative document lengths; its r enters as our rho
    (both compute max(1 - r (1 - s), 0)^2 from the multiplier they are given). It builds its metadata in every call."""

    def layout(c: dict) -> dict:
        if "seed" not in c:
            flat = lambda x: x.reshape(-1, *x.shape[2:]).transpose(0, 1).contiguous()
            lengths = [n for row in c["lengths"] for n in row]
            cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=c["q"].device)
            c["seed"] = dict(q=flat(c["q"]), k=flat(c["k"]), v=flat(c["v"]), grad_out=flat(c["grad_out"]), cu=cu,
                             pos=seed.build_pos_ids_from_cu_seqlens(cu))  # fmt: skip
        return c["seed"]

    def unflat(x: torch.Tensor, c: dict) -> torch.Tensor:
        B, T, H, _ = c["q"].shape
        return x.transpose(0, 1).reshape(B, T, H, -1)

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


def load_seed(folder: Path, args: argparse.Namespace) -> types.ModuleType | None:
    """The seed's module, imported without running its training (its wandb import is stubbed), or None."""
    path = folder / "multiscreen_gist.py"
    if not path.is_file():
        return None
    os.environ.update(COMPILE_MODEL="0", KEY_DIM=str(args.dk), VALUE_DIM=str(args.dv))  # read at its import
    sys.modules.setdefault("wandb", types.ModuleType("wandb"))
    return load_module("multiscreen_gist", path)


def load_module(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------------------------------------------------
# Correctness on the GPU


def reference_case(args: argparse.Namespace) -> tuple[dict, list[torch.Tensor]]:
    """A smaller case (2 rows of 2048 tokens, or of --row-len if shorter; mixed documents) and its float64 h and
    gradients."""
    T = min(2048, args.row_len)
    case = make_case(document_lengths("mixed", 2, T, args.seed + 1), T, args)
    leaves = [case[n].double().requires_grad_() for n in ("q", "k", "v", "window", "rho")]
    out = screening_reference(*leaves, case["meta"])
    grads = torch.autograd.grad(out, leaves, case["grad_out"].double())
    return case, [out.detach(), *grads]


def relative_errors(impl: Impl, case: dict, refs: list[torch.Tensor]) -> dict[str, float]:
    got = [impl.fwd(case), *impl.bwd(case)]
    errors = {}
    for name, x, ref in zip(("h", "dq", "dk", "dv", "dwindow", "drho"), got, refs):
        err = (x.double() - ref).abs().max() / ref.abs().max().clamp(min=1e-12)
        errors[name] = float(err) if torch.isfinite(x).all() else math.inf
    return errors


def passes(label: str, impl: Impl, check: tuple[dict, list]) -> bool:
    errors = relative_errors(impl, *check)
    worst = max(errors.values())
    verdict = "ok" if worst <= TOLERANCE else f"FAIL (> {TOLERANCE}), not timed"
    print(f"check {label:<22} " + " ".join(f"{k} {v:.1e}" for k, v in errors.items()) + f"  {verdict}", flush=True)
    return worst <= TOLERANCE


# ----------------------------------------------------------------------------------------------------------------------
# Work per kernel: pairs its tiles compute, FLOPs and bytes


def tile_work(kind: str, blocks: tuple, span_range: tuple[int, int], c: dict) -> dict[str, float]:
    """Tiles and pairs a kernel's launch computes for the heads of one class, from its loop bounds (as the kernel
    derives them), and the bytes those tiles read from L2."""
    block_m, block_n = blocks[:2]
    doc_start, doc_end = (m.long().cpu() for m in c["meta"])
    B, T = doc_start.shape
    dK, dV = c["q"].shape[-1], c["v"].shape[-1]
    per_tile = lambda x, size, fill: torch.nn.functional.pad(x, (0, (-T) % size), value=fill).view(B, -1, size)
    ceil_div = lambda a, b: (a + b - 1).div(b, rounding_mode="floor").clamp(min=0)
    spans = torch.ceil(torch.clamp(c["window"].cpu().double(), max=T)).long().tolist()
    tiles = 0
    for span in (x for x in spans if span_range[0] <= x <= span_range[1]):
        if kind in ("forward", "dq"):  # per query tile, key tiles from the window's or document's start
            starts = torch.arange(0, T, block_m)
            first = torch.maximum(per_tile(doc_start, block_m, T).min(dim=2).values, starts - span + 1)
            first = first.div(block_n, rounding_mode="floor") * block_n
            tiles += int(ceil_div(torch.clamp(starts + block_m, max=T) - first, block_n).sum())
        else:  # per key tile, query tiles up to the window's or document's end
            starts = torch.arange(0, T, block_n)
            last = torch.minimum(torch.clamp(starts + block_n - 1 + span, max=T),
                                 per_tile(doc_end, block_n, 0).max(dim=2).values + 1)  # fmt: skip
            tiles += int(ceil_div(last - starts.div(block_m, rounding_mode="floor") * block_m, block_m).sum())
    rows_loaded = block_n if kind in ("forward", "dq") else block_m
    bytes_per_row = 2 * (dK + dV) + (4 if kind == "dkdv" else 0)  # k and v (or q, dout and doc_start)
    return {"tiles": tiles, "pairs": tiles * block_m * block_n, "l2_bytes": tiles * rows_loaded * bytes_per_row}


def plan_work(kind: str, plan: tuple, c: dict) -> dict[str, float]:
    total = {"tiles": 0, "pairs": 0, "l2_bytes": 0}
    for lo, hi, blocks in kernels.plan_classes(plan):
        for key, value in tile_work(kind, blocks, (lo, hi), c).items():
            total[key] += value
    return total


def minimal_bytes(kind: str, c: dict) -> int:
    """Bytes each kernel must move through HBM: every tensor it reads or writes, once (bf16), plus metadata."""
    B, T, H, dK = c["q"].shape
    dV = c["v"].shape[-1]
    elements = {"forward": 2 * dK + 2 * dV, "dq": 2 * dK + 2 * dV + dK, "dkdv": 2 * dK + 2 * dV + dK + dV}[kind]
    return 2 * B * T * H * elements + 4 * B * T * (1 if kind != "dkdv" else 2)


FLOPS_PER_PAIR = {"forward": lambda dK, dV: 2 * (dK + dV), "dq": lambda dK, dV: 2 * (2 * dK + dV),
                  "dkdv": lambda dK, dV: 4 * (dK + dV)}  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------------
# Timings


def class_launch(kind: str, c: dict, span_range: tuple[int, int], blocks: tuple) -> Callable[[], object]:
    """One class's launch of a kernel on case c, writing into buffers of its own. The dK/dV launch sums rows of dQ
    partials as long as the shipped DQ_PLAN's."""
    q, k, v, w, r, g = (c[n] for n in ("q", "k", "v", "window", "rho", "grad_out"))
    doc_start, doc_end = c["meta"]
    if kind == "forward":
        out = torch.empty_like(v)
        return lambda: kernels.forward_class(q, k, v, out, w, r, doc_start, *span_range, blocks)
    partials = kernels.dq_partials(q, ((None, blocks),) if kind == "dq" else None)
    if kind == "dq":
        dq = torch.empty_like(q)
        return lambda: kernels.dq_class(q, k, v, g, dq, partials, w, r, doc_start, *span_range, blocks)
    dk, dv, dw, dr = torch.empty_like(k), torch.empty_like(v), torch.empty_like(w), torch.empty_like(r)
    return lambda: kernels.dkdv_class(q, k, v, g, dk, dv, partials, dw, dr, w, r, doc_start, doc_end, *span_range,
                                      blocks)  # fmt: skip


def time_kernels(plans: dict, c: dict) -> dict[str, float]:
    """ms of each kernel's launches alone for a plan: forward, dq, dkdv (with the sums of dq's partials)."""
    times = {}
    for kind in PLAN_NAMES:
        launches = [class_launch(kind, c, (lo, hi), blocks) for lo, hi, blocks in kernels.plan_classes(plans[kind])]
        times[kind] = bench(lambda launches=launches: [launch() for launch in launches], rep=100)
    return times


def time_class(kind: str, span_range: tuple[int, int], blocks: tuple, c: dict) -> float:
    return bench(class_launch(kind, c, span_range, blocks), rep=40)


def fastest(kind: str, span_range: tuple[int, int], options: list[tuple], c: dict, measured: dict) -> tuple:
    """(ms, blocks) of the fastest option on one class's launch; timings are kept in `measured` for reuse."""
    for blocks in options:
        if (kind, span_range, blocks) not in measured:
            try:
                measured[(kind, span_range, blocks)] = time_class(kind, span_range, blocks, c)
            except Exception as exc:  # a config the compiler cannot fit (shared memory, registers)
                print(f"sweep {kind} {blocks}: {type(exc).__name__}", flush=True)
                measured[(kind, span_range, blocks)] = math.inf
    return min((measured[(kind, span_range, b)], b) for b in options)


def sweep(c: dict) -> dict:
    """Per kernel: each candidate's time on each window class alone, then the fastest split (one class, or a short
    class up to each boundary plus the rest) with the fastest blocks per class."""
    best, measured = {}, {}
    for kind, name in PLAN_NAMES.items():
        shipped = [blocks for _, blocks in getattr(kernels, name)]
        ms, blocks = fastest(kind, ALL_SPANS, list(dict.fromkeys(SHORT[kind] + LONG[kind] + shipped)), c, measured)
        options = [(ms, ((None, blocks),))]
        for boundary in BOUNDARIES:
            short = fastest(kind, (ALL_SPANS[0], boundary), SHORT[kind], c, measured)
            long = fastest(kind, (boundary + 1, ALL_SPANS[1]), LONG[kind], c, measured)
            options.append((short[0] + long[0], ((boundary, short[1]), (None, long[1]))))
        for ms, plan in sorted(options):
            print(f"sweep {kind:<8} {ms:7.4f} ms  {plan}", flush=True)
        best[kind] = capped(kind, min(options)[1], c, measured)
    return best


def capped(kind: str, plan: tuple, c: dict, measured: dict) -> tuple:
    """The plan with each class's registers capped (a fifth number, maxnreg) where that is faster: fewer registers
    mean more resident warps to hide latency, at the price of some spills."""
    classes = []
    for (lo, hi, blocks), (limit, _) in zip(kernels.plan_classes(plan), plan):
        ms, fastest_blocks = fastest(kind, (lo, hi), [blocks] + [(*blocks[:4], cap) for cap in MAXNREG], c, measured)
        if fastest_blocks != blocks:
            print(f"sweep {kind:<8} class up to {limit}: {fastest_blocks} {ms:.4f} ms", flush=True)
        classes.append((limit, fastest_blocks))
    return tuple(classes)


def time_op(label: str, impl: Impl, c: dict, packing: str) -> tuple:
    """(packing, label, fwd ms, fwd+bwd ms, fwd+bwd device ms); fwd+bwd as training calls it (ours: the op and
    autograd). The wall figures (do_bench) include host time wherever the host is slower than the kernels; the
    device figure is the sum of the kernels' own times (torch.profiler)."""
    train, leaves = impl.train(c)
    times = c.setdefault("kernel_times", {})[label] = kernel_times(train, leaves)  # --profile prints them
    device_ms = sum(ms for ms, _ in times.values()) if torch.cuda.is_available() else math.nan
    return packing, label, bench(lambda: impl.fwd(c)), bench(train, grad_to_none=leaves or None), device_ms


def with_plans(plans: dict, fn: Callable[[], object]) -> object:
    """Run fn with the module's plans set to `plans` (the op reads them at each call)."""
    saved = {name: getattr(kernels, name) for name in PLAN_NAMES.values()}
    try:
        for kind, plan in plans.items():
            setattr(kernels, PLAN_NAMES[kind], plan)
        return fn()
    finally:
        for name, plan in saved.items():
            setattr(kernels, name, plan)


def kernel_times(fn: Callable[[], object], leaves: list[torch.Tensor], iterations: int = 10) -> dict:
    """{kernel: (ms, launches) per call} over `iterations` calls of fn, the leaves' gradients cleared before each
    call as training does (so no accumulation kernels are counted); CPU time by op without CUDA."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cuda = torch.cuda.is_available()

    def call() -> None:
        for leaf in leaves:
            leaf.grad = None
        fn()

    call()
    synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(iterations):
            call()
        synchronize()
    own_time = lambda e: e.self_device_time_total if cuda else e.self_cpu_time_total  # kernels, not the ops above
    return {e.key: (own_time(e) / iterations / 1e3, e.count // iterations) for e in prof.key_averages() if own_time(e)}


def print_kernel_times(label: str, times: dict) -> None:
    """Prints the device time per fwd+bwd by kernel, from kernel_times."""
    total = sum(ms for ms, _ in times.values())
    print(f"\nprofile {label}: {total:.3f} ms of kernels per fwd+bwd")
    for name, (ms, count) in sorted(times.items(), key=lambda item: -item[1][0])[:12]:
        print(f"  {ms:8.4f} ms {100 * ms / total:5.1f}%  x{count:<3} {name[:90]}")


# ----------------------------------------------------------------------------------------------------------------------
# The optimizer step


def time_optimizer(args: argparse.Namespace) -> list[tuple[str, float, float]]:
    """(variant, device ms, host ms) of one Aurora step over multiscreen-d16's parameters, random gradients."""
    from ppt import optim
    from ppt.model import build_model, get_config

    torch.manual_seed(0)
    model = build_model(get_config("multiscreen-d16" if args.device == "cuda" else "multiscreen-tiny")).to(args.device)
    model.init_weights()
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    shipped = optim.FUSED_NEWTON_SCHULZ
    variants = [(f"ours, {'fused' if fused else 'elementwise'} Newton-Schulz{' (shipped)' if fused == shipped else ''}",
                 optim, fused) for fused in (False, True)]  # fmt: skip
    if args.baseline_optim:
        variants.append(
            (f"baseline {args.baseline_optim.name}", load_module("baseline_optim", args.baseline_optim), False)
        )
    rows = []
    for label, module, fused in variants:
        optim.FUSED_NEWTON_SCHULZ = fused
        optimizer = module.build_optimizer(model, "aurora", weight_decay=0.1)
        for _ in range(3):
            optimizer.step()
        synchronize()
        t0 = time.perf_counter()
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        for _ in range(10):
            optimizer.step()
        host = (time.perf_counter() - t0) / 10 * 1e3
        if torch.cuda.is_available():
            end.record()
            synchronize()
        device = start.elapsed_time(end) / 10 if torch.cuda.is_available() else math.nan
        rows.append((label, device, host))
    optim.FUSED_NEWTON_SCHULZ = shipped
    return rows


# ----------------------------------------------------------------------------------------------------------------------


def time_packing(packing: str, c: dict, impls: dict, plans: dict, args: argparse.Namespace) -> list[tuple]:
    """(packing, what, fwd ms, fwd+bwd ms) of every implementation and plan on case c; prints the work per kernel."""
    cost = screening_cost(*c["q"].shape, c["v"].shape[-1], c["window"], c["meta"], torch.bfloat16)
    documents = sum(len(row) for row in c["lengths"])
    print(f"\n{packing}: {len(c['lengths'])} rows x {args.row_len} tokens, {documents} documents, "
          f"{cost['pairs']:.4g} in-window pairs")  # fmt: skip
    results = [time_op(label, impl, c, packing) for label, impl in impls.items()]
    results.append((packing, "ours metadata", bench(lambda: screening_metadata(c["doc_pos"])), math.nan, math.nan))
    seconds = lambda n_bytes: n_bytes / (args.hbm_tbps * 1e12) * 1e3
    both = seconds(cost["fwd_bytes"] + cost["bwd_bytes"])
    results.append((packing, "HBM floor", seconds(cost["fwd_bytes"]), both, both))

    dK, dV = c["q"].shape[-1], c["v"].shape[-1]
    header = "kernel   ms       useful GFLOP  computed GFLOP  tiles   HBM MB  L2 MB   TFLOP/s  HBM GB/s"
    for name, plan in plans.items():
        print(f"{packing} {name}: {header}")
        for kind, ms in time_kernels(plan, c).items():
            work = plan_work(kind, plan[kind], c)
            useful = cost["pairs"] * FLOPS_PER_PAIR[kind](dK, dV)
            computed = work["pairs"] * FLOPS_PER_PAIR[kind](dK, dV)
            hbm = minimal_bytes(kind, c)
            print(f"  {kind:<8} {ms:7.4f}  {useful / 1e9:12.2f}  {computed / 1e9:14.2f}  {work['tiles']:6d}  "
                  f"{hbm / 1e6:7.1f}  {work['l2_bytes'] / 1e6:6.1f}  {useful / ms / 1e9:7.1f}  "
                  f"{hbm / ms / 1e6:8.0f}")  # fmt: skip
    return results


def launch_once(args: argparse.Namespace) -> None:
    """Each kernel of ours (and of --baseline) launched once on the uniform case, nothing checked or timed: the
    program for a profiler that replays kernels, such as Nsight Compute (see the module docstring)."""
    impls = [ours()] + ([baseline(load_module("baseline_screening_triton", args.baseline))] if args.baseline else [])
    rows = args.tokens // args.row_len
    c = make_case(document_lengths("uniform", rows, args.row_len, args.seed), args.row_len, args)
    for impl in impls:
        impl.fwd(c)
        impl.bwd(c)
    synchronize()


def time_blocks(args: argparse.Namespace) -> None:
    """The launch time of each --blocks entry (one class over all heads), on both packings."""
    rows = args.tokens // args.row_len
    for packing in ("uniform", "mixed"):
        c = make_case(document_lengths(packing, rows, args.row_len, args.seed), args.row_len, args)
        for kind, blocks in args.blocks:
            print(f"blocks {packing:<8} {kind:<8} {str(blocks):<22} {time_class(kind, ALL_SPANS, blocks, c):.4f} ms",
                  flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.launch_once:
        launch_once(args)
        return
    if args.blocks:
        time_blocks(args)
        return
    seed = load_seed(args.ref, args)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU, Triton interpreter"
    print(f"{device}; torch {torch.__version__}; triton {triton.__version__}")
    print(f"seed kernel: {'imported from ' + str(args.ref) if seed else f'ABSENT (no {args.ref}/multiscreen_gist.py)'}")
    shipped = {kind: getattr(kernels, name) for kind, name in PLAN_NAMES.items()}
    print(f"shipped plans: {shipped}")

    impls: dict[str, Impl] = {"ours": ours()}
    if args.baseline:
        impls[f"baseline {args.baseline.stem}"] = baseline(load_module("baseline_screening_triton", args.baseline))
    if seed:
        impls["seed"] = seed_impl(seed)
    check = reference_case(args)
    impls = {label: impl for label, impl in impls.items() if passes(label, impl, check)}

    rows = args.tokens // args.row_len
    cases = {kind: make_case(document_lengths(kind, rows, args.row_len, args.seed), args.row_len, args)
             for kind in ("uniform", "mixed")}  # fmt: skip
    plans = {"ours": shipped}
    if args.sweep:
        swept = sweep(cases["uniform"])
        print(f"swept plans: {swept}")
        if swept != shipped and passes("ours (swept)", ours(swept), check):
            plans["ours (swept)"] = swept
            impls = {"ours": impls["ours"], "ours (swept)": ours(swept), **impls}

    results = []
    for packing, c in cases.items():
        results += time_packing(packing, c, impls, plans, args)
    if args.profile:
        for label, times in cases["uniform"]["kernel_times"].items():
            print_kernel_times(label, times)
    optimizer_rows = time_optimizer(args) if args.optimizer else []

    print(f"\n{'packing':<9} {'what':<36} {'fwd ms':>8} {'fwd+bwd ms':>11} {'device ms':>10}")
    seed_times = {p: (f, b, d) for p, label, f, b, d in results if label == "seed"}
    for packing, label, fwd_ms, both_ms, device_ms in results:
        speedup = ""
        if packing in seed_times and label.startswith(("ours", "baseline")) and not label.endswith("metadata"):
            sf, sb, sd = seed_times[packing]
            speedup = f"   {sf / fwd_ms:5.2f}x / {sb / both_ms:5.2f}x / {sd / device_ms:5.2f}x the seed"
        print(f"{packing:<9} {label:<36} {fwd_ms:8.3f} {both_ms:11.3f} {device_ms:10.3f}{speedup}")
    print(
        "fwd+bwd ms: wall time of a call (do_bench), host included where it is slower than the kernels; device ms: "
        "the kernels' own time per fwd+bwd (torch.profiler)"
    )
    for label, device_ms, host_ms in optimizer_rows:
        print(f"optimizer {label:<36} {device_ms:8.2f} ms on the device, {host_ms:7.2f} ms on the host per step")
    if "ours (swept)" in plans:
        print("\nto ship the swept plans, set in ppt/kernels/screening_triton.py:")
        for kind, name in PLAN_NAMES.items():
            print(f"{name}: Plan = {plans['ours (swept)'][kind]}")


if __name__ == "__main__":
    run_cli(main)
