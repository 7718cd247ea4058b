"""Export a vanilla Llama checkpoint as a Hugging Face `LlamaForCausalLM` folder, to publish it or use other tools.

    python -m scripts.export_hf --model-tag smollm-360m --out exports/smollm-360m
    python -m scripts.export_hf --checkpoint path/to/step_00038147.pt --out DIR --dtype bf16

The folder holds model.safetensors, config.json, tokenizer.json and a minimal tokenizer_config.json; --force replaces
an earlier export, never a folder that holds anything else. The tokenizer prepends EOT (`<|endoftext|>`, also BOS
and EOS) to every text, as ppt's training and lm-eval adapter do, so `AutoTokenizer` + `AutoModelForCausalLM` score
exactly what ppt scores. The architecture says how it maps onto a transformers class (`hf_mapping()` in ppt/model.py:
the vanilla Llama has one); one without it is refused.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import processors

import ppt.model
from ppt.common import ArgumentParser, PPTError, few, run_cli
from ppt.model_io import ModelFile, hf_mapping, load_run, load_tokenizer_for
from ppt.tokenizer import EOT_TOKEN, Tokenizer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
EXPORT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")  # what export writes


def hf_state_dict(
    state: dict[str, torch.Tensor], names: dict[str, str], dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """The checkpoint's weights under their Hugging Face names (`names`: the model's hf_mapping())."""
    if set(state) != set(names):
        strays, absent = sorted(set(state) - set(names)), sorted(set(names) - set(state))
        raise PPTError(
            f"the checkpoint's weights are not those ppt/model.py's hf_mapping() names (not named: {strays[:3]}, "
            f"not in the checkpoint: {absent[:3]}); it is of another architecture: export with its model.py"
        )
    return {names[name]: tensor.detach().to("cpu", dtype).contiguous() for name, tensor in state.items()}


def model_mapping(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The Hugging Face mapping of the model a checkpoint's config builds; refuses an architecture without one."""
    model_file = ModelFile.of(ppt.model)
    return hf_mapping(model_file.build_on_meta(model_file.config_from_dict(config)))


def write_tokenizer(tokenizer: Tokenizer, directory: Path, max_length: int) -> None:
    """tokenizer.json that prepends EOT to every text (as BOS), and the tokenizer_config.json naming it."""
    backend = BackendTokenizer.from_str(tokenizer.backend.to_str())
    backend.post_processor = processors.TemplateProcessing(
        single=f"{EOT_TOKEN} $A",
        pair=f"{EOT_TOKEN} $A {EOT_TOKEN} $B:1",
        special_tokens=[(EOT_TOKEN, tokenizer.eot_id)],
    )
    backend.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOT_TOKEN,
        "eos_token": EOT_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def export_model(
    state: dict[str, torch.Tensor],
    config: dict[str, Any],
    tokenizer: Tokenizer,
    out_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    overwrite: bool = False,
) -> Path:
    """Write the folder atomically: built in a temporary sibling, then renamed into place."""
    try:
        from safetensors import SafetensorError
        from safetensors.torch import save_file
    except ImportError as exc:
        raise PPTError("safetensors is not installed: uv sync --extra eval") from exc
    architecture, names = model_mapping(config)
    if config["vocab_size"] != tokenizer.vocab_size:
        raise PPTError(
            f"the model's vocab_size {config['vocab_size']} differs from the tokenizer's "
            f"{tokenizer.vocab_size}; export with the tokenizer the model was trained with"
        )
    out_dir = Path(out_dir)
    check_out_dir(out_dir, overwrite)
    weights = hf_state_dict(state, names, dtype)
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    except OSError as exc:  # a file where a parent folder should be, a read-only folder
        raise PPTError(f"cannot write into {out_dir.parent} ({exc.strerror or exc}); pass another --out") from exc
    try:
        save_file(weights, str(staging / "model.safetensors"), metadata={"format": "pt"})
        hf = dict(architecture, bos_token_id=tokenizer.eot_id, eos_token_id=tokenizer.eot_id)
        hf["torch_dtype"] = str(dtype).removeprefix("torch.")
        (staging / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        write_tokenizer(tokenizer, staging, config["max_seq_len"])
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(staging, out_dir)
    except (OSError, SafetensorError) as exc:  # a full disk (safetensors says so in a SafetensorError)
        raise PPTError(
            f"could not write the export into {out_dir.parent} ({getattr(exc, 'strerror', None) or exc}); free disk "
            "space, or pass another --out"
        ) from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def check_out_dir(out_dir: Path, overwrite: bool) -> None:
    """Refuse a file, a folder holding anything but an earlier export (--force deletes the folder: it must not reach
    someone's data), or an earlier export without `overwrite`."""
    if out_dir.exists() and not out_dir.is_dir():
        raise PPTError(f"--out {out_dir} is a file, not a folder; pass the path of a folder to write the export into")
    present = sorted(p.name for p in out_dir.iterdir()) if out_dir.exists() else []
    if not present:
        return
    strays = [name for name in present if name not in EXPORT_FILES]
    if strays or not {"config.json", "model.safetensors"} <= set(present):
        raise PPTError(
            f"{out_dir} is not an earlier export (it holds {few(strays or present)}); --force replaces only a folder "
            f"of {', '.join(EXPORT_FILES)}: pass another --out"
        )
    if not overwrite:
        raise PPTError(
            f"{out_dir} exists and is not empty (an earlier export); pass --force to replace it, or another --out"
        )


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-tag", help="a training run's --tag: its latest checkpoint is exported")
    p.add_argument("--checkpoint", type=Path, help="a step_*.pt file (or a folder of them) instead of --model-tag")
    p.add_argument("--data-dir", type=Path, help="where the run's tokenizer.json is (default: the run's data dir)")
    p.add_argument("--out", type=Path, required=True, help="the folder to write")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="weight precision (default fp32)")
    p.add_argument("--force", action="store_true", help="replace --out if it holds an earlier export")
    args = p.parse_args(argv)
    run = load_run(args.model_tag, args.checkpoint)
    model_mapping(run.config)  # an architecture without one is refused before looking for a tokenizer
    tokenizer, _ = load_tokenizer_for(run, args.data_dir)
    out = export_model(run.state["model"], run.config, tokenizer, args.out, DTYPES[args.dtype], args.force)
    print(f"exported {run.path} (step {run.state.get('step')}) to {out}")
    print(f"load it with transformers: AutoModelForCausalLM.from_pretrained({str(out)!r})")


if __name__ == "__main__":
    run_cli(main)
