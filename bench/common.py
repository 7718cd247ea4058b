"""What several measurement tools share: timing on the device and its profile by kernel, a baseline file given as a
path, and the command-line pieces of more than one tool."""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from ppt.common import Number, PPTError


def require_cuda(tool: str) -> None:
    if not torch.cuda.is_available():
        raise PPTError(f"{tool} times CUDA kernels and needs a GPU (torch.cuda.is_available() is False); run it on one")


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_ms(fn: Callable[[], object], grad_to_none: list[torch.Tensor] | None = None) -> float:
    """Median ms of fn: triton's do_bench on CUDA (L2 flushed between calls); one timed call elsewhere (a smoke test
    in Triton's interpreter)."""
    for _ in range(3 if torch.cuda.is_available() else 1):  # compile and warm caches outside the timed region
        fn()
    synchronize()
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, grad_to_none=grad_to_none, return_mode="median")


def kernel_times(fn: Callable[[], object], leaves: list[torch.Tensor], iterations: int = 10) -> dict:
    """{kernel: (ms, launches) per call} over `iterations` calls of fn, the leaves' gradients cleared before each
    call as training does (so no accumulation kernels are counted); CPU time by op without CUDA."""
    cuda = torch.cuda.is_available()

    def call() -> None:
        for leaf in leaves:
            leaf.grad = None
        fn()

    def own_ms(event: object) -> float:  # the kernel's own time, not that of the ops above it
        return (event.self_device_time_total if cuda else event.self_cpu_time_total) / iterations / 1e3

    call()
    synchronize()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(iterations):
            call()
        synchronize()
    return {e.key: (own_ms(e), e.count // iterations) for e in prof.key_averages() if own_ms(e)}


def print_kernel_times(label: str, times: dict) -> None:
    """Prints the device time per call by kernel, from kernel_times."""
    total = sum(ms for ms, _ in times.values())
    print(f"\nprofile {label}: {total:.3f} ms of kernels per fwd+bwd")
    for name, (ms, count) in sorted(times.items(), key=lambda item: -item[1][0])[:12]:
        print(f"  {ms:8.4f} ms {100 * ms / total:5.1f}%  x{count:<3} {name[:90]}")


def python_file(text: str) -> Path:
    """An argparse `type=` for a baseline given as a path: a file of another commit, or an outside reference."""
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"{text} is not a file; write one with git show REV:PATH > FILE")
    return Path(text)


def load_module(name: str, path: Path) -> types.ModuleType:
    """The Python file at `path` imported as module `name`, without putting its folder on sys.path."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class CommaList:
    """An argparse `type=` for a comma list of variants: each item one of `item` (choices) or passing `item` (a
    Number such as positive_int). A bad item stops the parser with one line naming it and what items may be."""

    item: tuple[str, ...] | Number

    def __call__(self, text: str) -> list:
        values = []
        for part in text.split(","):
            try:
                values.append(self.item(part) if isinstance(self.item, Number) else self.item[self.item.index(part)])
            except (argparse.ArgumentTypeError, ValueError):
                accepted = self.item.accepted if isinstance(self.item, Number) else f"one of {', '.join(self.item)}"
                where = f" (in the list {text!r})" if "," in text else ""
                raise argparse.ArgumentTypeError(f"{part!r}{where} is not {accepted}") from None
        return values


def launcher(nproc: int) -> list[str]:
    """The command prefix that starts a module in one process, or in nproc ranks under torchrun."""
    return [sys.executable] + (["-m", "torch.distributed.run", f"--nproc_per_node={nproc}"] if nproc > 1 else [])
