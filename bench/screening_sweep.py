"""Time the screening kernels' launches by tile sizes on a CUDA GPU: the candidates per window class, or your own.

    python -m bench.screening_sweep        # the fastest plan per kernel, checked, against the shipped plans
    python -m bench.screening_sweep --blocks forward=32,16,1,4,168 forward=16,16,1,3,128 dq=32,16,1,2,168 dkdv=16,32,1,3

Without --blocks: each kernel's candidate (BLOCK_M, BLOCK_N, num_warps, num_stages[, maxnreg]) per window class
(spans up to 16, 32, 64 and above, or one class for all), each class timed on its own launch (uniform packing), then
the fastest plan per kernel, then register caps on its classes. The swept plans are checked against float64, each
kernel's launches are timed under the shipped and the swept plans on both packings, and the lines that would ship
them are printed. With --blocks: each given kernel's launch over all heads (one class) with those blocks, on both
packings. Times are medians of triton.testing.do_bench. The inputs are bench_screening's (bench/screening.py).
"""

from __future__ import annotations

import argparse
import math

from bench import screening
from bench.common import median_ms
from ppt.common import run_cli
from ppt.kernels import screening_triton as kernels

# Candidate (BLOCK_M queries, BLOCK_N keys, num_warps, num_stages[, maxnreg]) per kernel and window class. Small tiles
# compute fewer masked-out pairs and hold fewer registers (the kernels are latency-bound at 8-18 warps per SM, by an
# sm_90 compile's register counts); one warp over 32 queries with 168 registers is the shipped forward and dQ;
# 64-row tiles with 4 warps get wgmma. Configs that spill are left out.
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


def kernel_blocks(text: str) -> tuple[str, tuple[int, ...]]:
    """'dq=32,16,1,2,168' -> ('dq', (32, 16, 1, 2, 168)); the numbers as kernel_stats --blocks reads them."""
    kind, _, numbers = text.partition("=")
    try:
        blocks = screening.parse_blocks(numbers)
    except argparse.ArgumentTypeError:
        blocks = None
    if kind not in screening.PLAN_NAMES or blocks is None:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give KIND=BLOCK_M,BLOCK_N,WARPS,STAGES[,MAXNREG] with KIND one of "
            f"{', '.join(screening.PLAN_NAMES)}, e.g. forward=32,16,1,4,168"
        )
    return kind, blocks


def time_class(kind: str, span_range: tuple[int, int], blocks: tuple, c: dict) -> float:
    return median_ms(screening.class_launch(kind, c, span_range, blocks), rep=40)


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


def sweep(c: dict) -> dict:
    """Per kernel: each candidate's time on each window class alone, then the fastest split (one class, or a short
    class up to each boundary plus the rest) with the fastest blocks per class, its registers capped."""
    best, measured = {}, {}
    for kind, plan in screening.SHIPPED_PLANS.items():
        shipped = [blocks for _, blocks in plan]
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


def main(argv: list[str] | None = None) -> None:
    p = screening.parser(__doc__)
    p.add_argument("--blocks", type=kernel_blocks, nargs="+", help="time KIND=BLOCK_M,BLOCK_N,WARPS,STAGES[,MAXNREG]")
    args = screening.checked(p.parse_args(argv), "screening_sweep")
    if args.blocks:
        for packing, c in screening.cases(args).items():
            for kind, blocks in args.blocks:
                ms = time_class(kind, ALL_SPANS, blocks, c)
                print(f"blocks {packing:<8} {kind:<8} {str(blocks):<22} {ms:.4f} ms", flush=True)
        return

    all_cases, shipped = screening.cases(args), screening.SHIPPED_PLANS
    swept = sweep(all_cases["uniform"])
    print(f"swept plans: {swept}\nshipped plans: {shipped}")
    if swept == shipped or not screening.passes("ours (swept)", screening.ours(swept), screening.reference_case(args)):
        return
    print(f"\n{'packing':<9} {'kernel':<8} {'shipped ms':>10} {'swept ms':>9}")
    for packing, c in all_cases.items():
        before, after = screening.time_kernels(shipped, c), screening.time_kernels(swept, c)
        for kind in screening.PLAN_NAMES:
            print(f"{packing:<9} {kind:<8} {before[kind]:10.4f} {after[kind]:9.4f}")
    print("\nto ship the swept plans, set in ppt/kernels/screening_triton.py:")
    for kind, name in screening.PLAN_NAMES.items():
        print(f"{name}: Plan = {swept[kind]}")


if __name__ == "__main__":
    run_cli(main)
