"""Atomic checkpoints `<dir>/step_<NNNNNNNN>.pt`: model, optimizer, loader state, RNG states, step and config, written
to a temporary name and renamed (a kill mid-write leaves no file that looks complete), old ones pruned only after the
new one is complete, loaded with `weights_only=True` (tensors and plain containers only, never code)."""

from __future__ import annotations

import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from ppt.common import PPTError, atomic_file, format_sizes, warn0

_NAME = re.compile(r"^step_(\d{8})\.pt$")


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"step_{step:08d}.pt"


def list_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete-looking checkpoint file, oldest first."""
    if not directory.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name)))


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore RNG states; they must be CPU byte tensors, whatever device the checkpoint was mapped to."""
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def save_checkpoint(directory: Path, step: int, payload: dict[str, Any], keep: int = 0) -> Path:
    """Write payload atomically as step_<step>.pt; then, and only then, prune to the newest `keep` (0 keeps all)."""
    final = checkpoint_path(directory, step)
    try:
        with atomic_file(final) as f:
            torch.save({**payload, "step": step}, f)
    except (OSError, RuntimeError) as exc:
        # torch's zip writer turns a failed write (disk full) into a RuntimeError raised while handling the OSError
        cause = exc if isinstance(exc, OSError) else exc.__context__
        if not isinstance(cause, OSError):
            raise
        raise PPTError(
            f"could not write checkpoint {final} ({cause.strerror or cause}); the previous checkpoint is untouched. "
            "Free disk space or pass a writable --out-dir, then resume with --resume auto"
        ) from exc
    for stale in directory.glob(".step_*.pt.*.tmp"):  # left by a run killed mid-write; one writer per directory
        stale.unlink(missing_ok=True)
    if keep > 0:
        for _, old in list_checkpoints(directory)[:-keep]:
            old.unlink(missing_ok=True)
    return final


def load_checkpoint(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    if path.is_dir():
        raise PPTError(f"checkpoint {path} is a directory; pass a step_*.pt file in it, or --resume auto")
    if not path.is_file():
        raise PPTError(f"checkpoint {path} does not exist; pass a step_*.pt file or --resume auto")
    with open(path, "rb") as f:
        if f.read(4) != b"PK\x03\x04":  # torch.save writes a zip archive
            raise PPTError(f"{path} is not a checkpoint (not a PyTorch archive); pass a step_*.pt file of base_train")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise PPTError(
            f"checkpoint {path} holds Python objects other than tensors and plain containers; refused, because "
            "loading them could run code. Use a checkpoint written by base_train"
        ) from exc
    except Exception as exc:
        raise PPTError(
            f"checkpoint {path} is unreadable or incomplete ({type(exc).__name__}): copy it again if it was copied, "
            "else use an earlier one (--resume auto picks the newest complete checkpoint)"
        ) from exc


def latest_checkpoint(directory: Path) -> Path | None:
    """Newest checkpoint that loads; incomplete or corrupt files are skipped with their names printed."""
    for _, path in reversed(list_checkpoints(directory)):
        try:
            torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            return path
        except Exception:
            warn0(f"skipping unreadable checkpoint {path}")
    return None


def config_mismatch(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Human-readable differences between two config dicts (empty when they agree)."""
    return [
        f"{k}: checkpoint={saved.get(k, '<absent>')!r} run={current.get(k, '<absent>')!r}"
        for k in sorted(saved.keys() | current.keys())
        if saved.get(k) != current.get(k)
    ]


def ensure_writable(directory: Path, needed_bytes: int) -> None:
    """Fail before training starts when the output dir is unwritable or lacks room for two checkpoints (room is
    looked for first, on the nearest folder that exists: a refusal makes no folder)."""
    free = shutil.disk_usage(next(p for p in (directory, *directory.parents) if p.exists())).free
    if free < 2 * needed_bytes:
        free_text, one, two = format_sizes(free, needed_bytes, 2 * needed_bytes)
        raise PPTError(
            f"only {free_text} free under {directory}; a checkpoint takes about {one}, and two ({two}) must fit while "
            "the older is replaced: free space or pass --out-dir on a larger disk"
        )
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".write_probe{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as exc:
        raise PPTError(f"output directory {directory} is not writable ({exc.strerror}); pass --out-dir DIR") from exc
