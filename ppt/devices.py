"""Accelerators' dense peak rates (no sparsity) from the vendors' datasheets: the MFU denominator, and the roofline's
peaks and bandwidth (ppt/roofline.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ppt.common import PPTError


@dataclass(frozen=True)
class Device:
    """Peak FLOP/s by op class and dtype, and peak memory bytes/s, of one accelerator."""

    name: str
    matmul: dict[torch.dtype, float]  # tensor/matrix cores, dense, by operand dtype; fp32 means TF32
    vector: float  # fp32 FLOP/s of the general cores: PyTorch computes elementwise, reduction and selection ops in
    # fp32 whatever the storage dtype, so one rate serves every dtype there
    bandwidth: float  # memory bytes/s

    def peak(self, op_class: str, dtype: torch.dtype) -> float | None:
        return self.matmul.get(dtype) if op_class == "matmul" else self.vector

    def knee(self, op_class: str, dtype: torch.dtype) -> float | None:
        """The roofline knee (FLOPs/byte): below it an op is memory-bound, above it compute-bound."""
        peak = self.peak(op_class, dtype)
        return peak / self.bandwidth if peak else None


def _matmul_peaks(bf16: float, tf32: float, fp8: float | None = None) -> dict[torch.dtype, float]:
    peaks = {torch.bfloat16: bf16, torch.float16: bf16, torch.float32: tf32}
    return peaks | ({torch.float8_e4m3fn: fp8, torch.float8_e5m2: fp8} if fp8 else {})


T, P = 1e12, 1e15  # tera, peta
DEVICES: dict[str, Device] = {
    "h100": Device("H100 SXM", _matmul_peaks(989 * T, 494.7 * T, 1979 * T), 67 * T, 3.35 * T),
    "h100-pcie": Device("H100 PCIe", _matmul_peaks(756 * T, 378 * T, 1513 * T), 51 * T, 2.0 * T),
    "h200": Device("H200 SXM", _matmul_peaks(989 * T, 494.7 * T, 1979 * T), 67 * T, 4.8 * T),
    "a100": Device("A100 SXM 80GB", _matmul_peaks(312 * T, 156 * T), 19.5 * T, 2.039 * T),
    "b200": Device("B200", _matmul_peaks(2.25 * P, 1.125 * P, 4.5 * P), 75 * T, 8.0 * T),
    "rtx4090": Device("RTX 4090", _matmul_peaks(165.2 * T, 82.6 * T), 82.6 * T, 1.008 * T),
    "rtx5090": Device("RTX 5090", _matmul_peaks(209.5 * T, 104.8 * T), 104.8 * T, 1.792 * T),
    "mi300x": Device("MI300X", _matmul_peaks(1307.4 * T, 653.7 * T, 2614.9 * T), 163.4 * T, 5.3 * T),
}
del T, P


def find_device(device: str | torch.device | Device) -> Device | None:
    """A Device from a table key ("h100"), a CUDA device name ("NVIDIA H100 80GB HBM3") or a torch.device; None
    where the peaks are unknown (CPUs, MPS, GPUs not in the table)."""
    if isinstance(device, Device):
        return device
    if isinstance(device, torch.device):
        if device.type != "cuda":
            return None
        device = torch.cuda.get_device_name(device)
    squash = lambda name: "".join(ch for ch in name.lower() if ch.isalnum())
    # a key's letters and digits within the name, the longest key first: h100-pcie before h100
    return next((DEVICES[key] for key in sorted(DEVICES, key=len, reverse=True) if squash(key) in squash(device)), None)


def peak_flops(device: str | torch.device | Device, dtype: torch.dtype = torch.bfloat16) -> float | None:
    """Dense matmul peak FLOP/s of a device in `dtype` (the MFU denominator); None when unknown (e.g. CPU)."""
    found = find_device(device)
    return found.peak("matmul", dtype) if found else None


def known_device(device: str | torch.device | Device) -> Device:
    found = find_device(device)
    if found is None:
        raise PPTError(f"no peak rates known for device {device!r}; use one of {', '.join(DEVICES)}")
    return found


def known_peak(device: Device, op_class: str, dtype: torch.dtype) -> float:
    peak = device.peak(op_class, dtype)
    if not peak:
        raise PPTError(f"{device.name} has no {op_class} peak for {dtype} in the table; cost the model in bf16")
    return peak
