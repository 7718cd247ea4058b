"""A traced step's cost (ppt/flops.py) against a device (ppt/devices.py): utilization per cell, the least time
each op needs at its roofline bound, and the text report `python -m scripts.flops` prints."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ppt.devices import Device, find_device, known_device, known_peak
from ppt.flops import OP_CLASSES, Cost, OpKey, Row
from ppt.formatting import dtype_name, dtype_order, si, text_table


@dataclass
class Utilization:
    """Per-cell ratios (row, dtype) of a cost on a device; see `utilization` for what they mean."""

    ratios: dict[Row, dict[torch.dtype, float]]

    @property
    def total(self) -> dict[torch.dtype, float]:
        """The sum of the per-cell ratios: a summary of the table, not a whole-model utilization."""
        sums: Counter = Counter()
        for cell in self.ratios.values():
            sums.update(cell)
        return dict(sums)

    def __str__(self) -> str:
        dtypes = sorted({d for cell in self.ratios.values() for d in cell}, key=dtype_order)
        body = [(" ".join(row), [si(cell.get(d, 0)) for d in dtypes]) for row, cell in self.ratios.items()]
        body.append(("total", [si(self.total.get(d, 0)) for d in dtypes]))
        return text_table([[dtype_name(d) for d in dtypes]], body)


def utilization(cost: Cost, device: str | torch.device | Device, duration_sec: float | None = None) -> Utilization:
    """How well each cell (pass, op class, dtype) with FLOPs fits `device`: its intensity over the device's roofline
    knee (below 1: memory-bound), or with a measured step duration its achieved FLOP/s over its attainable peak,
    min(peak FLOP/s, intensity * bytes/s) (for a compute-bound matmul cell, its MFU)."""
    found = known_device(device)
    ratios: dict[Row, dict[torch.dtype, float]] = {}
    for row in cost.rows():
        for dtype, flops in cost.flops.get(row, {}).items():
            if (intensity := cost.intensity(row, dtype)) is None:
                continue
            peak = known_peak(found, row[1], dtype)
            if duration_sec is None:
                ratio = intensity / (peak / found.bandwidth)
            else:
                ratio = (flops / duration_sec) / min(peak, intensity * found.bandwidth)
            ratios.setdefault(row, {})[dtype] = ratio
    return Utilization(ratios)


def roofline_seconds(cost: Cost, device: str | torch.device | Device) -> dict[OpKey, tuple[float, float]]:
    """Per kind of op, the least time its FLOPs and its bytes need on the device: (FLOPs / peak, bytes / bandwidth);
    alone it takes the larger (its bound), and a sum over ops assumes them run one after another, unfused."""
    found = known_device(device)
    return {
        key: (flops / known_peak(found, key[1], key[4]) if flops else 0.0, nbytes / found.bandwidth)
        for key, (flops, nbytes) in cost.ops.items()
    }


def _roofline_table(step: Cost, seconds: dict[OpKey, tuple[float, float]], group: Callable[[OpKey], str]) -> str:
    """FLOPs, bytes, roofline time and its memory-bound share per group of ops, largest time first."""
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])  # flops, bytes, time, memory-bound time
    for key, (flops, nbytes) in step.ops.items():
        compute, memory = seconds[key]
        added = (flops, nbytes, max(compute, memory), memory if memory > compute else 0.0)
        sums[group(key)] = [total + x for total, x in zip(sums[group(key)], added)]
    step_seconds = sum(totals[2] for totals in sums.values())
    body = []
    for name, (flops, nbytes, time, memory_bound) in sorted(sums.items(), key=lambda kv: -kv[1][2]):
        cells = [si(flops), si(nbytes), si(flops / nbytes if nbytes else 0), f"{time * 1e3:.4g}"]
        body.append((name, cells + [f"{time / step_seconds:.1%}", f"{memory_bound / time:.0%}" if time else "-"]))
    return text_table([["flops", "bytes", "intensity", "ms", "share", "memory-bound"]], body)


def report(step: Cost, device: str | torch.device | Device, dtype: torch.dtype, duration_sec: float | None) -> str:
    """The CLI's text: the cost table, FLOPs per token, the device table, utilization and roofline time."""
    lines = [
        str(step),
        "",
        f"FLOPs/token, MFU convention: {si(step.flops_per_token)} = 6N {si(step.flops_per_token_6n)} "
        f"(N = {si(step.params_matmul)} matmul params) + attention {si(step.attention_flops_per_token)}",
        f"FLOPs/token, 6N only:        {si(step.flops_per_token_6n)}",
    ]
    if (found := find_device(device)) is None:
        return "\n".join([*lines, "", f"device {device}: peak rates unknown, no roofline"])
    name = dtype_name(dtype).upper()
    peaks = [(c, [si(found.peak(c, dtype) or 0), si(found.bandwidth), si(found.knee(c, dtype) or 0)])
             for c in OP_CLASSES]  # fmt: skip
    peaks_table = text_table([["flops", "bytes", "intensity"], [dtype_name(dtype), "/s", "knee"]], peaks)
    lines += ["", f"{found.name} peaks ({name}):", peaks_table, ""]
    knee, matmul_intensity = found.knee("matmul", dtype), step.intensity(("primal", "matmul"), dtype)
    if knee and matmul_intensity:
        lines.append(
            f"The {found.name}'s {name} matmul roofline knee is {si(knee)} FLOPs/byte; this model's primal matmul "
            f"intensity is {si(matmul_intensity)} ({matmul_intensity / knee - 1:+.1%} from the knee)."
        )
    lines += ["", "Utilization: intensity / knee per cell (below 1: memory-bound)", str(utilization(step, found))]
    if duration_sec is not None:
        lines += ["", f"Utilization at {duration_sec:g} s/step: achieved / min(peak, intensity * bandwidth)",
                  str(utilization(step, found, duration_sec))]  # fmt: skip
    seconds = roofline_seconds(step, found)
    step_seconds = sum(max(c, m) for c, m in seconds.values())
    ceiling = step.flops_per_token * step.tokens / step_seconds / found.peak("matmul", dtype)
    lines += [
        "",
        "Roofline time per step, each op alone at its bound (no overlap, no fusion), by pass and op class:",
        _roofline_table(step, seconds, lambda key: f"{key[0]} {key[1]}"),
        "",
        "... and by model part (innermost module, layer indices dropped), both passes:",
        _roofline_table(step, seconds, lambda key: key[2]),
        "",
        f"At the roofline one step takes >= {step_seconds * 1e3:.4g} ms, so MFU <= {ceiling:.1%} on the "
        f"{found.name} for these ops run unfused.",
        "Bytes are the logical operand I/O of the unfused algorithm, not measured memory traffic.",
    ]
    return "\n".join(lines)
