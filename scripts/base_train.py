"""Pretrain a model from ppt/model.py on prepared shards: the fixed training loop, top to bottom.

python -m scripts.base_train --config smollm-135m --target-tokens 1e9
torchrun --nproc_per_node=8 -m scripts.base_train --config smollm-360m --target-tokens 20e9
python -m scripts.base_train --recipe mor                  # the Mixture-of-Recursions Vanilla recipe (SmolLM-360M)
python -m scripts.base_train --from-manifest RUN.json --tag rerun   # relaunch a run from its manifest
python -m scripts.base_train ... --resume auto             # continue a stopped or killed run from its newest checkpoint

A run owns its checkpoint directory and its name (--tag) while it runs: a second run with either stops at once.
One file of ~900 lines on purpose, as nanoGPT's train.py: the loop reads top to bottom, set-up to the last save.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import gc
import json
import math
import os
import shlex
import signal
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ppt import checkpoint as ckpt
from ppt.common import (
    COMPILE_CHOICES,
    MAX_TOKENS,
    ArgumentParser,
    Number,
    PPTError,
    Runtime,
    cache_dir,
    compile_enabled,
    few,
    init_runtime,
    nonneg_float,
    nonneg_int,
    nonneg_token_count,
    positive_float,
    positive_int,
    print0,
    run_cli,
    run_tag,
    shutdown_runtime,
    token_count,
    warn0,
    wrap_ddp,
)
from ppt.comparison_flops import ComparisonFlops, comparison_flops_rule
from ppt.data import DataLoader
from ppt.devices import peak_flops
from ppt.flops import mfu_flops_per_token
from ppt.locks import hold_lock, lock_directory, release_locks
from ppt.loss_eval import DEFAULT_EVAL_TOKENS, autocast, evaluate_bpb
from ppt.model import CONFIGS, DEFAULT_CONFIG, build_model, get_config
from ppt.optim import DEFAULT_LR, build_optimizer, lr_multiplier, set_lr
from ppt.profiling import StepProfiler
from ppt.report import RunReport
from ppt.shards import check_prepared, default_data_dir, load_data_tokenizer

# Published recipes, as their public configurations state them; flags given beside --recipe override single values.
MOR_BATCH_TOKENS = 2_097_152  # 1024 rows of 2048 tokens
RECIPES: dict[str, dict[str, Any]] = {
    "mor": {  # Mixture-of-Recursions, the Vanilla SmolLM-360M baseline
        "config": "smollm-360m",
        "seq_len": 2048,
        "total_batch_tokens": MOR_BATCH_TOKENS,
        "target_tokens": 19.8e9,
        "optimizer": "adamw",
        "lr": 3e-3,
        "weight_decay": 0.1,
        "grad_clip": 1.0,
        "schedule": "wsd",
        "warmup_tokens": 57 * MOR_BATCH_TOKENS,
        "decay_frac": 0.2,
        "no_doc_masks": True,
    },
}
# The comparison-FLOPs rule is traced again every this many steps (learned windows move), on a schedule that does not
# depend on --log-every or on where a run was resumed, so an interrupted run counts what an uninterrupted one does.
RULE_RETRACE_STEPS = 50
# A config field of this name, if the config has one, is set to the training row length (SPEC.md, the model contract).
TRAIN_LENGTH_FIELD = "train_seq_len"
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # torch.compile modes that replay the step from CUDA graphs


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("recipe and relaunch")
    g.add_argument(
        "--recipe",
        choices=sorted(RECIPES),
        help="a published recipe's settings as defaults; other flags override them. mor: "
        + ", ".join(f"{k}={v}" for k, v in RECIPES["mor"].items()),
    )
    g.add_argument(
        "--from-manifest",
        type=Path,
        help="relaunch a run: every setting its manifest recorded (the 'args' key) becomes the default, flags given "
        "beside it override (e.g. --tag NAME to run it again elsewhere, --resume auto to continue it)",
    )
    g = p.add_argument_group("model")
    g.add_argument(
        "--config",
        help=f"a named config: {', '.join(CONFIGS)}, or a name ppt/model.py's get_config resolves (its size dials: "
        f"d12, multiscreen-d16; default {DEFAULT_CONFIG} unless --depth)",
    )
    g.add_argument("--depth", type=positive_int, help="the scaling dial: width and heads derived from depth")
    g = p.add_argument_group("data and batch")
    g.add_argument("--data-dir", type=Path, help="prepared shards (default <cache>/data/fineweb-edu)")
    g.add_argument("--seq-len", type=positive_int, help="tokens per row (default min(2048, the config's max_seq_len))")
    g.add_argument(
        "--total-batch-tokens", type=token_count, help="tokens per optimizer step, all ranks (default 524288)"
    )
    g.add_argument(
        "--device-batch-size", type=positive_int, help="rows per forward on one device; accumulation derived"
    )
    g.add_argument("--target-tokens", type=token_count, help="training budget in tokens (default 20 x parameters)")
    g.add_argument(
        "--target-flops",
        type=positive_float,
        help="training budget in comparison FLOPs instead of tokens: converted once, at the start, into tokens "
        "(the manifest records the conversion; compare reports the FLOPs the run really counted)",
    )
    g = p.add_argument_group("optimization")
    g.add_argument("--optimizer", choices=["adamw", "muon", "aurora"], default="adamw")
    g.add_argument(
        "--lr", type=Number(float, 0, 1e6, above=True), help="peak learning rate (default per optimizer)"
    )  # bounded: past ~3e38 an fp32 optimizer step overflows; far below that no run learns
    g.add_argument("--weight-decay", type=nonneg_float, default=0.1)
    g.add_argument("--schedule", choices=["constant", "cosine", "wsd"], default="wsd")
    g.add_argument(
        "--warmup-tokens", type=nonneg_token_count, help="LR warmup length in tokens (default 1%% of the budget)"
    )
    g.add_argument(
        "--decay-frac", type=Number(float, 0, 1), default=0.2, help="wsd: the last fraction of steps, decayed linearly"
    )
    g.add_argument(
        "--no-doc-masks",
        action="store_true",
        help="train on plain causal rows, ignoring document boundaries (to measure what the masks cost)",
    )
    g.add_argument(
        "--doc-masks", dest="no_doc_masks", action="store_false", help="document masks (the default; undoes a recipe's)"
    )
    g.add_argument("--grad-clip", type=nonneg_float, default=1.0, help="max global grad norm (0 disables)")
    g.add_argument("--skip-nonfinite", type=nonneg_int, default=0, help="skip up to N steps whose loss/grad is NaN/inf")
    g = p.add_argument_group("run")
    g.add_argument("--tag", type=run_tag, help="checkpoint/report name (default: the config name or d<depth>)")
    g.add_argument("--out-dir", type=Path, help="checkpoint dir (default <cache>/checkpoints/<tag>)")
    g.add_argument("--eval-every", type=nonneg_int, default=250, help="steps between val bpb (0: only at the end)")
    g.add_argument(
        "--eval-tokens",
        type=token_count,
        default=DEFAULT_EVAL_TOKENS,
        help=f"val tokens per evaluation (default {DEFAULT_EVAL_TOKENS:,}; base_eval scores as many)",
    )
    g.add_argument("--save-every", type=nonneg_int, default=1000, help="steps between checkpoints (0: only at the end)")
    g.add_argument("--keep", type=nonneg_int, default=3, help="checkpoints to keep (0 keeps all)")
    g.add_argument("--resume", help="'auto' (latest complete checkpoint in --out-dir, if any) or a checkpoint path")
    g.add_argument("--run", help="wandb run name; wandb stays off without it")
    g.add_argument(
        "--seed", type=nonneg_int, default=0, help="sets --data-seed and --model-seed where they are not given"
    )
    g.add_argument(
        "--data-seed",
        type=nonneg_int,
        help="the order of the training rows: at one data seed, sequence length and batch every architecture sees "
        "the same tokens in the same order",
    )
    g.add_argument("--model-seed", type=nonneg_int, help="the initialization of the weights, and nothing else")
    g.add_argument(
        "--compile",
        choices=COMPILE_CHOICES,
        default="auto",
        help="torch.compile the model, and Muon/Aurora's orthogonalizations (auto: on CUDA)",
    )
    g.add_argument(
        "--compile-mode",
        choices=["default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune"],
        default="default",
        help="torch.compile's mode for the training step (reduce-overhead: CUDA graphs)",
    )
    g.add_argument(
        "--loader-prefetch",
        type=nonneg_int,
        default=2,
        help="batches a background thread builds ahead (0: built in the main thread, in next())",
    )
    g.add_argument(
        "--deterministic",
        action="store_true",
        help="deterministic kernels only (slower; an op without one stops the run): identical runs, identical losses",
    )
    g.add_argument("--log-every", type=positive_int, default=1)
    g.add_argument(
        "--max-steps", type=positive_int, help="stop at this step without changing the LR schedule (benchmarks)"
    )
    g.add_argument("--device", help="override the device (cpu, cuda, mps)")
    g.add_argument(
        "--benchmark",
        action="store_true",
        help="measure instead of train for keeps: no checkpoints or evals, a synchronized phase breakdown per step, "
        "a JSON summary at the end (steps after the first 5 count)",
    )
    g.add_argument(
        "--profile",
        action="store_true",
        help="torch.profiler over steps 6-8 of this loop: prints where their time went "
        "(steps 5-9 run slower for it; a --benchmark summary leaves them out)",
    )
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, over the defaults of --from-manifest and then of --recipe (explicit flags win over both)."""
    parser = build_parser()
    given, _ = parser.parse_known_args(argv)  # the flags given, over the parser's own defaults
    defaults = relaunch_defaults(given.from_manifest, parser) if given.from_manifest else {}
    defaults |= RECIPES[given.recipe] if given.recipe else {}
    if given.target_flops is not None:  # a budget given one way replaces a default given the other way
        defaults.pop("target_tokens", None)
    if given.target_tokens is not None:
        defaults.pop("target_flops", None)
    parser.set_defaults(**defaults)
    return parser.parse_args(argv)


# Flags a relaunch does not take from the manifest: how to launch, not what to train
NOT_RELAUNCHED = ("from_manifest", "resume")


def relaunch_defaults(path: Path, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The settings a manifest recorded for a relaunch, as parser defaults."""
    try:
        recorded = json.loads(Path(path).read_text())["args"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise PPTError(
            f"cannot relaunch from {path} ({type(exc).__name__}: {exc}); pass the JSON manifest base_train wrote for "
            "the run (<cache>/reports/<tag>.json or beside its checkpoints)"
        ) from exc
    if not isinstance(recorded, dict):
        raise PPTError(f"{path}'s 'args' is not a mapping of settings; pass the JSON manifest base_train wrote")
    actions = {action.dest: action for action in parser._actions}
    unknown = sorted(set(recorded) - set(actions))
    if unknown:
        warn0(f"{path} records settings this base_train does not have, ignored: {', '.join(unknown)}")
    return {
        k: checked_setting(path, actions[k], v) for k, v in recorded.items() if k in actions and k not in NOT_RELAUNCHED
    }


def checked_setting(path: Path, action: argparse.Action, value: Any) -> Any:
    """A recorded value through its flag's own checks, which parser defaults skip (a hand-edited manifest)."""
    if value is None or isinstance(value, bool):
        return value
    flag = action.option_strings[0] if action.option_strings else action.dest
    try:
        if isinstance(action.type, Number):  # the range only: a derived setting (warmup tokens) need not be whole
            dataclasses.replace(action.type, kind=float, scientific=False)(str(value))
        elif action.type:
            value = action.type(str(value))
    except (argparse.ArgumentTypeError, TypeError, ValueError) as exc:
        raise PPTError(f"{path} records {flag} {value!r}, which {flag} refuses: {exc}; fix it or give {flag}") from exc
    if action.choices is not None and value not in action.choices:
        raise PPTError(f"{path} records {flag} {value!r}, not one of {', '.join(map(str, action.choices))}")
    return value


def saved_batch_tokens(state: dict[str, Any]) -> int | None:
    """The tokens per step a checkpoint trained at: recorded, or (older checkpoints) its tokens over its steps."""
    if "total_batch_tokens" in state:
        return state["total_batch_tokens"]
    steps = state["step"] - state.get("skipped_nonfinite_steps", 0)  # a skipped step trains no tokens
    return state["tokens"] // steps if steps > 0 and state["tokens"] % steps == 0 else None


def main(argv: list[str] | None = None) -> None:
    """Train; the SIGTERM/SIGINT handlers the loop installs and the deterministic setting are put back afterwards
    (main may run in-process)."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    deterministic = torch.are_deterministic_algorithms_enabled()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        train(parse_args(argv), argv)
    finally:
        release_locks()  # the output directory's and the run name's
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        torch.use_deterministic_algorithms(deterministic)


def train(args: argparse.Namespace, argv: list[str]) -> None:
    started = time.perf_counter()
    if args.deterministic:  # before the first cuBLAS call, which reads the workspace setting
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)  # an op with no such kernel raises, naming itself
    if args.target_flops and args.target_tokens:
        raise PPTError("give the budget as --target-tokens or as --target-flops, not both")
    rt = init_runtime(args.device)
    data_seed = args.seed if args.data_seed is None else args.data_seed
    model_seed = args.seed if args.model_seed is None else args.model_seed
    torch.manual_seed(model_seed)  # the weights' initialization; the data order has its own seed

    # ---- model config, tokenizer and data ----------------------------------------------------------------------
    if args.config is None and args.depth is None:
        args.config = DEFAULT_CONFIG
    config = get_config(args.config, args.depth)
    data_dir = args.data_dir or default_data_dir()
    tokenizer = load_data_tokenizer(data_dir)
    if unfinished := check_prepared(data_dir):
        warn0(unfinished)
    if tokenizer.vocab_size != config.vocab_size:
        print0(
            f"note: vocab_size {config.vocab_size} -> {tokenizer.vocab_size} to match {tokenizer.name} in {data_dir}"
        )
        config = dataclasses.replace(config, vocab_size=tokenizer.vocab_size)
    seq_len = args.seq_len or min(2048, config.max_seq_len)
    if seq_len > config.max_seq_len:
        raise PPTError(f"--seq-len {seq_len} exceeds the config's max_seq_len {config.max_seq_len}; lower --seq-len")
    if TRAIN_LENGTH_FIELD in {f.name for f in dataclasses.fields(config)}:  # recorded in every checkpoint (SPEC.md)
        config = dataclasses.replace(config, **{TRAIN_LENGTH_FIELD: seq_len})
    total_batch = args.total_batch_tokens or 524_288
    device_batch = args.device_batch_size or max(1, min(32, total_batch // (seq_len * rt.world_size)))
    tokens_per_micro = device_batch * seq_len * rt.world_size
    if total_batch % tokens_per_micro:
        raise PPTError(
            f"--total-batch-tokens {total_batch} is not divisible by device batch x seq-len x world "
            f"({device_batch} x {seq_len} x {rt.world_size} = {tokens_per_micro}); choose sizes that divide"
        )
    grad_accum = total_batch // tokens_per_micro
    use_compile = compile_enabled(args.compile, rt.device)
    if not args.benchmark and args.eval_tokens < seq_len * rt.world_size:  # found before training, not after it
        raise PPTError(
            f"--eval-tokens {args.eval_tokens} is less than one row of --seq-len {seq_len} per rank ({rt.world_size} "
            f"ranks): raise --eval-tokens to at least {seq_len * rt.world_size}"
        )

    # ---- model, built on meta then materialized, so a 360M model never allocates twice ------------------------
    with torch.device("meta"):
        model = build_model(config)
    model.to_empty(device=rt.device)
    model.init_weights()
    n_params = sum(p.numel() for p in model.parameters())
    lr = args.lr or DEFAULT_LR[args.optimizer]

    optimizer = build_optimizer(model, args.optimizer, lr=lr, weight_decay=args.weight_decay, compile=use_compile)
    train_loader = DataLoader(
        data_dir,
        "train",
        device_batch,
        seq_len,
        rt.rank,
        rt.world_size,
        data_seed,
        rt.device,
        expected_fingerprint=tokenizer.fingerprint,
        prefetch=args.loader_prefetch,
        vocab_size=config.vocab_size,
    )
    token_bytes = tokenizer.token_bytes().to(rt.device)

    # ---- output dir and resume ---------------------------------------------------------------------------------
    tag = args.tag or args.config or f"d{args.depth}"
    out_dir = args.out_dir or cache_dir() / "checkpoints" / tag
    if rt.is_master:
        made_out_dir = not out_dir.exists()
        ckpt.ensure_writable(out_dir, needed_bytes=n_params * 4 * 3)
        if not args.benchmark:  # one run per checkpoint directory and per run name (it names the manifest)
            lock_directory(out_dir, "give this run another --tag or --out-dir", made_by_this_run=made_out_dir)
            hold_lock(cache_dir() / "reports" / f".{tag}.lock", f"the run name {tag!r}", "give this run another --tag")
    config_dict = {"class": type(config).__name__, **dataclasses.asdict(config)}
    start_step, tokens_seen, history, skipped = 0, 0, [], 0
    state: dict[str, Any] = {}
    resume_path = None
    if args.resume == "auto":
        resume_path = ckpt.latest_checkpoint(out_dir) if rt.is_master else None
    elif args.resume:
        resume_path = Path(args.resume)
    if rt.distributed:  # rank 0 picks, so every rank resumes from the same checkpoint (it must be readable by all)
        chosen = [resume_path]
        torch.distributed.broadcast_object_list(chosen, src=0)
        resume_path = chosen[0]
    earlier = ckpt.list_checkpoints(out_dir) if rt.is_master and not args.benchmark and resume_path is None else []
    if earlier:  # a fresh run here would prune the new checkpoints and evaluate the earlier run's
        raise PPTError(
            f"{out_dir} holds checkpoints of an earlier run (up to step {earlier[-1][0]}); continue it with --resume "
            "auto, or give this run another --tag or --out-dir"
        )
    if resume_path is not None:
        state = ckpt.load_checkpoint(resume_path, map_location=rt.device)
        saved_config = state["config"]
        if TRAIN_LENGTH_FIELD in config_dict:  # a checkpoint from before the field trained at its loader's seq_len
            saved_config = {TRAIN_LENGTH_FIELD: state["loader"]["seq_len"], **saved_config}
        if diff := ckpt.config_mismatch(saved_config, config_dict):
            raise PPTError(f"checkpoint {resume_path} is from another config: " + "; ".join(diff))
        if (saved_batch := saved_batch_tokens(state)) not in (None, total_batch):
            raise PPTError(
                f"checkpoint {resume_path} trained at --total-batch-tokens {saved_batch}, not {total_batch}: its "
                f"schedule and data order would not continue; resume with --total-batch-tokens {saved_batch}"
            )
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        train_loader.load_state_dict(state["loader"])
        ckpt.set_rng_state(state["rng"])
        start_step, tokens_seen, history = state["step"], state["tokens"], state.get("history", [])
        skipped = state.get("skipped_nonfinite_steps", 0)  # the --skip-nonfinite budget spans restarts
        print0(f"resumed from {resume_path} at step {start_step}")
    wall_offset = state.get("wall_time_s", 0.0)  # the seconds earlier processes of this run spent up to the checkpoint

    def wall_time() -> float:
        return wall_offset + time.perf_counter() - started

    # ---- FLOPs, read from the (resumed) model: learned windows are the trained ones -----------------------------
    try:
        flops, untraced = mfu_flops_per_token(model, seq_len), None  # the MFU convention: a throughput figure
    except PPTError as exc:  # a forward that does not run on meta trains all the same, without MFU
        flops, untraced = None, str(exc)
    peak = peak_flops(rt.device, rt.dtype)
    comparison = state.get("comparison")  # the comparison rule: what runs are compared by
    if comparison:
        rule, rule_step = ComparisonFlops.from_state_dict(comparison["rule"]), comparison["rule_step"]
        comparison_flops = comparison["flops"]
    else:
        rule, rule_step, comparison_flops = comparison_flops_rule(model, seq_len), start_step, 0
        if start_step:
            warn0(f"{resume_path} predates comparison FLOPs: they are counted from step {start_step} on")
    warnings = [rule_warning] if (rule_warning := rule.warning()) else []
    if untraced:  # one line when the rule's warning already says why the trace failed
        warnings = [f"{warnings[0]}; no MFU either"] if rule.untraced else [f"no MFU: {untraced}", *warnings]
    for warning in warnings:
        warn0(warning)

    # ---- the budget and the schedule --------------------------------------------------------------------------
    budget = state.get("budget")
    if args.target_flops and (budget or {}).get("target_flops") != args.target_flops:
        # the rule at the start and the first step's documents: every rank reads the same rows, so agrees
        counts = first_step_doc_pos_counts(args, data_dir, device_batch, seq_len, grad_accum * rt.world_size, data_seed)
        per_token = rule.per_token(counts)
        budget = {
            "target_flops": args.target_flops,
            "comparison_flops_per_token_estimate": per_token,
            "estimated_from": f"the first step's document positions and the model at step {start_step}",
            "target_tokens": int(args.target_flops / per_token),
        }
    target_tokens = int(budget["target_tokens"] if args.target_flops else args.target_tokens or 20 * n_params)
    if target_tokens > MAX_TOKENS:
        raise PPTError(
            f"--target-flops {args.target_flops:g} is {target_tokens:.3g} tokens for this model, more than the "
            f"{MAX_TOKENS:.0e} any run can count; lower --target-flops"
        )
    if target_tokens < total_batch:
        given = (
            f"--target-flops {args.target_flops:g} ({target_tokens} tokens)"
            if args.target_flops
            else (f"--target-tokens {target_tokens}")
        )
        raise PPTError(
            f"{given} is less than one step of {total_batch} tokens (--total-batch-tokens); raise the budget or "
            "lower --total-batch-tokens"
        )
    total_steps = target_tokens // total_batch
    last_step = min(total_steps, args.max_steps or total_steps)  # --max-steps stops early; the schedule is unchanged
    warmup_tokens = 0.01 * target_tokens if args.warmup_tokens is None else args.warmup_tokens
    if warmup_tokens > target_tokens:
        raise PPTError(
            f"--warmup-tokens {warmup_tokens:g} is more than the run's {target_tokens} tokens: the learning rate would "
            "never reach its peak; lower --warmup-tokens"
        )
    warmup_steps = round(warmup_tokens / total_batch)

    # ---- compile and DDP --------------------------------------------------------------------------------------
    if args.benchmark:
        args.eval_every = args.save_every = 0
    compiled_model = torch.compile(model, mode=args.compile_mode) if use_compile else model
    train_model = compiled_model
    find_unused = False
    if rt.distributed:
        probe = DataLoader(data_dir, "train", 1, seq_len, rt.rank, rt.world_size, data_seed, rt.device, prefetch=0)
        inputs, targets, doc_pos = next(probe)
        unused = parameters_without_gradient(model, inputs, targets, None if args.no_doc_masks else doc_pos, rt)
        if unused:  # DDP would wait for their gradients forever, then fail at the next step
            find_unused = True
            print0(
                f"note: {len(unused)} parameters got no gradient in a first forward and backward ({few(unused)}); "
                "DDP runs with find_unused_parameters=True, which searches the autograd graph for them after every "
                "forward (slower)"
            )
        train_model = wrap_ddp(train_model, rt, find_unused_parameters=find_unused)

    # under CUDA graphs every .grad is allocated once and zeroed, not freed, after each step (allocate_grads: why)
    keep_grads = use_compile and args.compile_mode in CUDA_GRAPH_MODES
    if keep_grads:
        allocate_grads(model)

    # a benchmark writes no manifest: it must not overwrite the report of a real run with the same tag
    report = RunReport(tag, [cache_dir() / "reports", out_dir], enabled=rt.is_master and not args.benchmark)
    report.history = history
    relaunch = {
        **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in NOT_RELAUNCHED},
        # what the run derived is recorded, so a relaunch trains the same even where defaults change later
        **{"config": args.config, "tag": tag, "data_dir": str(data_dir), "seq_len": seq_len, "lr": lr},
        **{"total_batch_tokens": total_batch, "warmup_tokens": warmup_tokens},
        **({} if args.target_flops else {"target_tokens": target_tokens}),
    }
    report.update(
        argv=argv,
        command=shlex.join(["python", "-m", "scripts.base_train", *argv]),
        relaunch=f"python -m scripts.base_train --from-manifest {report.paths[0]}",
        args=relaunch,
        config_name=args.config or f"d{args.depth}",
        config=config_dict,
        tokenizer={"name": tokenizer.name, "fingerprint": tokenizer.fingerprint, "demo": tokenizer.is_demo},
        data={"dir": str(data_dir), "fingerprint": train_loader.fingerprint()},
        train={
            "seq_len": seq_len,
            "total_batch_tokens": total_batch,
            "device_batch_size": device_batch,
            "grad_accum": grad_accum,
            "world_size": rt.world_size,
            "ddp_find_unused_parameters": find_unused,
            "optimizer": args.optimizer,
            "lr": lr,
            "optimizer_groups": optimizer_settings(optimizer),
            "weight_decay": args.weight_decay,
            "grad_clip": args.grad_clip,
            "schedule": args.schedule,
            "warmup_tokens": warmup_tokens,
            "warmup_steps": warmup_steps,
            "decay_frac": args.decay_frac,
            "steps": total_steps,
            "last_step": last_step,
            "target_tokens": target_tokens,
            "budget": budget,
            "doc_masks": not args.no_doc_masks,
            "deterministic": args.deterministic,
            "seed": args.seed,
            "data_seed": data_seed,
            "model_seed": model_seed,
            "dtype": str(rt.dtype),
            "compile": use_compile,
            "compile_mode": args.compile_mode if use_compile else None,
            "loader_prefetch": args.loader_prefetch,
            "skip_nonfinite": args.skip_nonfinite,
            "eval_every": args.eval_every,
            "eval_tokens": int(args.eval_tokens),  # base_eval scores as many by default
            "recipe": args.recipe,
        },
        params=n_params,
        flops_per_token=flops,
        comparison_flops_rule={
            "rule": "3 x the forward FLOPs the model's math needs: 6N per token + 3 x each token mixer's forward FLOPs "
            "over the (query, key) pairs it needs (SPEC.md, Measurement)",
            "per_token_one_document_per_row": rule.per_token(),
            "traced_at_step": rule_step,
            **rule.state_dict(),
            **({"warning": rule_warning} if rule_warning else {}),  # what the rule cannot count as it says
        },
        wall_time_includes="seconds since this process started training (set-up, compilation, steps, evaluations, "
        "checkpoint writes), plus those of the processes before it up to the checkpoint it resumed from",
    )
    wandb_run, wandb_id = None, state.get("wandb_id")
    if args.run and rt.is_master:
        import wandb

        wandb_run = wandb.init(project="ppt", name=args.run, id=wandb_id, resume="allow", config=report.data)
        wandb_id = wandb_run.id
        report.update(wandb={"project": "ppt", "name": args.run, "id": wandb_id})

    mfu_flops = f"{flops['mfu'] / 1e9:.4g}G" if flops else "not traced"
    print0(
        f"{tag}: {n_params / 1e6:.1f}M params, {total_steps} steps x {total_batch} tokens "
        f"(device batch {device_batch} x {seq_len}, accum {grad_accum}, world {rt.world_size}), "
        f"{rt.device} {str(rt.dtype).removeprefix('torch.')}, compile {'on' if use_compile else 'off'}, "
        f"FLOPs/token {mfu_flops} (MFU convention), "
        f"{rule.per_token() / 1e9:.4g}G (comparison rule, one document per row)"
    )
    epochs = total_steps * total_batch / train_loader.tokens_per_epoch
    if epochs > 1:
        warn0(f"the budget is {epochs:.1f} epochs of {data_dir}: data repeats (prepare more shards to avoid it)")

    stop_signal: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop_signal.append(signum))

    def sync_step(
        train_loss: torch.Tensor, grad_norm: torch.Tensor, counts: np.ndarray
    ) -> tuple[float, float, bool, int, np.ndarray]:
        """The step's one host sync: (loss averaged over ranks, gradient norm, finite loss and gradient, signal to
        stop on or 0, the document-position counts of every rank's tokens). Ranks can receive a signal in different
        steps; the flags ride on the loss all-reduce so that every rank stops after the same step (one that stopped
        alone would leave the others waiting in their next all-reduce). The counts ride along for the comparison
        FLOPs; fp32 holds them exactly (each is at most the step's tokens, far below 2^24).
        """
        stats = torch.stack([train_loss, grad_norm.float()])
        flags = [float(sig in stop_signal) for sig in (signal.SIGTERM, signal.SIGINT)]
        if rt.distributed:
            host = torch.from_numpy(np.concatenate([flags, counts]).astype(np.float32))
            stats = torch.cat([stats, host.to(rt.device)])
            torch.distributed.all_reduce(stats)  # summed: the loss and norm are divided by the world size below
            values = stats.cpu().numpy().astype(np.float64)
            loss_sum, norm_sum, flags = float(values[0]), float(values[1]), values[2:4].tolist()
            counts = np.rint(values[4:]).astype(np.int64)
        else:
            loss_sum, norm_sum = stats.tolist()
        loss, norm = loss_sum / rt.world_size, norm_sum / rt.world_size
        stop = signal.SIGTERM if flags[0] else signal.SIGINT if flags[1] else 0
        return loss, norm, math.isfinite(loss) and math.isfinite(norm), int(stop), counts

    def save(step: int) -> None:
        if rt.is_master:
            payload = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "config": config_dict,
                "loader": train_loader.state_dict(),
                "rng": ckpt.rng_state(),
                "tokens": tokens_seen,
                "total_batch_tokens": total_batch,
                "history": report.history,
                "skipped_nonfinite_steps": skipped,
                "tokenizer_fingerprint": tokenizer.fingerprint,
                "comparison": {"flops": comparison_flops, "rule": rule.state_dict(), "rule_step": rule_step},
                "budget": budget,
                "wall_time_s": wall_time(),
                "wandb_id": wandb_id,
            }
            path = ckpt.save_checkpoint(out_dir, step, payload, keep=args.keep)
            print0(f"saved {path}")

    shortfall_shown = False  # a budget above the val split: said at the first evaluation only

    def evaluate(step: int) -> dict[str, Any]:
        nonlocal shortfall_shown
        val_loader = DataLoader(
            data_dir,
            "val",
            device_batch,
            seq_len,
            rt.rank,
            rt.world_size,
            0,
            rt.device,
            expected_fingerprint=tokenizer.fingerprint,
            vocab_size=config.vocab_size,
        )
        shortfall = val_loader.budget_shortfall(int(args.eval_tokens))
        if shortfall and not shortfall_shown:
            warn0(shortfall)  # each log entry records the tokens it scored
            shortfall_shown = True
        result = evaluate_bpb(compiled_model, val_loader.val_batches(int(args.eval_tokens)), token_bytes, rt.dtype)
        freeze_gc()  # the first call compiled the evaluation graphs: out of the collector's scans too
        print0(
            f"step {step:6d} | val nll {result['nll']:.4f} | val bpb {result['bpb']:.4f} ({result['tokens']} tokens)"
        )
        entry = {
            "step": step,
            "tokens": tokens_seen,
            "comparison_flops": comparison_flops,
            "wall_time_s": wall_time(),
            "val_nll": result["nll"],
            "val_bpb": result["bpb"],
            "eval_tokens": result["tokens"],
        }
        report.log_step(**entry)
        if wandb_run:
            wandb_run.log(for_wandb(entry), step=step)
        return entry

    # ---- the loop ---------------------------------------------------------------------------------------------
    # One host sync per step, after backward, and none at its end: the host queues the next step while the GPU
    # runs this one's optimizer. The step time is the time between consecutive syncs.
    step = start_step
    train_iter = iter(train_loader)
    last_saved = start_step
    stopping = 0
    optimizer_times: list[Callable[[], float]] = []  # benchmark mode: read at the end, so timing never waits
    profiler = StepProfiler(rt.device, first=5, steps=3) if args.profile and rt.is_master else None
    profiled_steps: set[int] = set()  # slowed by the profiler: left out of a benchmark's figures
    last_sync = time.perf_counter()
    first_sync = None  # after this process's first step (compilation): the ETA's clock starts there
    while step < last_step:
        if profiler and profiler.step():
            profiled_steps.add(step + 1)
        if stop_signal and not rt.distributed:  # a lone process stops before it starts another step
            stopping = stop_signal[0]
            break
        if step % RULE_RETRACE_STEPS == 0 and step != rule_step:
            rule, rule_step = comparison_flops_rule(model, seq_len), step
            last_sync = time.perf_counter()  # the trace's time is not the step's
        set_lr(optimizer, lr_multiplier(step, total_steps, warmup_steps, args.schedule, args.decay_frac))
        loss_sum = torch.zeros((), device=rt.device)
        data_time = 0.0
        for micro in range(grad_accum):
            t_data = time.perf_counter()
            inputs, targets, doc_pos = next(train_iter)
            doc_pos = None if args.no_doc_masks else doc_pos
            data_time += time.perf_counter() - t_data
            sync = micro == grad_accum - 1 or not rt.distributed
            with nullcontext() if sync else train_model.no_sync(), autocast(rt.device, rt.dtype):
                try:
                    loss = train_model(inputs, targets, doc_pos)
                except RuntimeError as exc:
                    if error := unused_parameter_error(exc, step):
                        raise error from exc
                    raise
            (loss / grad_accum).backward()
            loss_sum += loss.detach()
        counts = train_loader.take_doc_pos_counts()
        if args.no_doc_masks:  # whole rows are the documents: each position once per row
            counts = np.full(seq_len, counts.sum() // seq_len, dtype=np.int64)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip or float("inf"))
        loss_value, norm_value, finite, stopping, counts = sync_step(loss_sum / grad_accum, grad_norm, counts)
        now = time.perf_counter()
        dt, last_sync = now - last_sync, now
        if step == start_step:
            # What torch.compile built in this first step lives all run. Freezing takes it out of the garbage
            # collector's full scans, which otherwise pause the host whenever they run (260 ms with a compiled
            # 32-layer model alive, on a 2-core CPU): under DDP one rank's pause holds up every rank.
            freeze_gc()
            first_sync = now
        if not finite:
            skipped += 1
            optimizer.zero_grad(set_to_none=not keep_grads)
            if skipped > args.skip_nonfinite:
                save_note = f"the last good checkpoint is {ckpt.latest_checkpoint(out_dir) or 'none (no save yet)'}"
                raise PPTError(
                    f"non-finite loss/gradient at step {step + 1} (loss {loss_value}); {save_note}. "
                    "Lower --lr, or pass --skip-nonfinite N to skip such steps"
                )
            warn0(f"step {step + 1}: non-finite loss/gradient, step skipped ({skipped}/{args.skip_nonfinite})")
            step += 1
            if stopping:
                break
            continue
        if args.benchmark:
            optimizer_times.append(timed(optimizer.step, rt.device))
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=not keep_grads)
        step += 1
        tokens_seen += total_batch
        comparison_flops += rule.step_flops(counts)
        tok_per_s = total_batch / dt
        mfu = flops["mfu"] * tok_per_s / (peak * rt.world_size) if peak and flops else None
        memory_key, memory = memory_gb(rt.device)
        report.log_step(
            step=step,
            tokens=tokens_seen,
            comparison_flops=comparison_flops,
            wall_time_s=wall_time(),
            loss=loss_value,
            lr=optimizer.param_groups[0]["lr"],
            grad_norm=norm_value,
            tok_per_s=tok_per_s,
            step_time=dt,
            data_time=data_time,
            **({"mfu": mfu} if mfu is not None else {}),
            **{memory_key: memory},
        )
        if step % args.log_every == 0 or step == last_step:
            mfu_text = f" | mfu {100 * mfu:5.1f}%" if mfu is not None else ""
            per_step = (now - first_sync) / (step - start_step - 1) if step - start_step > 1 else dt
            print0(
                f"step {step:6d}/{total_steps} ({100 * step / last_step:.1f}%) | loss {loss_value:.4f} "
                f"| lr {optimizer.param_groups[0]['lr']:.2e} | grad {norm_value:.3f} | {tok_per_s:,.0f} tok/s "
                f"| {1000 * dt:.0f} ms{mfu_text} | mem {memory:.2f} GB | {duration(wall_time())} elapsed, eta "
                f"{duration(per_step * (last_step - step))}"
            )
            if wandb_run:
                wandb_run.log(for_wandb(report.history[-1]), step=step)
        if stopping:
            break
        if args.eval_every and step % args.eval_every == 0 and step < last_step:
            evaluate(step)
            last_sync = time.perf_counter()  # evaluation time is not the next step's
        if args.save_every and step % args.save_every == 0 and step < last_step:
            save(step)
            last_saved = step
            last_sync = time.perf_counter()
        if step % 50 == 0:
            report.write()
    if profiler:
        profiler.stop()

    if args.benchmark:
        if rt.device.type == "cuda":
            torch.cuda.synchronize()  # the last optimizer step's events
        optimizer_seconds = [read() for read in optimizer_times]
        summary = benchmark_summary(report.history, optimizer_seconds, profiled_steps, rt, flops, peak, n_params)
        print0("benchmark " + json.dumps(summary))
        shutdown_runtime()
        return

    # ---- end of run: save first, so an evaluation crash loses nothing ----------------------------------------
    if step != last_saved:
        save(step)
    if stopping:
        print0(f"stopped by signal {stopping} at step {step}; resume with --resume auto")
        report.update(stopped_at=step)
        report.write()
        shutdown_runtime()
        sys.exit(128 + stopping)
    final = evaluate(step)
    report.update(
        final_val=final,
        steps_done=step,
        tokens=tokens_seen,
        comparison_flops=comparison_flops,
        wall_time_s=final["wall_time_s"],
        skipped_nonfinite_steps=skipped,
        finished=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )
    report.write()
    plot = report.plot(out_dir / f"{tag}_loss.png")
    if rt.is_master:
        print0(f"report: {report.paths[0]}")
        if plot:
            print0(f"loss curve: {plot}")
        print0(f"checkpoint: {ckpt.latest_checkpoint(out_dir)}")
    if wandb_run:
        wandb_run.finish()
    shutdown_runtime()


def first_step_doc_pos_counts(
    args: argparse.Namespace, data_dir: Path, batch_size: int, seq_len: int, micro_batches: int, seed: int
) -> np.ndarray:
    """Document-position counts of the first step's rows, all ranks together: ranks read rows in blocks of a batch,
    so they are the first `micro_batches` batches of one process."""
    loader = DataLoader(data_dir, "train", batch_size, seq_len, seed=seed, prefetch=0)
    for _ in range(micro_batches):
        next(loader)
    counts = loader.take_doc_pos_counts()
    return np.full(seq_len, counts.sum() // seq_len, dtype=np.int64) if args.no_doc_masks else counts


def allocate_grads(model: torch.nn.Module) -> None:
    """Give every trainable parameter a zero .grad. CUDA graph trees own the memory of a replayed backward's outputs
    and overwrite it at the next replay, so no .grad may be such an output: with .grad allocated (and zeroed, not
    freed, between steps) autograd adds each micro-batch's gradients into it in place."""
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)


def parameters_without_gradient(
    model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, doc_pos: torch.Tensor | None, rt: Runtime
) -> list[str]:
    """The trainable parameters that one forward and backward of a row leaves without a gradient on any rank (a
    router's unchosen expert, an early exit): DDP must be told to look for them. Gradients and RNG are left as found."""
    rng = ckpt.rng_state()
    with autocast(rt.device, rt.dtype):
        model(inputs, targets, doc_pos).backward()
    mine = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
    model.zero_grad(set_to_none=True)
    ckpt.set_rng_state(rng)
    every_rank: list[list[str] | None] = [None] * rt.world_size
    torch.distributed.all_gather_object(every_rank, mine)
    return sorted(set().union(*every_rank))


def unused_parameter_error(exc: RuntimeError, step: int) -> PPTError | None:
    """DDP's error for parameters that got no gradient in the step before, as one line with the fix; None for others."""
    if "Expected to have finished reduction in the prior iteration" not in str(exc):
        return None
    return PPTError(
        f"under DDP, some parameters got no gradient in step {step} though all had one in a first forward and backward "
        "before training, so DDP runs without find_unused_parameters; make every parameter take part in every "
        "step's loss in ppt/model.py (e.g. add 0 * p.sum() for a branch a step may skip)"
    )


def optimizer_settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Every param group's settings (role, algorithm, initial_lr, betas, weight decay, ...), without its tensors and
    its current lr (the schedule's, which a resumed optimizer brings along)."""
    return [{k: v for k, v in group.items() if k not in ("params", "lr")} for group in optimizer.param_groups]


def memory_gb(device: torch.device) -> tuple[str, float]:
    """The memory figure of the log: CUDA's peak allocated memory, elsewhere the process's peak resident size."""
    if device.type == "cuda":
        return "cuda_max_alloc_gb", torch.cuda.max_memory_allocated(device) / 1e9
    import resource  # POSIX; ru_maxrss is KiB on Linux, bytes on macOS

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return "max_rss_gb", peak * (1 if sys.platform == "darwin" else 1024) / 1e9


def duration(seconds: float) -> str:
    """42s, 5m08s, 7h58m, 2d03h."""
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"


def for_wandb(entry: dict[str, Any]) -> dict[str, Any]:
    """wandb's metrics: integers past 2^53 (cumulative FLOPs) as floats."""
    return {k: float(v) if isinstance(v, int) and abs(v) > 2**53 else v for k, v in entry.items()}


def freeze_gc() -> None:
    """gc.freeze(), undone at exit. Frozen objects are never collected, not even when the interpreter shuts down,
    so without the unfreeze libtriton's nanobind finds its objects still alive at exit and prints ~80 lines of
    "nanobind: leaked ..." (they are not leaks: the collector was told to skip them)."""
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # once, however often a process (a test session) calls main
    atexit.register(gc.unfreeze)


def timed(fn: Callable[[], object], device: torch.device) -> Callable[[], float]:
    """Run fn; return a function that gives its duration in seconds. On CUDA it is the GPU time between two events,
    read later, so that timing never makes the host wait for the GPU."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - t0
        return lambda: elapsed
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    return lambda: start.elapsed_time(end) / 1000


def benchmark_summary(
    history: list[dict],
    optimizer_times: list[float],
    profiled_steps: set[int],
    rt: object,
    flops: dict | None,
    peak: float | None,
    n_params: int,
) -> dict:
    """Mean throughput and phase times over the steps after the first five (compilation and warm-up), leaving out
    the steps the profiler slowed down."""
    after_warmup = list(zip([h for h in history if "step_time" in h], optimizer_times))[5:]
    kept = [(h, seconds) for h, seconds in after_warmup if h["step"] not in profiled_steps]
    if not kept:
        raise PPTError("--benchmark needs more than 5 steps (more than 9 with --profile); raise --max-steps")
    steps = [h for h, _ in kept]
    mean = lambda key: sum(h[key] for h in steps) / len(steps)
    step_time = mean("step_time")
    tok_per_s = mean("tok_per_s")
    summary = {
        "params": n_params,
        "steps_measured": len(steps),
        "steps_profiled_left_out": len(after_warmup) - len(kept),
        "tok_per_s": tok_per_s,
        "step_time_s": step_time,
        "data_share": mean("data_time") / step_time,
        "optimizer_share": sum(seconds for _, seconds in kept) / len(kept) / step_time,
        **({"flops_per_token": flops["mfu"], "flops_per_token_6n": flops["6n"]} if flops else {}),
    }
    if peak and flops:
        summary["mfu"] = flops["mfu"] * tok_per_s / (peak * rt.world_size)
        summary["mfu_6n"] = flops["6n"] * tok_per_s / (peak * rt.world_size)
    if torch.cuda.is_available():
        summary["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
    return summary


if __name__ == "__main__":
    run_cli(main)
