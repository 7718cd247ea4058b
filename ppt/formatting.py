"""How the fixed code prints numbers: SI-suffixed counts, dtype columns, text tables and durations."""

from __future__ import annotations

import torch

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
                torch.float8_e4m3fn: "fp8e4m3", torch.float8_e5m2: "fp8e5m2"}  # fmt: skip


def dtype_order(dtype: torch.dtype) -> tuple[int, str]:
    """Table columns: the low-precision compute dtypes first, then fp32, then integers and the rest."""
    order = list(_DTYPE_NAMES)
    return (order.index(dtype) if dtype in order else len(order), str(dtype))


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def si(x: float) -> str:
    """4 significant digits with an SI suffix (532.4M); '-' for zero."""
    if not x:
        return "-"
    for power, suffix in ((18, "E"), (15, "P"), (12, "T"), (9, "G"), (6, "M"), (3, "K")):
        if abs(x) >= 10**power:
            return f"{x / 10**power:.4g}{suffix}"
    return f"{x:.4g}"


def duration(seconds: float) -> str:
    """42s, 5m08s, 7h58m, 2d03h."""
    seconds = int(seconds)
    for size, unit, part, part_unit in ((86400, "d", 3600, "h"), (3600, "h", 60, "m"), (60, "m", 1, "s")):
        if seconds >= size:
            return f"{seconds // size}{unit}{seconds % size // part:02d}{part_unit}"
    return f"{seconds}s"


def text_table(header: list[list[str]], body: list[tuple[str, list[str]]]) -> str:
    """Right-aligned columns under one or more header lines; each body row is (label, cells)."""
    label_width = max(len(label) for label, _ in body)
    rows = [("", cells) for cells in header] + body
    widths = [max(len(s) for s in column) for column in zip(*(cells for _, cells in rows))]
    return "\n".join(
        f"{label:<{label_width}}" + "".join(f"  {s:>{w}}" for s, w in zip(cells, widths)) for label, cells in rows
    )
