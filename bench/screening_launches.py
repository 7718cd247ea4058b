"""Each screening kernel launched once at bench_screening's shape (uniform packing): the program to profile.

    ncu --clock-control none --kernel-name regex:'_(forward|dq|dkdv)_kernel' --set full \
        python -m bench.screening_launches [--baseline .ref/screening_triton_REV.py ...]

Ours first, then each --baseline file (a ppt/kernels/screening_triton.py of another commit) on the same inputs.
"""

from __future__ import annotations

from pathlib import Path

import torch

from bench import bench_screening
from ppt.common import ArgumentParser, PPTError, run_cli


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__)
    p.add_argument("--baseline", type=Path, action="append", default=[], help="a kernel file of another commit")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise PPTError("screening_launches needs a CUDA GPU (torch.cuda.is_available() is False)")
    bench_args = bench_screening.parse_args(["--ref", "/nonexistent"])
    rows = bench_args.tokens // bench_args.row_len
    lengths = bench_screening.document_lengths("uniform", rows, bench_args.row_len, bench_args.seed)
    case = bench_screening.make_case(lengths, bench_args.row_len, bench_args)
    impls = [bench_screening.ours()]
    for i, path in enumerate(args.baseline):
        if not path.is_file():
            raise PPTError(f"--baseline {path} is not a file; write it with git show REV:PATH > FILE")
        impls.append(bench_screening.baseline(bench_screening.load_module(f"baseline_{i}", path)))
    for impl in impls:
        impl.fwd(case)
        impl.bwd(case)
    torch.cuda.synchronize()


if __name__ == "__main__":
    run_cli(main)
