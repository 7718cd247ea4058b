"""One optimizer step over a config's parameters with random gradients, eager: device and host time per step, ours
and an optim.py of another commit on the same model.

    python -m bench.bench_optimizer                                          # Aurora over multiscreen-d16
    git show c4ba8bb:ppt/optim.py > .ref/optim_c4ba8bb.py
    python -m bench.bench_optimizer --baseline-optim .ref/optim_c4ba8bb.py

Device time: CUDA events around 10 steps after 3 warm-up steps (none without CUDA); host time: the wall time of
issuing them. Training compiles the orthogonalizations and replays them from CUDA graphs (base_train --compile).
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from bench.common import load_module, python_file, synchronize
from ppt import optim
from ppt.common import ArgumentParser, run_cli
from ppt.model import build_model, get_config


def time_steps(optimizer: torch.optim.Optimizer, steps: int = 10) -> tuple[float, float]:
    """(device ms, host ms) per step over `steps` steps after three warm-up steps; device ms is NaN without CUDA."""
    for _ in range(3):
        optimizer.step()
    synchronize()
    cuda = torch.cuda.is_available()
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    for _ in range(steps):
        optimizer.step()
    host_ms = (time.perf_counter() - t0) / steps * 1e3
    if not cuda:
        return math.nan, host_ms
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / steps, host_ms


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="multiscreen-d16", help="a config of ppt/model.py (default multiscreen-d16)")
    p.add_argument("--optimizer", choices=optim.OPTIMIZERS, default="aurora")
    p.add_argument("--baseline-optim", type=python_file, help="an optim.py of another commit, timed on the same model")
    args = p.parse_args(argv)

    torch.manual_seed(0)
    model = build_model(get_config(args.config)).to("cuda" if torch.cuda.is_available() else "cpu")
    model.init_weights()
    for param in model.parameters():
        param.grad = torch.randn_like(param) * 1e-3
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"{args.optimizer} over {args.config}'s parameters; {device}; torch {torch.__version__}")
    variants = {"ours": optim}
    if args.baseline_optim:
        variants[f"baseline {args.baseline_optim.name}"] = load_module("baseline_optim", args.baseline_optim)
    for label, module in variants.items():
        device_ms, host_ms = time_steps(module.build_optimizer(model, args.optimizer, weight_decay=0.1))
        print(f"optimizer {label:<36} {device_ms:8.2f} ms on the device, {host_ms:7.2f} ms on the host per step")


if __name__ == "__main__":
    run_cli(main)
