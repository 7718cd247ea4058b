"""The run manifest: one JSON per run that says exactly what ran (config, code, hardware, data, results).

It lives at `<cache>/reports/<run>.json` and beside the checkpoints, and is rewritten atomically as the run
progresses, so a crash leaves the last consistent version. A loss-curve PNG sits next to it.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from ppt.common import PPTError, atomic_file, warn0

REPO_ROOT = Path(__file__).resolve().parent.parent


def git_state() -> dict[str, Any]:
    """Commit sha and whether the working tree differs from it (None outside a git checkout)."""

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    sha = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": sha, "dirty": bool(status) if status is not None else None}


def model_source() -> dict[str, str]:
    """sha256 of the architecture's source (ppt/model.py and the kernels it may call): two runs of one config name
    whose model code differs are different settings, whatever git says about a dirty tree."""
    files = [REPO_ROOT / "ppt" / "model.py", *sorted((REPO_ROOT / "ppt" / "kernels").glob("*.py"))]
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.relative_to(REPO_ROOT).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return {"sha256": digest.hexdigest(), "files": [p.relative_to(REPO_ROOT).as_posix() for p in files]}


def hardware() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
    }
    info["torch"] = torch.__version__
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
        info["cuda"] = torch.version.cuda or torch.version.hip
    return info


class RunReport:
    """Accumulates the manifest of one run and writes it (rank 0 only) to each of its destinations."""

    def __init__(self, name: str, destinations: list[Path], enabled: bool = True) -> None:
        self.paths = [Path(d) / f"{name}.json" for d in destinations]
        self.enabled = enabled
        self.data: dict[str, Any] = {
            "run": name,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "git": git_state(),
            "model_source": model_source(),
            "hardware": hardware(),
        }
        self.history: list[dict[str, float]] = []

    def update(self, **fields: Any) -> None:
        self.data.update(fields)

    def log_step(self, **metrics: float) -> None:
        self.history.append(metrics)

    @property
    def evals(self) -> list[dict[str, float]]:
        """The history's evaluations (entries with a val bpb), in order."""
        return [h for h in self.history if "val_bpb" in h]

    def write(self) -> None:
        if not self.enabled:
            return
        payload = json.dumps({**self.data, "evals": self.evals, "history": self.history}, indent=1, default=str)
        for path in self.paths:
            try:
                with atomic_file(path) as f:
                    f.write(payload.encode("utf-8"))
            except OSError as exc:
                raise PPTError(
                    f"could not write the run manifest {path} ({exc.strerror or exc}); the previous version is "
                    "untouched. Free disk space, then resume with --resume auto"
                ) from exc

    def plot(self, path: Path) -> Path | None:
        """Train loss (and val bpb where measured) against tokens seen; None when there is nothing to plot, or when
        the file cannot be written (a warning: the checkpoints and the manifest, written before it, hold the run)."""
        train = [(h["tokens"], h["loss"]) for h in self.history if "loss" in h]
        val = [(h["tokens"], h["val_bpb"]) for h in self.history if "val_bpb" in h]
        if not self.enabled or not train:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(*zip(*train), lw=1, label="train loss (nats/token)")
        if val:
            ax2 = ax.twinx()
            ax2.plot(*zip(*val), "o-", color="tab:red", label="val bits/byte")
            ax2.set_ylabel("val bits per byte")
            ax2.legend(loc="upper center")
        ax.set_xlabel("tokens")
        ax.set_ylabel("train loss")
        ax.set_title(self.data["run"])
        ax.legend(loc="upper right")
        fig.tight_layout()
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=110)
        plt.close(fig)
        try:
            with atomic_file(path) as f:
                f.write(png.getvalue())
        except OSError as exc:
            warn0(f"could not write the loss curve {path} ({exc.strerror or exc})")
            return None
        return path
