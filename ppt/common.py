"""Shared runtime plumbing: device and dtype autodetect, DDP from torchrun's environment, logging, cache dir,
atomic writes and command-line number checks. The lock that gives a run sole use of its output directory is
ppt/locks.py."""

from __future__ import annotations

import argparse
import inspect
import math
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, NoReturn

import torch
import torch._functorch.config
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


class PPTError(Exception):
    """A user-facing error: its message names the problem and the fix. Scripts print it and exit 2."""


def cache_dir() -> Path:
    """Where shards, tokenizers, checkpoints and reports live: $PPT_CACHE, else ~/.cache/ppt."""
    return Path(os.environ.get("PPT_CACHE") or Path.home() / ".cache" / "ppt").expanduser()


def temp_path(path: Path) -> Path:
    """The hidden temp name beside `path` that `atomic_file` writes first (what a killed write leaves behind)."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


@contextmanager
def atomic_file(path: Path) -> Iterator[BinaryIO]:
    """Write through a temp file beside `path`, fsync, then rename over it: a reader sees the old file or the whole
    new one, never a part. On any error the temp file is removed and the old file stays."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def autodetect_device() -> torch.device:
    if torch.cuda.is_available():  # also true on ROCm builds
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
_DTYPES |= {"fp32": torch.float32, "float32": torch.float32}


def autodetect_dtype(device: torch.device) -> torch.dtype:
    """bf16 on CUDA SM80+ and ROCm, fp32 elsewhere; PPT_DTYPE (bf16|fp16|fp32) overrides."""
    if override := os.environ.get("PPT_DTYPE"):
        if override.lower() not in _DTYPES:
            raise PPTError(f"PPT_DTYPE={override!r} is not a dtype; use one of bf16, fp16, fp32")
        return _DTYPES[override.lower()]
    if device.type == "cuda" and (torch.version.hip is not None or torch.cuda.get_device_capability(device)[0] >= 8):
        return torch.bfloat16
    return torch.float32


@dataclass(frozen=True)
class Runtime:
    """Where this process runs: rank, world, device, and the dtype matmuls run in."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    dtype: torch.dtype

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def checked_device(name: str) -> torch.device:
    """A --device value as a torch.device that this machine has."""
    try:
        dev = torch.device(name)
    except RuntimeError as exc:
        raise PPTError(f"--device {name!r} is not a device name; use cpu, cuda, cuda:N or mps") from exc
    available = {"cpu": True, "cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available()}
    if not available.get(dev.type, False):
        raise PPTError(f"--device {name}: this machine has no {dev.type} device; leave --device out to autodetect")
    return dev


def init_runtime(device: str | None = None) -> Runtime:
    """Read torchrun's RANK/LOCAL_RANK/WORLD_SIZE, start the process group when world > 1, pick device and dtype."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = checked_device(device) if device else autodetect_device()
    # AOTAutograd's cache passes over any graph holding a custom autograd.Function (the training loss is one) unless
    # allowed; such a Function is traced into the graph whole, so the cache key covers it, and a warm cache then spares
    # each new process (every run of a study) the joint trace and the partition
    torch._functorch.config.autograd_cache_allow_custom_autograd_functions = True
    if dev.type == "cuda":
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, device_id=dev if dev.type == "cuda" else None)
    return Runtime(rank, local_rank, world_size, dev, autodetect_dtype(dev))


def wrap_ddp(module: torch.nn.Module, rt: Runtime, find_unused_parameters: bool = False) -> DistributedDataParallel:
    """DDP for the training step: gradients live in the all-reduce buckets, and buffers are not broadcast per forward
    (one more collective per micro-batch, where the ranks wait on each other; the shipped models' only buffers are RoPE
    tables every rank computes alike, and SPEC.md tells a model whose buffers change to sync them itself)."""
    # newer torch renamed the switch (the old name warns); the new one still syncs buffers once, at construction
    params = inspect.signature(DistributedDataParallel).parameters
    no_forward_sync = "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"
    device_ids = [rt.local_rank] if rt.device.type == "cuda" else None
    return DistributedDataParallel(
        module,
        device_ids=device_ids,
        find_unused_parameters=find_unused_parameters,
        gradient_as_bucket_view=True,
        **{no_forward_sync: False},
    )


def shutdown_runtime(wait: bool = True) -> None:
    """End the process group: after a barrier when the ranks finish together, without one after an error (peers may
    never reach it). A process that exits with a gloo group still up can abort (SIGABRT) in its threads' teardown."""
    if dist.is_initialized():
        if wait:
            dist.barrier()
        dist.destroy_process_group()


def print0(*args: object, **kwargs: object) -> None:
    """print on rank 0 only, flushed so logs interleave sanely under torchrun."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(*args, **kwargs, flush=True)


def warn0(message: str) -> None:
    print0(f"warning: {message}", file=sys.stderr)


COMPILE_CHOICES = ("auto", "on", "off")  # the --compile values compile_enabled reads


def compile_enabled(choice: str, device: torch.device) -> bool:
    """Whether to torch.compile: choice "on", or "auto" on CUDA, and only where the toolchain works (a tiny function
    compiles and runs; else a one-line warning)."""
    if not (choice == "on" or (choice == "auto" and device.type == "cuda")):
        return False

    def probe(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(x) * 2 + 1

    try:
        x = torch.randn(8, device=device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = torch.compile(probe)(x)
        return bool(torch.allclose(out, probe(x), atol=1e-5))
    except Exception as exc:  # any compile failure means: run eager
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        warn0(f"torch.compile is unavailable here ({first_line}); running eager")
        return False


def maybe_compile(module: torch.nn.Module, choice: str, device: torch.device) -> torch.nn.Module:
    """torch.compile(module) where compile_enabled(choice, device); else module."""
    return torch.compile(module) if compile_enabled(choice, device) else module


# ---- the command line --------------------------------------------------------------------------------------------


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad command line as ppt reports bad input: one `error:` line, exit status 2."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message} (see --help)", file=sys.stderr, flush=True)
        sys.exit(2)


@dataclass(frozen=True)
class Number:
    """An argparse `type=` for a numeric flag: a finite int or float in [minimum, maximum] (minimum excluded when
    `above`); `scientific` ints may be written 2e9 (token counts)."""

    kind: type
    minimum: float
    maximum: float = 2**63 - 1  # ints pass to numpy and torch as int64
    above: bool = False
    scientific: bool = False

    def __call__(self, text: str) -> int | float:
        try:
            value = float(text) if self.kind is float or self.scientific else int(text)
        except ValueError:
            value = None
        if self.kind is int and isinstance(value, float):
            value = int(value) if math.isfinite(value) and value.is_integer() else None
        below = value is not None and (value <= self.minimum if self.above else value < self.minimum)
        if value is None or not math.isfinite(value) or below or value > self.maximum:
            raise argparse.ArgumentTypeError(f"{text!r} is not {self.accepted}")
        return value

    @property
    def accepted(self) -> str:
        """What the flag takes: 'an integer >= 1', 'a whole number >= 1 and <= 1e15 (2e9 notation allowed)'."""
        noun = "a whole number" if self.scientific else "an integer" if self.kind is int else "a finite number"
        text = f"{noun} {'>' if self.above else '>='} {_plain(self.minimum)}"
        if self.maximum < (2**63 - 1 if self.kind is int else math.inf):
            text += f" and <= {_plain(self.maximum)}"
        return text + (" (2e9 notation allowed)" if self.scientific else "")


def _plain(x: float) -> str:
    """258 as 258, 10**15 as 1e15, 0.5 as 0.5."""
    if not float(x).is_integer():
        return f"{x:g}"
    digits = str(int(x))
    zeros = len(digits) - len(digits.rstrip("0"))
    return f"{digits[:-zeros]}e{zeros}" if zeros >= 6 else digits


positive_int = Number(int, 1)
nonneg_int = Number(int, 0)
positive_float = Number(float, 0, math.inf, above=True)
nonneg_float = Number(float, 0, math.inf)


def run_tag(text: str) -> str:
    """An argparse `type=` for a run name: it names a directory and a file, so letters, digits and . _ + - only, not
    starting with a dot (no path of its own, nothing hidden)."""
    if not re.fullmatch(r"[A-Za-z0-9_+-][A-Za-z0-9._+-]*", text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a run name: use letters, digits and . _ + - (not starting with a dot)"
        )
    return text


MAX_TOKENS = 10**15  # a thousand trillion tokens: far past any run, and an int64 product with any batch
token_count = Number(int, 1, MAX_TOKENS, scientific=True)
nonneg_token_count = Number(int, 0, MAX_TOKENS, scientific=True)
task_limit = Number(float, 0, 1e9, above=True)  # lm-eval's --limit: examples per task, or below 1 a fraction of them


def few(names: list[str]) -> str:
    """The first three names, and how many more: for messages that name what is wrong."""
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def format_sizes(*sizes: float) -> list[str]:
    """Byte counts, each in its unit (B, kB, MB, GB, TB), with as many decimals (up to 3) as it takes for different
    sizes to read differently: 21.37 MB and 21.60 MB, never 0.02 GB and 0.02 GB."""

    def unit(size: float) -> tuple[str, float]:
        return next(((u, s) for u, s in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)) if size >= s), ("B", 1))

    for decimals in range(1, 4):
        texts = [f"{size / unit(size)[1]:.{decimals}f} {unit(size)[0]}" for size in sizes]
        if len(set(texts)) == len(set(sizes)):
            break
    return texts


def run_cli(main: Callable[[], object]) -> None:
    """A script's entry point: a PPTError becomes one `error:` line on stderr and exit status 2, not a traceback."""
    try:
        main()
    except PPTError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        shutdown_runtime(wait=False)
        sys.exit(2)
