"""Where one training step spends its GPU time: torch.profiler over forward, backward and the optimizer.

    python -m scripts.profile_step --config multiscreen-d16 --seq-len 4096 --batch-size 16 --optimizer aurora

Random tokens with documents of 1024 tokens; compile on. Prints the kernels that take the most device time.
"""

from __future__ import annotations

import argparse

import torch
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
    with profile(activities=activities) as prof:
        for _ in range(2):
            step()
        if rt.device.type == "cuda":
            torch.cuda.synchronize()
    sort = "cuda_time_total" if rt.device.type == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=args.rows, max_name_column_width=70))


if __name__ == "__main__":
    run_cli(main)
