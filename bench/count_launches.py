"""Kernel launches of one compiled training step, counted on this machine's CPU: the work the host does per step in
the default compile mode, where Python launches every kernel (at study shapes a GPU waits on it: docs/benchmarks.md,
"Launches per step in the default mode").

    python -m bench.count_launches --config d4,multiscreen-d11

Each config is compiled as base_train compiles it (torch.compile's default mode, bf16 autocast) and runs one forward
and backward with the loss on 2 rows of 128 tokens (the count does not depend on the batch). Counted in the code
Inductor generates: its fused kernels, the matmuls it hands to the BLAS, and the calls of ppt's custom ops. On CUDA
Inductor fuses somewhat differently, each custom op launches its own Triton kernels (the screening op one forward,
two backward) and the vanilla decoder's attention is two more kernels a layer: a proxy, not a GPU count.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import replace

import torch

from bench.bench_train import config_names
from ppt.common import ArgumentParser, run_cli
from ppt.model import build_model, get_config

KINDS = {
    "inductor_kernels": re.compile(r"^\s+cpp_fused_\w+\(", re.MULTILINE),
    "matmuls": re.compile(r"^\s+extern_kernels\.\w+\(", re.MULTILINE),
    "custom_ops": re.compile(r"torch\.ops\.ppt\.\w+\.default\("),
}
VOCAB_SIZE, SEQ_LEN = 512, 128


def count_launches(name: str) -> dict[str, int]:
    """{kind: calls} in the code Inductor generates for one compiled forward and backward of the config `name`."""
    from torch._inductor.utils import run_and_get_code  # importing Inductor makes its cache directory: not on --help

    torch.manual_seed(0)
    model = build_model(replace(get_config(name), vocab_size=VOCAB_SIZE, max_seq_len=SEQ_LEN))
    model.init_weights()
    compiled = torch.compile(model)
    idx = torch.randint(0, VOCAB_SIZE, (2, SEQ_LEN))

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = compiled(idx, targets=idx)
        loss.backward()

    torch._dynamo.reset()  # a config compiled earlier in this process would otherwise reuse its code
    _, codes = run_and_get_code(step)
    return {kind: len(pattern.findall("\n".join(codes))) for kind, pattern in KINDS.items()}


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=config_names, default=["d4", "multiscreen-d11"], help="comma list")
    args = p.parse_args(argv)
    print("| config | Inductor kernels | matmuls | custom ops |\n|---|---|---|---|")
    for name in args.config:
        counts = count_launches(name)
        print(f"| {name} | {counts['inductor_kernels']} | {counts['matmuls']} | {counts['custom_ops']} |", flush=True)


if __name__ == "__main__":
    run_cli(main)
