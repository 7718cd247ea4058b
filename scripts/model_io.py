"""Find a run's checkpoint, rebuild its model from ppt/model.py, and load the tokenizer it was trained with.

Shared by base_eval, lm_eval and export_hf. A checkpoint stores `config = {"class": <config class>, **fields}`;
the class must still exist in ppt/model.py and the weights must fit the model it builds, else the checkpoint is
of another architecture and loading stops with a message saying so.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ppt import checkpoint as ckpt
from ppt.common import PPTError, cache_dir
from ppt.data import default_data_dir, load_data_tokenizer
from ppt.model import CONFIGS, build_model
from ppt.tokenizer import Tokenizer


@dataclass
class LoadedRun:
    """A checkpoint and what was needed to use it."""

    path: Path
    tag: str
    state: dict[str, Any]  # the checkpoint dict: model, config, step, tokens, tokenizer_fingerprint, ...

    @property
    def config(self) -> dict[str, Any]:
        return self.state["config"]

    @property
    def manifest_paths(self) -> list[Path]:
        """The run manifest in the reports dir and its copy beside the checkpoints (base_train writes both)."""
        return [cache_dir() / "reports" / f"{self.tag}.json", self.path.parent / f"{self.tag}.json"]

    def manifest(self) -> dict[str, Any]:
        """The first manifest that exists and parses, else {}."""
        for path in self.manifest_paths:
            try:
                return json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                continue
        return {}


def resolve_checkpoint(model_tag: str | None = None, checkpoint: str | Path | None = None) -> tuple[Path, str]:
    """(checkpoint file, run tag): an explicit path, else the latest complete checkpoint of the tag."""
    if checkpoint:
        path = Path(checkpoint).expanduser()
        if path.is_dir():
            found = ckpt.latest_checkpoint(path)
            if found is None:
                raise PPTError(f"no complete checkpoint (step_*.pt) in {path}; pass a checkpoint file")
            path = found
        if not path.is_file():
            raise PPTError(f"checkpoint {path} does not exist; pass an existing step_*.pt file or --model-tag TAG")
        return path, model_tag or path.parent.name
    if not model_tag:
        raise PPTError("say which model to use: --model-tag TAG (a training run's --tag) or --checkpoint PATH")
    directory = cache_dir() / "checkpoints" / model_tag
    path = ckpt.latest_checkpoint(directory)
    if path is None:
        runs = sorted(p.name for p in directory.parent.glob("*") if ckpt.list_checkpoints(p))  # not empty leftovers
        known = f"; runs under {directory.parent}: {', '.join(runs)}" if runs else ""
        raise PPTError(f"no checkpoint for tag {model_tag!r} in {directory}{known}; train it or pass --checkpoint PATH")
    return path, model_tag


def load_run(model_tag: str | None = None, checkpoint: str | Path | None = None) -> LoadedRun:
    path, tag = resolve_checkpoint(model_tag, checkpoint)
    state = ckpt.load_checkpoint(path, map_location="cpu")
    missing = [key for key in ("model", "config") if key not in state]
    if missing:
        raise PPTError(f"{path} is not a ppt training checkpoint (it lacks {', '.join(missing)})")
    return LoadedRun(path, tag, state)


def config_from_dict(saved: dict[str, Any]) -> Any:
    """The config dataclass a checkpoint names, rebuilt with its saved fields."""
    classes = {type(config).__name__: type(config) for config in CONFIGS.values()}
    name = saved.get("class")
    if name not in classes:
        raise PPTError(
            f"the checkpoint's architecture config {name!r} is not in ppt/model.py (it defines "
            f"{', '.join(sorted(classes))}); evaluate it with the model.py it was trained with"
        )
    fields = {f.name for f in dataclasses.fields(classes[name])}
    extra = sorted(set(saved) - fields - {"class"})
    if extra:
        raise PPTError(
            f"the checkpoint's {name} has fields {', '.join(extra)} that ppt/model.py's {name} lacks; "
            "evaluate it with the model.py it was trained with"
        )
    return classes[name](**{k: v for k, v in saved.items() if k != "class"})


def build_from_checkpoint(run: LoadedRun, device: torch.device | str = "cpu") -> nn.Module:
    """Build on meta, materialize on `device`, init (non-persistent buffers), then load the checkpoint's weights."""
    config = config_from_dict(run.config)
    with torch.device("meta"):
        model = build_model(config)
    model.to_empty(device=device)
    model.init_weights()
    try:
        model.load_state_dict(run.state["model"])
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0:3]
        raise PPTError(
            f"checkpoint {run.path} does not fit the {type(model).__name__} that ppt/model.py builds for its config "
            f"({' '.join(first)[:300]}); it is of another architecture: use the model.py it was trained with"
        ) from exc
    return model.eval()


def load_tokenizer_for(run: LoadedRun, data_dir: str | Path | None = None) -> tuple[Tokenizer, Path]:
    """The tokenizer of `data_dir` (default: the data dir the run's manifest records, else the default one if it
    exists), checked against the fingerprint the checkpoint was trained with."""
    recorded = run.manifest().get("data", {}).get("dir")
    if not data_dir and recorded and not (Path(recorded) / "meta.json").is_file():
        raise PPTError(
            f"{run.path} was trained on {recorded} (its run manifest says), which holds no prepared data now; "
            "pass --data-dir with that data"
        )
    if not (data_dir or recorded or (default_data_dir() / "meta.json").is_file()):
        raise PPTError(
            f"the run manifest of {run.path} is missing, so the data it was trained on is unknown; pass --data-dir "
            "with the prepared data directory it was trained on"
        )
    directory = Path(data_dir or recorded or default_data_dir()).expanduser()
    tokenizer = load_data_tokenizer(directory)
    expected = run.state.get("tokenizer_fingerprint")
    if expected and expected != tokenizer.fingerprint:
        raise PPTError(
            f"{run.path} was trained with tokenizer {expected[:16]}, but {directory} holds {tokenizer.name} "
            f"({tokenizer.fingerprint[:16]}); pass --data-dir with the data the model was trained on"
        )
    return tokenizer, directory
