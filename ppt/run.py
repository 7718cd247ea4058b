"""The run record: one typed schema for what a training run resolved, measured and scored. base_train writes it
(`<cache>/reports/<tag>.json` and beside the checkpoints, atomically as the run progresses); base_eval adds its scores;
compare and study read it by attribute."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import platform
import shlex
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ppt.common import PPTError, atomic_file, warn0

FORMAT = 2
REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class TrainSettings:
    """Every setting base_train resolved: what the run trained, and how it was launched."""

    seq_len: int
    total_batch_tokens: int
    device_batch_size: int
    grad_accum: int
    world_size: int
    optimizer: str
    lr: float
    optimizer_groups: list[dict[str, Any]]  # per parameter role: algorithm, initial_lr, betas, eps, weight decay, ...
    weight_decay: float
    grad_clip: float
    schedule: str
    warmup_tokens: float
    warmup_steps: int
    decay_frac: float
    steps: int  # the schedule's length
    last_step: int  # where the run stops (--max-steps), the schedule unchanged
    target_tokens: int
    budget: dict[str, Any] | None  # --target-flops: the FLOPs, the per-token estimate, the tokens it became
    doc_masks: bool
    deterministic: bool
    seed: int
    data_seed: int
    model_seed: int
    dtype: str
    compile: bool
    compile_mode: str | None
    loader_prefetch: int
    skip_nonfinite: int
    eval_every: int
    eval_tokens: int
    recipe: str | None
    ddp_find_unused_parameters: bool = False

    # What a resumed run may change: how it runs, never its schedule or the data it reads (resume_mismatch)
    RESUMABLE_CHANGES = ("device_batch_size", "grad_accum", "world_size", "compile", "compile_mode", "last_step",
                         "loader_prefetch", "eval_every", "skip_nonfinite", "ddp_find_unused_parameters",
                         "deterministic", "recipe", "optimizer_groups", "budget")  # fmt: skip

    def resume_mismatch(self, saved: TrainSettings) -> list[str]:
        """The settings that differ from a checkpoint's and would change what the resumed run trains."""
        mine, theirs = dataclasses.asdict(self), dataclasses.asdict(saved)
        return [
            f"{k} {theirs[k]!r} -> {v!r}" for k, v in mine.items() if k not in self.RESUMABLE_CHANGES and v != theirs[k]
        ]

    @property
    def target_flops(self) -> float | None:
        return (self.budget or {}).get("target_flops")


@dataclass
class Evaluation:
    """One val bits-per-byte measurement during training."""

    step: int
    tokens: int
    comparison_flops: int
    wall_time_s: float
    val_nll: float
    val_bpb: float
    eval_tokens: int


@dataclass
class RunRecord:
    run: str  # the run's name (--tag)
    out_dir: str
    argv: list[str]
    args: dict[str, Any]  # base_train's flags as resolved: what --from-manifest relaunches
    config_name: str
    config: dict[str, Any]  # {"class": the config class, **its fields}
    tokenizer: dict[str, Any]  # name, fingerprint, demo
    data: dict[str, Any]  # dir, fingerprint (of the tokens: ppt.data)
    train: TrainSettings
    params: int
    flops_per_token: dict[str, Any] | None  # the MFU convention; None when the forward could not be traced
    comparison_flops_rule: dict[str, Any]  # ComparisonFlops.state_dict() and what it came to per token
    started: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    git: dict[str, Any] = field(default_factory=lambda: git_state())
    model_source: dict[str, Any] = field(default_factory=lambda: model_source())
    hardware: dict[str, Any] = field(default_factory=lambda: hardware())
    history: list[dict[str, Any]] = field(default_factory=list)  # per step and per evaluation (SPEC.md)
    evals: list[Evaluation] = field(default_factory=list)
    # how the run ended
    steps_done: int | None = None
    tokens: int | None = None
    comparison_flops: int | None = None
    wall_time_s: float | None = None
    skipped_nonfinite_steps: int = 0
    finished: str | None = None
    stopped_at: int | None = None
    wandb: dict[str, Any] | None = None
    eval: dict[str, Any] | None = None  # scripts.base_eval's results
    format: int = FORMAT

    @property
    def final_val(self) -> Evaluation | None:
        """The end-of-training evaluation; None until the run has finished."""
        return self.evals[-1] if self.finished and self.evals else None

    @property
    def seeds(self) -> tuple[int, int]:
        return self.train.data_seed, self.train.model_seed

    def median_tok_per_s(self) -> float | None:
        """The median of the logged steps' training speeds; None when no step logged one."""
        speeds = [h["tok_per_s"] for h in self.history if "tok_per_s" in h]
        return statistics.median(speeds) if speeds else None

    def benchmark_scores(self) -> dict[str, float]:
        """base_eval's lm-eval scores by task label, if it ran them."""
        return ((self.eval or {}).get("benchmarks") or {}).get("rows", {})

    def to_dict(self) -> dict[str, Any]:
        command = shlex.join(["python", "-m", "scripts.base_train", *self.argv])
        final = self.final_val and dataclasses.asdict(self.final_val)
        return dataclasses.asdict(self) | {"command": command, "final_val": final}  # derived: not read back

    @classmethod
    def load(cls, path: Path) -> RunRecord:
        """The record in `path`: this format, or a format-1 manifest converted. One PPTError line otherwise."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise PPTError(f"{path} is not a readable run record ({exc}); pass the JSON base_train wrote") from exc
        if not isinstance(data, dict) or "train" not in data:
            raise PPTError(f"{path} is not a run record of base_train (no 'train'); pass the JSON it wrote")
        data = from_format_1(data) if "format" not in data else data
        if data["format"] != FORMAT:
            raise PPTError(
                f"{path}: run record format {data['format']!r}, not {FORMAT}; convert a format-1 manifest with "
                "ppt.run.from_format_1, or rerun with this ppt"
            )
        data = {k: v for k, v in data.items() if k not in ("command", "final_val")}  # derived: not read back
        try:
            data["train"] = TrainSettings(**data["train"])
            data["evals"] = [Evaluation(**e) for e in data.get("evals", [])]
            return cls(**data)
        except (KeyError, TypeError) as exc:
            raise PPTError(f"{path}: not a complete format-{FORMAT} run record ({exc})") from exc

    def write(self, paths: list[Path]) -> None:
        payload = json.dumps(self.to_dict(), indent=1, default=str).encode("utf-8")
        for path in paths:
            try:
                with atomic_file(path) as f:
                    f.write(payload)
            except OSError as exc:
                raise PPTError(
                    f"could not write the run record {path} ({exc.strerror or exc}); the previous version is "
                    "untouched. Free disk space, then resume with --resume auto"
                ) from exc


def from_format_1(data: dict[str, Any]) -> dict[str, Any]:
    """A manifest written before the record had a format (2026-11-29 to 2026-12-02) as a format-2 record's dict: out_dir
    read from its flags, the relaunch command and wall-time note (derived, or in SPEC.md) dropped."""
    data = {k: v for k, v in data.items() if k not in ("relaunch", "wall_time_includes")}
    args = data.get("args") or {}
    return data | {"format": FORMAT, "out_dir": args.get("out_dir") or data.get("data", {}).get("dir", "")}


def git(*args: str, root: Path = REPO_ROOT) -> str | None:
    """git's output in `root`; None where git fails (no checkout, no git)."""
    try:
        out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_state() -> dict[str, Any]:
    """Commit sha and whether the working tree differs from it (None outside a git checkout)."""
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(status) if status is not None else None}


def model_source(root: Path = REPO_ROOT) -> dict[str, Any]:
    """sha256 of the architecture's source (ppt/model.py and the kernels it may call): runs of one config name whose
    model code differs are different settings. Unless git vouches that every one of these files is the commit's,
    `source` holds them all as text (a fork's uncommitted model.py is the usual case): rebuilding needs no commit."""
    paths = [root / "ppt" / "model.py", *sorted((root / "ppt" / "kernels").glob("*.py"))]
    files = {path.relative_to(root).as_posix(): path.read_bytes() for path in paths}
    digest = hashlib.sha256()
    for name, content in files.items():
        digest.update(name.encode() + b"\0" + content + b"\0")
    recorded = {"sha256": digest.hexdigest(), "files": list(files)}
    if git("status", "--porcelain", "--", *files, root=root) != "":  # changed, new (untracked), or no git
        recorded["source"] = {name: content.decode() for name, content in files.items()}
    return recorded


def hardware() -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "cpu_count": os.cpu_count()}
    info |= {"python": platform.python_version(), "torch": torch.__version__, "triton": None}
    with contextlib.suppress(ImportError):
        import triton

        info["triton"] = triton.__version__
    if packed := os.environ.get("PPT_RUNS_PER_GPU"):  # set by a study's local pool: runs sharing this device
        info["runs_per_gpu"] = int(packed)
    if torch.cuda.is_available():
        info |= {"gpu": torch.cuda.get_device_name(0), "gpu_count": torch.cuda.device_count()}
        info["cuda"] = torch.version.cuda or torch.version.hip
    return info


def plot_losses(record: RunRecord, path: Path) -> Path | None:
    """Train loss (and val bpb) against tokens as a PNG; None when there is nothing to plot or the file cannot be
    written (a warning: the checkpoints and the record, written before it, hold the run)."""
    train = [(h["tokens"], h["loss"]) for h in record.history if "loss" in h]
    if not train:
        return None
    from matplotlib.figure import Figure  # no pyplot: no global backend state; a Figure saves through Agg

    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    ax.plot(*zip(*train), lw=1, label="train loss (nats/token)")
    if record.evals:
        ax2 = ax.twinx()
        ax2.plot([e.tokens for e in record.evals], [e.val_bpb for e in record.evals], "o-", color="tab:red",
                 label="val bits/byte")  # fmt: skip
        ax2.set_ylabel("val bits per byte")
        ax2.legend(loc="upper center")
    ax.set(xlabel="tokens", ylabel="train loss", title=record.run)
    ax.legend(loc="upper right")
    fig.tight_layout()
    try:
        with atomic_file(path) as f:
            fig.savefig(f, format="png", dpi=110)
    except OSError as exc:
        warn0(f"could not write the loss curve {path} ({exc.strerror or exc})")
        return None
    return path
