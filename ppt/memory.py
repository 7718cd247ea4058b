"""What a training run needs in memory, set against what the machine has, said before anything is allocated (a CUDA
OOM traceback far into set-up, or on a CPU the OOM killer's silent end, otherwise). The estimate is a floor: fp32
weights, gradients and AdamW's two moments (16 bytes a parameter), plus, for an eager step, what autograd saves over
one micro-batch's forward, from a trace on meta (`ppt.flops.traced_step`); a compiled step saves less (fused kernels
recompute), so there only the weights and their state count. A run above it is refused."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from ppt.common import PPTError, Runtime, format_sizes
from ppt.flops import OpFormulas, traced_step
from ppt.formatting import si

BYTES_PER_PARAMETER = 16  # fp32 weight, gradient and AdamW's two moments
# (limit, usage) of a container under /sys/fs/cgroup: cgroup v2, then v1
CGROUP_FILES = (("memory.max", "memory.current"), ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"))


def activation_bytes(model: nn.Module, rows: int, seq_len: int, dtype: torch.dtype, formulas: OpFormulas) -> int:
    """Bytes of the tensors autograd saves for the backward of one forward of `rows` x `seq_len` tokens (parameters
    excluded; each storage once); 0 when the forward cannot be traced on meta."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            trace = traced_step(model, rows, seq_len, dtype, backward=False, formulas=formulas)
    except PPTError:  # an untraceable forward: the FLOPs trace warns about it at the start of the run
        return 0
    return sum(size for storage, size in saved.items() if storage not in trace._param_storages)


def available_bytes(device: torch.device) -> int | None:
    """Free memory of a CUDA device; else the host's available memory (within a cgroup's limit); None if unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        found = re.search(r"MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text())
    except OSError:
        return None
    if found is None:
        return None
    available = int(found.group(1)) * 1024
    cgroup = Path("/sys/fs/cgroup")
    for limit, usage in CGROUP_FILES:
        try:
            available = min(available, int((cgroup / limit).read_text()) - int((cgroup / usage).read_text()))
        except (OSError, ValueError):  # no such cgroup, or "max": no limit
            continue
    return available


def check_memory(model: nn.Module, rows: int, seq_len: int, rt: Runtime, formulas: OpFormulas, eager: bool) -> None:
    """Refuse, in one line, a run whose model (on meta) and micro-batch need more memory than the device has free."""
    available = available_bytes(rt.device)
    if available is None:
        return
    params = sum(p.numel() for p in model.parameters())
    state = BYTES_PER_PARAMETER * params
    activations = activation_bytes(model, rows, seq_len, rt.dtype, formulas) if eager and state < available else 0
    if state + activations <= available:
        return
    need, state_text, activations_text, free = format_sizes(state + activations, state, activations, available)
    parts = f"{state_text} for the fp32 weights, gradients and AdamW moments of {si(params)} parameters"
    if activations:
        parts += f", {activations_text} for what autograd keeps of a micro-batch of {rows} x {seq_len} tokens"
    raise PPTError(
        f"this run needs at least {need} of memory ({parts}), but {free} is free on {rt.device}; choose a smaller "
        "config" + (", or lower --device-batch-size or --seq-len" if activations else "")
    )
