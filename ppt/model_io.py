"""Find a run's checkpoint, rebuild its model from ppt/model.py, and load the tokenizer it was trained with.

Shared by base_eval, lm_eval, export_hf and bench.check_hf_import. Fixed code never imports ppt/model.py: the entry
point hands over what it needs as a `ModelFile.of(ppt.model)`. A checkpoint stores `config = {"class": <config
class>, **fields}`; a class not in CONFIGS, or weights that do not fit the model it builds, stop loading with a message
naming the other architecture. A Hugging Face folder (config.json + safetensors) loads as a run too, through the model
file's `config_from_hf` and the model's `hf_mapping()`, so a public checkpoint is scored by the same code as a run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from ppt import checkpoint as ckpt
from ppt.common import PPTError, cache_dir, few
from ppt.flops import NO_FORMULAS, OpFormulas
from ppt.run import RunRecord
from ppt.shards import default_data_dir, load_data_tokenizer
from ppt.tokenizer import Tokenizer, load_tokenizer

# A model may have more rows than its tokenizer has tokens (padded to a multiple of 64 or 128), never fewer
VOCAB_PADDING = 128


@dataclass(frozen=True)
class ModelFile:
    """What fixed code uses of ppt/model.py (SPEC.md, the model contract), handed over by an entry point."""

    configs: Mapping[str, Any]  # CONFIGS: a checkpoint's config class must be the class of one of them
    build_model: Callable[[Any], nn.Module]
    config_from_hf: Callable[[dict[str, Any]], Any] | None = None  # optional: Hugging Face import
    op_formulas: OpFormulas = NO_FORMULAS  # optional (OP_FORMULAS): none where the model calls no custom op

    @classmethod
    def of(cls, module: ModuleType) -> ModelFile:
        optional = getattr(module, "config_from_hf", None), getattr(module, "OP_FORMULAS", NO_FORMULAS)
        return cls(module.CONFIGS, module.build_model, *optional)

    def config_from_dict(self, saved: dict[str, Any]) -> Any:
        """The config dataclass a checkpoint names, rebuilt with its saved fields."""
        classes = {type(config).__name__: type(config) for config in self.configs.values()}
        name = saved.get("class")
        if name not in classes:
            raise PPTError(
                f"the checkpoint's architecture config {name!r} is not in ppt/model.py (it defines "
                f"{', '.join(sorted(classes))}); evaluate it with the model.py it was trained with"
            )
        fields = {f.name for f in dataclasses.fields(classes[name])}
        if extra := sorted(set(saved) - fields - {"class"}):
            raise PPTError(
                f"the checkpoint's {name} has fields {', '.join(extra)} that ppt/model.py's {name} lacks; "
                "evaluate it with the model.py it was trained with"
            )
        return classes[name](**{k: v for k, v in saved.items() if k != "class"})

    def build_on_meta(self, config: Any) -> nn.Module:
        """The model ppt/model.py builds for a config, on the meta device: shapes and names, no memory."""
        with torch.device("meta"):
            return self.build_model(config)

    def build_from_checkpoint(self, run: LoadedRun, device: torch.device | str = "cpu") -> nn.Module:
        """Build on meta, materialize on `device`, init (non-persistent buffers), then load the checkpoint's weights."""
        model = self.build_on_meta(self.config_from_dict(run.config))
        model.to_empty(device=device)
        model.init_weights()
        try:
            model.load_state_dict(run.state["model"])
        except RuntimeError as exc:
            first = str(exc).strip().splitlines()[0:3]
            raise PPTError(
                f"checkpoint {run.path} does not fit the {type(model).__name__} that ppt/model.py builds for its "
                f"config ({' '.join(first)[:300]}); it is of another architecture: use the model.py it was trained with"
            ) from exc
        return model.eval()


@dataclass
class LoadedRun:
    """A checkpoint (or a Hugging Face folder) loaded."""

    path: Path
    tag: str
    state: dict[str, Any]  # the checkpoint dict: model, config, step, tokens, tokenizer_fingerprint, ...
    hf_dir: Path | None = None  # the Hugging Face folder the weights came from; None for a ppt checkpoint

    @property
    def config(self) -> dict[str, Any]:
        return self.state["config"]

    @property
    def manifest_paths(self) -> list[Path]:
        """The run manifest in the reports dir and its copy beside the checkpoints (not in a Hugging Face folder)."""
        reports = cache_dir() / "reports" / f"{self.tag}.json"
        return [reports] if self.hf_dir else [reports, self.path.parent / f"{self.tag}.json"]

    def record(self) -> RunRecord | None:
        """The training run's record (the first of manifest_paths that exists); None without one (Hugging Face)."""
        path = next((p for p in self.manifest_paths if p.is_file()), None)
        return RunRecord.load(path) if path and not self.hf_dir else None


def resolve_checkpoint(model_tag: str | None = None, checkpoint: str | Path | None = None) -> tuple[Path, str]:
    """(checkpoint file, run tag): an explicit path (the tag: the run record beside it, else its folder's name), else
    the latest complete checkpoint of the tag, in the output directory its record names, else in
    <cache>/checkpoints/<tag>."""
    if model_tag and checkpoint:
        raise PPTError(f"--model-tag {model_tag} and --checkpoint {checkpoint} both name a model; pass one of them")
    if checkpoint:
        path = Path(checkpoint).expanduser()
        if path.is_dir():
            if (found := ckpt.latest_checkpoint(path)) is None:
                raise PPTError(f"no complete checkpoint (step_*.pt) in {path}; pass a checkpoint file")
            path = found
        if not path.is_file():
            raise PPTError(f"checkpoint {path} does not exist; pass an existing step_*.pt file or --model-tag TAG")
        records = list(path.parent.glob("*.json"))  # base_train writes <tag>.json beside its checkpoints
        return path, records[0].stem if len(records) == 1 else path.parent.name
    if not model_tag:
        raise PPTError("say which model to use: --model-tag TAG (a training run's --tag) or --checkpoint PATH")
    recorded = recorded_out_dir(model_tag)
    directory = recorded or cache_dir() / "checkpoints" / model_tag
    path = ckpt.latest_checkpoint(directory)
    if path is None and recorded:
        raise PPTError(
            f"no checkpoint for tag {model_tag!r} in {directory}, where its record "
            f"{cache_dir() / 'reports' / f'{model_tag}.json'} says they are; pass --checkpoint PATH"
        )
    if path is None:
        runs = sorted(p.name for p in directory.parent.glob("*") if ckpt.list_checkpoints(p))  # not empty leftovers
        known = f"; runs under {directory.parent}: {', '.join(runs)}" if runs else ""
        raise PPTError(f"no checkpoint for tag {model_tag!r} in {directory}{known}; train it or pass --checkpoint PATH")
    return path, model_tag


def recorded_out_dir(tag: str) -> Path | None:
    """The output directory run `tag`'s training record names; None without one (or with base_eval's scores only)."""
    path = cache_dir() / "reports" / f"{tag}.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        data = {"train": None}  # unreadable: RunRecord.load says why
    return Path(RunRecord.load(path).out_dir) if "train" in data else None


def load_run(
    model_tag: str | None = None,
    checkpoint: str | Path | None = None,
    hf_dir: str | Path | None = None,
    model_file: ModelFile | None = None,
) -> LoadedRun:
    """A ppt checkpoint (`checkpoint`, else the latest of `model_tag`), or a Hugging Face folder (`hf_dir`)."""
    if hf_dir:
        if model_tag or checkpoint:
            raise PPTError("a Hugging Face folder names the model on its own: drop --model-tag / --checkpoint")
        return load_hf_folder(hf_dir, model_file)
    path, tag = resolve_checkpoint(model_tag, checkpoint)
    state = ckpt.load_checkpoint(path, map_location="cpu")
    if missing := [key for key in ("model", "config") if key not in state]:
        raise PPTError(f"{path} is not a ppt training checkpoint (it lacks {', '.join(missing)})")
    return LoadedRun(path, tag, state)


def load_tokenizer_for(run: LoadedRun, data_dir: str | Path | None = None) -> tuple[Tokenizer, Path]:
    """The tokenizer of `data_dir` (default: the run's recorded data dir; a Hugging Face folder's own tokenizer.json;
    else the default data dir), checked against the fingerprint the model was trained with."""
    recorded = (record := run.record()) and record.data["dir"]
    if not data_dir and recorded and not (Path(recorded) / "meta.json").is_file():
        raise PPTError(
            f"{run.path} was trained on {recorded} (its run manifest says), which holds no prepared data now; "
            "pass --data-dir with that data"
        )
    if not run.hf_dir and not (data_dir or recorded or (default_data_dir() / "meta.json").is_file()):
        raise PPTError(
            f"the run manifest of {run.path} is missing, so the data it was trained on is unknown; pass --data-dir "
            "with the prepared data directory it was trained on"
        )
    if run.hf_dir and not (data_dir or recorded):
        tokenizer, directory = hf_tokenizer(run.hf_dir), run.hf_dir
        if tokenizer is None:
            raise PPTError(f"{run.hf_dir} holds no tokenizer.json; pass data_dir=DIR of data prepared for the model")
    else:
        directory = Path(data_dir or recorded or default_data_dir()).expanduser()
        tokenizer = load_data_tokenizer(directory)
        expected = run.state.get("tokenizer_fingerprint")
        actual = encoding_fingerprint(tokenizer) if run.hf_dir else tokenizer.fingerprint
        if expected and expected != actual:
            raise PPTError(
                f"{run.path} {'comes' if run.hf_dir else 'was trained'} with tokenizer {expected[:16]}, but "
                f"{directory} holds {tokenizer.name} ({actual[:16]}); pass --data-dir with data prepared by the "
                "model's tokenizer"
            )
    if not 0 <= run.config["vocab_size"] - tokenizer.vocab_size < VOCAB_PADDING:
        raise PPTError(
            f"{directory}'s tokenizer has {tokenizer.vocab_size:,} tokens, the model {run.config['vocab_size']:,} "
            "(vocab_size): they are not of one vocabulary; use the tokenizer the model was trained with (--data-dir "
            "with data it prepared)"
        )
    return tokenizer, directory


# ---------------------------------------------------------------------------------------------------------------------
# Hugging Face folders


def hf_mapping(model: nn.Module) -> tuple[dict[str, Any], dict[str, str]]:
    """The model's own Hugging Face correspondence, `model.hf_mapping()` in ppt/model.py: (config.json fields,
    {ppt weight name: Hugging Face weight name}), checked to name every weight once."""
    if not hasattr(model, "hf_mapping"):
        raise PPTError(
            f"no Hugging Face export or import for this architecture: ppt/model.py's {type(model).__name__} has no "
            "hf_mapping() (the vanilla Llama's shows what it returns)"
        )
    config, names = model.hf_mapping()
    weights = set(model.state_dict())
    if set(names) != weights or len(set(names.values())) != len(names):
        unnamed, unknown = sorted(weights - set(names)), sorted(set(names) - weights)
        raise PPTError(
            f"ppt/model.py's {type(model).__name__}.hf_mapping() does not name each weight once (unnamed: "
            f"{unnamed[:3]}, not weights: {unknown[:3]}, or two weights under one name); fix it there"
        )
    return config, names


def hf_tokenizer(hf_dir: Path) -> Tokenizer | None:
    """The folder's tokenizer.json, if it has one."""
    path = hf_dir / "tokenizer.json"
    return load_tokenizer(path) if path.is_file() else None


def encoding_fingerprint(tokenizer: Tokenizer) -> str:
    """sha256 of the tokenizer JSON without its post-processor (the BOS/EOS template transformers applies; ppt adds
    EOT itself), by which a Hugging Face folder's tokenizer and a data dir's are compared."""
    spec = json.loads(tokenizer.backend.to_str())
    spec.pop("post_processor", None)
    return hashlib.sha256(json.dumps(spec, sort_keys=True, separators=(",", ":")).encode("utf-8")).hexdigest()


def context_prefix(run: LoadedRun, tokenizer: Tokenizer) -> list[int]:
    """The tokens every benchmark context starts with: EOT for a ppt-trained run; for a Hugging Face folder, what its
    own tokenizer puts before a text (its BOS, or nothing), as lm-eval's HFLM scores the folder."""
    if not run.hf_dir:
        return [tokenizer.eot_id]
    from transformers import AutoTokenizer  # the eval extra, which benchmarks need

    try:
        own = AutoTokenizer.from_pretrained(run.hf_dir)
    except (OSError, ValueError) as exc:
        raise PPTError(
            f"{run.hf_dir} holds no tokenizer transformers can load ({str(exc).splitlines()[0][:200]}); benchmarks "
            "score an imported model with its own tokenizer's BOS convention: add its tokenizer files to the folder"
        ) from exc
    text, ids = own.encode("a", add_special_tokens=False), own.encode("a")
    return ids[: next((i for i in range(len(ids)) if ids[i : i + len(text)] == text), 0)]


def read_safetensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of model.safetensors, or of the shards model.safetensors.index.json lists."""
    try:
        from safetensors import SafetensorError
        from safetensors.torch import load_file
    except ImportError as exc:
        raise PPTError("safetensors is not installed: uv sync --extra eval") from exc
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (hf_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise PPTError(
            f"{hf_dir} holds no model.safetensors (nor model.safetensors.index.json); ppt reads safetensors only: "
            "save the model with transformers' save_pretrained(DIR, safe_serialization=True)"
        )
    tensors = {}
    for name in files:
        try:
            tensors.update(load_file(hf_dir / name))
        except (OSError, SafetensorError) as exc:
            raise PPTError(f"cannot read {hf_dir / name} ({exc}); the folder is incomplete or corrupt") from exc
    return tensors


def load_hf_folder(hf_dir: str | Path, model_file: ModelFile) -> LoadedRun:
    """A Hugging Face model folder as a run: config.json through ppt/model.py's `config_from_hf`, the weights
    renamed by the model's `hf_mapping()` and kept in their stored dtype (loading into the model casts them)."""
    directory = Path(hf_dir).expanduser()
    config_path = directory / "config.json"
    if not directory.is_dir():
        raise PPTError(
            f"{directory} {'is not a folder' if directory.exists() else 'does not exist'}; pass a Hugging Face model "
            "folder (what save_pretrained writes)"
        )
    if not config_path.is_file():
        raise PPTError(
            f"{directory} holds no config.json; pass a Hugging Face model folder (what save_pretrained writes)"
        )
    try:
        hf_config = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise PPTError(f"{config_path} is not valid JSON ({exc}); the folder is incomplete or corrupt") from exc
    if model_file.config_from_hf is None:
        raise PPTError("ppt/model.py has no config_from_hf(): it imports no Hugging Face models")
    config = model_file.config_from_hf(hf_config)
    model = model_file.build_on_meta(config)
    _, names = hf_mapping(model)
    tensors = read_safetensors(directory)
    missing = [theirs for theirs in names.values() if theirs not in tensors]
    # a tied weight the file also stores under its other name (transformers loads such files): an equal copy is dropped
    kept = [tensors[theirs] for theirs in names.values() if theirs in tensors]
    unexpected = sorted(
        name for name in set(tensors) - set(names.values()) if not any(_same(tensors[name], t) for t in kept)
    )
    if missing or unexpected:
        problems = [f"it lacks {few(missing)}"] if missing else []
        problems += [f"{few(unexpected)} fit nowhere in it, and equal no weight that does"] if unexpected else []
        raise PPTError(
            f"{directory}'s weights do not fit the {type(model).__name__} its config.json describes: "
            f"{'; '.join(problems)}; the weights and config.json do not belong together"
        )
    expected = model.state_dict()
    for ours, theirs in names.items():
        if tensors[theirs].shape != expected[ours].shape:
            raise PPTError(
                f"{directory}: {theirs} has shape {tuple(tensors[theirs].shape)}, but its config.json makes it "
                f"{tuple(expected[ours].shape)}; the weights and config.json do not belong together"
            )
    tokenizer = hf_tokenizer(directory)
    state = {
        "model": {ours: tensors[theirs] for ours, theirs in names.items()},
        "config": {"class": type(config).__name__, **dataclasses.asdict(config)},
        "tokenizer_fingerprint": encoding_fingerprint(tokenizer) if tokenizer else None,
    }
    # the folder's name, made unique by its path: two folders of one name keep their results apart
    tag = f"hf-{directory.name}-{hashlib.sha256(str(directory.resolve()).encode()).hexdigest()[:8]}"
    return LoadedRun(directory, tag, state, hf_dir=directory)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
