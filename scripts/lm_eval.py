"""lm-eval's own command line, with ppt checkpoints registered as `--model ppt`: every lm-eval flag works.

    python -m scripts.lm_eval --model ppt --model_args model_tag=smollm-360m --tasks hellaswag --batch_size 16
    python -m scripts.lm_eval --model ppt --model_args checkpoint=PATH,dtype=bf16 --tasks arc_easy --num_fewshot 25
    python -m scripts.lm_eval --model ppt --model_args hf_dir=PATH --tasks piqa   # a public Hugging Face Llama
    python -m scripts.lm_eval ls tasks

model_args: `checkpoint` (a step_*.pt file or a folder of them), `model_tag` (a training run's --tag) or `hf_dir` (a
Hugging Face folder that ppt/model.py imports: the same model code scores it), and optionally `data_dir` (where the
run's tokenizer is; default the run's data dir, or the folder's own tokenizer.json), `dtype` (bf16|fp16|fp32;
default autodetected) and `max_length`. lm-eval 0.4.x finds models only in its registry, which this script fills before
handing over; the plain `lm_eval` command does not know `ppt`. One process: for several GPUs, run
`torchrun ... -m scripts.base_eval`, whose adapter splits the requests over ranks.
"""

from __future__ import annotations

import re
import sys
from typing import Any

import torch

import ppt.model
from ppt.common import (
    ArgumentParser,
    PPTError,
    autodetect_device,
    autodetect_dtype,
    nonneg_int,
    run_cli,
    task_limit,
    warn0,
)
from ppt.model_io import ModelFile, context_prefix, load_run, load_tokenizer_for

try:  # the eval extra: say how to install it rather than show a traceback
    from lm_eval.api.registry import register_model

    from ppt.evals import PPTLM, hub_errors
except (ImportError, PPTError):
    print("error: lm-eval is not installed: uv sync --extra eval", file=sys.stderr)
    sys.exit(2)

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
DTYPES |= {"fp32": torch.float32, "float32": torch.float32}
DEFAULT_BATCH_SIZE = 16
HUB_HINT = "check the network and HF_HUB_OFFLINE, or pass --include_path DIR with task YAMLs over local files"
# ppt.model_io's messages name base_eval's flags; here the same settings are keys of --model_args: {flag: value}
MODEL_ARGS = {"model-tag": "TAG", "checkpoint": "PATH", "hf-dir": "DIR", "data-dir": "DIR"}
FLAG = re.compile(rf"--({'|'.join(MODEL_ARGS)})\b( [A-Z]+)?")  # the flag and its placeholder, if any


def in_model_args(message: str) -> str:
    """A message that names base_eval's flags (--model-tag TAG), with the --model_args keys this script takes."""
    return FLAG.sub(lambda m: f"--model_args {m.group(1).replace('-', '_')}={MODEL_ARGS[m.group(1)]}", message)


def parse_batch_size(value: Any) -> int:
    """lm-eval passes --batch_size as given: a number, or "auto", which ppt treats as the default."""
    if value is None or str(value).startswith("auto"):
        return DEFAULT_BATCH_SIZE
    try:
        return int(value)
    except ValueError as exc:
        raise PPTError(f"--batch_size {value!r} is not a number; pass e.g. --batch_size 16") from exc


@register_model("ppt")
class CheckpointLM(PPTLM):
    """`--model ppt`: the adapter over a model rebuilt from a ppt checkpoint or imported from a Hugging Face folder."""

    def __init__(
        self,
        checkpoint: str | None = None,
        model_tag: str | None = None,
        hf_dir: str | None = None,
        data_dir: str | None = None,
        device: str | None = None,
        dtype: str | None = None,
        batch_size: int | str | None = None,
        max_length: int | None = None,
        **unused: Any,  # lm-eval's max_batch_size and the like
    ) -> None:
        model_file = ModelFile.of(ppt.model)
        try:
            run = load_run(model_tag, checkpoint, hf_dir, model_file)
            tokenizer, _ = load_tokenizer_for(run, data_dir)
        except PPTError as exc:
            raise PPTError(in_model_args(str(exc))) from exc
        target = torch.device(device) if device else autodetect_device()
        if target.type == "cuda" and not torch.cuda.is_available():  # lm-eval's default device is cuda:0
            warn0(f"device {device} is unavailable here; using {autodetect_device()}")
            target = autodetect_device()
        if dtype is not None and str(dtype) not in DTYPES:
            raise PPTError(f"dtype={dtype} is not one of {', '.join(DTYPES)}")
        model = model_file.build_from_checkpoint(run, target)
        precision = DTYPES[str(dtype)] if dtype else autodetect_dtype(target)
        max_length = int(max_length) if max_length else None
        prefix = context_prefix(run, tokenizer)  # EOT; an imported folder: its own tokenizer's BOS, or none
        super().__init__(model, tokenizer, target, precision, parse_batch_size(batch_size), max_length, prefix)


def check_numbers(argv: list[str]) -> None:
    """lm-eval's --limit and --num_fewshot take any float and int (NaN, inf, -1) and fail later, or not at all: a bad
    value stops here with one error line, as base_eval's flags do."""
    parser = ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--limit", "-L", type=task_limit)
    parser.add_argument("--num_fewshot", "-f", type=nonneg_int)
    parser.parse_known_args(argv)


def main() -> None:
    from lm_eval.__main__ import cli_evaluate

    check_numbers(sys.argv[1:])
    with hub_errors("data lm-eval needs", HUB_HINT):
        cli_evaluate()


if __name__ == "__main__":
    run_cli(main)
