"""Launch each screening kernel of ours (and of --baseline) once on the uniform case, nothing checked or timed: the
program for a profiler that replays kernels, such as Nsight Compute.

    ncu --clock-control none --set full --import-source yes -k regex:"_screening_(dkdv|dq|forward)_kernel" \\
        -o screening python -m bench.screening_launch_once [--baseline FILE]

The inputs are bench_screening's (bench/screening.py); --baseline takes a ppt/kernels/screening_triton.py of
another commit (`git show REV:ppt/kernels/screening_triton.py > FILE`).
"""

from __future__ import annotations

from bench import screening
from bench.common import python_file, synchronize
from ppt.common import run_cli


def main(argv: list[str] | None = None) -> None:
    p = screening.parser(__doc__)
    p.add_argument("--baseline", type=python_file, help="a screening_triton.py of another commit, launched alike")
    args = screening.checked(p.parse_args(argv), "screening_launch_once")
    impls = [screening.ours()] + ([screening.baseline(args.baseline)] if args.baseline else [])
    c = screening.cases(args, ("uniform",))["uniform"]
    for impl in impls:
        impl.fwd(c)
        impl.bwd(c)
    synchronize()


if __name__ == "__main__":
    run_cli(main)
