"""Where one training step spends its GPU time: torch.profiler over forward, backward and the optimizer.

    python -m scripts.profile_step --config multiscreen-d16 --seq-len 4096 --batch-size 16 --optimizer aurora

Random tokens with documents of 1024 tokens; compile on. Prints the kernels that take the most device time, then
device time per kind of kernel (matmul, attention, fused elementwise, optimizer, ...) against the step's wall time.
"""

from __future__ import annotations

import argparse
import re
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from ppt.common import init_runtime, run_cli
from ppt.loss_eval import autocast
from ppt.model import build_model, get_config
from ppt.optim import build_optimizer


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="smollm-360m")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--optimizer", default="adamw")
    p.add_argument("--doc-len", type=int, default=1024)
    p.add_argument("--rows", type=int, default=30, help="kernels to print")
    args = p.parse_args(argv)

    rt = init_runtime()
    with torch.device("meta"):
        model = build_model(get_config(args.config))
    model.to_empty(device=rt.device)
    model.init_weights()
    optimizer = build_optimizer(model, args.optimizer)
    step_model = torch.compile(model) if rt.device.type == "cuda" else model
    V, B, T = model.config.vocab_size, args.batch_size, args.seq_len
    tokens = torch.randint(1, V, (B, T + 1), device=rt.device)
    doc_pos = (torch.arange(T, device=rt.device) % args.doc_len).int().expand(B, T).contiguous()

    def step() -> None:
        with autocast(rt.device, rt.dtype):
            loss = step_model(tokens[:, :-1], tokens[:, 1:], doc_pos)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(3):  # compile and warm up
        step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if rt.device.type == "cuda" else [])
    steps = 2
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        if rt.device.type == "cuda":
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps
    sort = "cuda_time_total" if rt.device.type == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=args.rows, max_name_column_width=70))
    if rt.device.type == "cuda":
        print_kernel_kinds(prof, steps, wall)


KERNEL_KINDS = [  # first match wins
    ("attention", r"flex|attn|attention|fmha|flash|screening"),
    ("matmul", r"gemm|cutlass|xmma|nvjet|cublas|wgmma|mm_"),
    ("optimizer", r"adam|foreach|multi_tensor|muon|aurora|newton"),
    ("communication", r"nccl"),
    ("fused elementwise (inductor)", r"^triton_"),
    ("copies and fills", r"memcpy|memset|copy|fill"),
]


def print_kernel_kinds(prof: profile, steps: int, wall: float) -> None:
    """Device time per step by kind of kernel, and the share of the step's wall time no kernel ran in."""
    per_kind: dict[str, float] = {}
    for event in prof.key_averages():
        if event.device_type != DeviceType.CUDA:
            continue
        us = getattr(event, "self_device_time_total", None) or event.self_cuda_time_total
        kind = next((k for k, pattern in KERNEL_KINDS if re.search(pattern, event.key, re.I)), "other")
        per_kind[kind] = per_kind.get(kind, 0.0) + us / 1e6 / steps
    busy = sum(per_kind.values())
    print(f"\nstep wall time {1000 * wall:.1f} ms; kernels {1000 * busy:.1f} ms ({100 * busy / wall:.1f}%)")
    for kind, seconds in sorted(per_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:32s} {1000 * seconds:8.1f} ms  {100 * seconds / wall:5.1f}%")


if __name__ == "__main__":
    run_cli(main)
