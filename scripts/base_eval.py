"""Evaluate a trained checkpoint: val NLL and bits-per-byte, then lm-eval benchmarks; results go into the run manifest.

    bash scripts/eval.sh --model-tag smollm-360m                          # bpb + the ppt protocol
    python -m scripts.base_eval --model-tag smollm-360m --protocol mor    # the MoR paper's shots
    python -m scripts.base_eval --checkpoint PATH --tasks hellaswag,arc_easy:25 --limit 100
    python -m scripts.base_eval --model-tag cpu-tiny --data-dir DIR --demo-task   # offline: a local task
    python -m scripts.base_eval --hf-dir PATH --data-dir DIR     # a public Hugging Face Llama (e.g. SmolLM2)
    torchrun --nproc_per_node=8 -m scripts.base_eval --model-tag smollm-360m     # requests split over GPUs

The ppt protocol: LAMBADA, HellaSwag, PIQA 0-shot; WinoGrande 5-shot; ARC-Easy/Challenge 25-shot (ARC = their
mean); MMLU 5-shot. The mor protocol: all 0-shot except MMLU 5-shot. The table and the manifest say which ran.
`--demo-task` builds a multiple-choice task from the val split (40 words of a passage, the true next 10 words
against 3 taken from other passages) and runs it through lm-eval offline.

Bits per byte scores the first `--eval-tokens` val tokens; by default as many as the training run scored at its end
(its manifest says), so the two figures agree, else base_train's default. The table gives the count beside the bpb.
`--hf-dir` scores a Hugging Face folder (config.json + safetensors) that ppt/model.py can import, with this same
code, its benchmark contexts starting as its own tokenizer starts a text (a ppt run's start with EOT); its results go
to the reports dir as run `hf-<folder name>-<hash of its path>`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

import ppt.model
from ppt.common import (
    COMPILE_CHOICES,
    ArgumentParser,
    PPTError,
    atomic_file,
    init_runtime,
    maybe_compile,
    nonneg_int,
    positive_int,
    print0,
    run_cli,
    shutdown_runtime,
    task_limit,
    token_count,
    warn0,
)
from ppt.data import DataLoader
from ppt.loss_eval import DEFAULT_EVAL_TOKENS, evaluate_bpb
from ppt.model_io import LoadedRun, ModelFile, context_prefix, load_run, load_tokenizer_for
from ppt.run import RunRecord
from ppt.shards import list_shards, read_shard
from ppt.tokenizer import Tokenizer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--model-tag", help="a training run's --tag: the latest checkpoint in its record's out_dir")
    g.add_argument("--checkpoint", type=Path, help="a step_*.pt file (or a folder of them) instead of --model-tag")
    g.add_argument("--hf-dir", type=Path, help="a Hugging Face folder (config.json + safetensors); needs --data-dir")
    g.add_argument("--device", help="override the device (cpu, cuda, mps)")
    g.add_argument("--batch-size", type=positive_int, default=8, help="rows per forward, bpb and lm-eval (default 8)")
    g.add_argument("--compile", choices=COMPILE_CHOICES, default="auto", help="compile the bpb pass (auto: on CUDA)")
    g = p.add_argument_group("bits per byte")
    g.add_argument("--data-dir", type=Path, help="prepared shards (default: the run's data dir, else the default)")
    g.add_argument("--eval-tokens", type=token_count, help="val tokens to score (default: as many as the run scored)")
    g.add_argument("--seq-len", type=positive_int, help="tokens per row (default: the run's training seq len)")
    g = p.add_argument_group("benchmarks (lm-eval)")
    g.add_argument("--protocol", choices=["ppt", "mor"], default="ppt", help="task preset and shots (default ppt)")
    g.add_argument("--tasks", help="lm-eval tasks instead of the preset, comma-separated; NAME:SHOTS sets shots")
    g.add_argument("--num-fewshot", type=nonneg_int, default=0, help="shots for --tasks entries without :SHOTS")
    g.add_argument("--limit", type=task_limit, help="examples per task (a fraction below 1): for quick checks only")
    g.add_argument("--include-path", type=Path, action="append", default=[], help="a folder of local task YAMLs")
    g.add_argument("--skip-tasks", action="store_true", help="bits per byte only")
    g.add_argument("--demo-task", action="store_true", help="run only a local task built from the val split")
    g = p.add_argument_group("wandb")
    g.add_argument("--no-wandb", action="store_true", help="do not log the scores to the wandb run the record names")
    return p.parse_args(argv)


def resolve_eval_tokens(args: argparse.Namespace, record: RunRecord | None) -> tuple[int, str]:
    """(val token budget, where it comes from): --eval-tokens, else what the training run scored, else the default."""
    if args.eval_tokens:
        return args.eval_tokens, "--eval-tokens"
    if record:
        return record.train.eval_tokens, "the training run's --eval-tokens, from its record"
    return DEFAULT_EVAL_TOKENS, "the default, base_train's too"


def val_documents(data_dir: Path, tokenizer: Tokenizer) -> list[str]:
    """The val split's documents as text (the tokens between EOTs)."""
    _, tokens = read_shard(list_shards(data_dir, "val")[0], tokenizer.fingerprint)
    boundaries = [*np.flatnonzero(tokens == tokenizer.eot_id).tolist(), len(tokens)]
    return [tokenizer.decode(tokens[a + 1 : b].tolist()) for a, b in zip(boundaries, boundaries[1:]) if b > a + 1]


def chosen_tasks(
    args: argparse.Namespace,
    custom_tasks: tuple | None,
    tokenizer: Tokenizer,
    data_dir: Path,
    demo_dir: Path,
    max_seq_len: int,
) -> tuple[tuple, str, Any]:
    """(benchmarks, protocol name, task manager) of the preset, `custom_tasks` (--tasks parsed) and/or the demo task
    (written into demo_dir, which must outlive the run), every name and output type checked."""
    from ppt import evals  # lazily: needs the eval extra, which --skip-tasks does not

    if custom_tasks:
        benchmarks, protocol = custom_tasks, "custom"
    elif args.demo_task:
        benchmarks, protocol = (), "demo"
    else:
        benchmarks, protocol = evals.protocol(args.protocol), args.protocol
    include = list(args.include_path)
    if args.demo_task:
        fits = lambda choice: len(tokenizer.backend.encode(" " + choice, add_special_tokens=False).ids) <= max_seq_len
        examples = evals.demo_examples(val_documents(data_dir, tokenizer), fits=fits)
        evals.write_choice_task(examples, demo_dir, evals.DEMO_TASK)
        include.append(demo_dir)
        benchmarks += (evals.Benchmark("demo continuation (4-way)", (evals.DEMO_TASK,), 0, "acc"),)
    # lm-eval's built-in index takes seconds to build: skip it when only the local demo task runs
    manager = evals.task_manager(include, include_defaults=protocol != "demo")
    evals.check_tasks(manager, benchmarks)
    return benchmarks, protocol, manager


def table(bpb: dict[str, float], bench: dict[str, Any] | None) -> str:
    """Markdown: metric | value, the way the README reports a run."""
    lines = [
        "| metric | value |",
        "|---|---|",
        f"| val NLL (nats/token) ↓ | {bpb['nll']:.4f} |",
        f"| val bits per byte ↓ ({bpb['tokens']:,} tokens) | {bpb['bpb']:.4f} |",
    ]
    if bench:
        for label, score in bench["rows"].items():
            lines.append(f"| {label} ({bench['shots'][label]}-shot, {bench['metrics'][label]}) | {score:.1f} |")
        if len(bench["rows"]) > 1:
            lines.append(f"| Avg | {bench['avg']:.1f} |")
    return "\n".join(lines)


def save_evaluation(run: LoadedRun, evaluation: dict[str, Any]) -> list[Path]:
    """Put `evaluation` into the run's records (`eval`, merged when the same checkpoint was evaluated before), each
    written atomically; a model without a training record gets a file of its own in the reports dir."""
    existing = [path for path in run.manifest_paths if path.is_file() and not run.hf_dir]
    for path in existing:
        record = RunRecord.load(path)
        same = (record.eval or {}).get("checkpoint") == evaluation["checkpoint"]
        record.eval = {**record.eval, **evaluation} if same else evaluation
        record.write([path])
    if existing:
        return existing
    path = run.manifest_paths[0]
    try:
        with atomic_file(path) as f:
            f.write(json.dumps({"run": run.tag, "eval": evaluation}, indent=1, default=str).encode("utf-8"))
    except OSError as exc:
        raise PPTError(f"could not write the results into {path} ({exc.strerror or exc}); free disk space") from exc
    return [path]


def log_to_wandb(record: RunRecord | None, evaluation: dict[str, Any]) -> str | None:
    """Log the scores to the training run's wandb run (its record's `wandb`): its id, or None (none, or no wandb)."""
    recorded = (record and record.wandb) or {}
    if not recorded.get("id"):
        return None
    try:
        import wandb
    except ImportError:
        print0(f"note: wandb is not installed; scores not logged to wandb run {recorded['id']}")
        return None
    scores = {"eval/val_nll": evaluation["val"]["nll"], "eval/val_bpb": evaluation["val"]["bpb"]}
    bench = evaluation.get("benchmarks") or {"rows": {}}
    scores |= {f"eval/{label}": score for label, score in bench["rows"].items()}
    if len(bench["rows"]) > 1:
        scores["eval/avg"] = bench["avg"]
    run = wandb.init(project=recorded.get("project", "ppt"), id=recorded["id"], resume="allow")
    # at the checkpoint's step (an offline run starts again at 0), or where the resumed online run stands
    step = max(evaluation["step"] or 0, run.step)
    run.log({**scores, "eval/step": evaluation["step"], "eval/tokens": evaluation["tokens"]}, step=step)
    run.finish()
    return recorded["id"]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.skip_tasks and (args.demo_task or args.tasks):
        raise PPTError("--skip-tasks runs bits per byte only; drop it to run --tasks or --demo-task")
    if args.hf_dir and not args.data_dir:
        raise PPTError("--hf-dir needs --data-dir: prepared shards whose val split to score, made by its tokenizer")
    if args.limit and args.limit > 1 and not float(args.limit).is_integer():
        raise PPTError(
            f"--limit {args.limit:g}: above 1 it counts examples per task, a whole number; below 1 it is a fraction"
        )
    custom_tasks = None
    if args.tasks:  # parsed now: a typo in --tasks stops the run before the bits-per-byte pass, not after it
        from ppt import evals

        custom_tasks = evals.parse_tasks(args.tasks, args.num_fewshot)
    rt = init_runtime(args.device)
    model_file = ModelFile.of(ppt.model)
    run = load_run(args.model_tag, args.checkpoint, args.hf_dir, model_file)
    model = model_file.build_from_checkpoint(run, rt.device)
    tokenizer, data_dir = load_tokenizer_for(run, args.data_dir)
    record = run.record()
    max_seq_len = model.config.max_seq_len
    seq_len = args.seq_len or (record and record.train.seq_len) or min(2048, max_seq_len)
    if seq_len > max_seq_len:
        raise PPTError(f"--seq-len {seq_len} exceeds the model's max_seq_len {max_seq_len}; lower --seq-len")
    budget, budget_source = resolve_eval_tokens(args, record)
    origin = "Hugging Face folder" if run.hf_dir else f"step {run.state.get('step')}"
    print0(
        f"{run.path} ({origin}, {type(model).__name__}) on {rt.device} {str(rt.dtype).removeprefix('torch.')}; "
        f"data {data_dir}; bpb over up to {budget:,} val tokens ({budget_source})"
    )

    with tempfile.TemporaryDirectory(prefix="ppt_demo_task_") as demo_dir:
        # found and checked now: an unknown or generative task stops the run before its bits-per-byte pass
        tasks = None
        if not args.skip_tasks:
            tasks = chosen_tasks(args, custom_tasks, tokenizer, data_dir, Path(demo_dir), max_seq_len)
        prefix = None if tasks is None else context_prefix(run, tokenizer)
        started = time.time()
        val = DataLoader(
            data_dir, "val", args.batch_size, seq_len, rt.rank, rt.world_size, 0, rt.device,
            expected_fingerprint=tokenizer.fingerprint, vocab_size=model.config.vocab_size,
        )  # fmt: skip
        if shortfall := val.budget_shortfall(budget):
            warn0(shortfall)
        n_batches = -(-val.val_rows(budget) // args.batch_size)
        quiet = None if rt.is_master else True  # tqdm's None: a bar only on a terminal, never redrawn into a log
        batches = tqdm(val.val_batches(budget), total=n_batches, desc="val bpb", disable=quiet)
        bpb_model = maybe_compile(model, args.compile, rt.device)
        bpb = evaluate_bpb(bpb_model, batches, tokenizer.token_bytes().to(rt.device), rt.dtype)
        bench = None  # the tasks' results, on rank 0
        if tasks is not None:
            from ppt import evals

            benchmarks, protocol, manager = tasks
            lm = evals.PPTLM(model, tokenizer, rt.device, rt.dtype, batch_size=args.batch_size, prefix=prefix)
            limit = int(args.limit) if args.limit and args.limit >= 1 else args.limit
            bench = evals.run_benchmarks(lm, benchmarks, manager, limit=limit)
            if bench is not None:
                bench |= {"protocol": protocol, "context_prefix": prefix}
                bench["shots"] = {b.label: b.num_fewshot for b in benchmarks}

    if rt.is_master:
        print0(table(bpb, bench))
        if bench:
            limit = f", limit {bench['limit']} per task" if bench["limit"] else ""
            print0(f"protocol: {bench['protocol']} (contexts start with tokens {bench['context_prefix']}{limit})")
        evaluation = {
            "checkpoint": str(run.path),
            "step": run.state.get("step"),
            "tokens": run.state.get("tokens"),
            "data_dir": str(data_dir),
            "seq_len": seq_len,
            "eval_tokens": budget,
            "dtype": str(rt.dtype),
            "world_size": rt.world_size,
            "val": bpb,
            "seconds": round(time.time() - started, 1),
            "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        if bench:
            evaluation["benchmarks"] = bench
        for path in save_evaluation(run, evaluation):
            print0(f"report: {path}")
        if not args.no_wandb and (run_id := log_to_wandb(record, evaluation)):
            print0(f"wandb: logged to run {run_id}")
    shutdown_runtime()


if __name__ == "__main__":
    run_cli(main)
