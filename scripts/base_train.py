"""Pretrain a model from ppt/model.py on prepared shards: the fixed training loop, top to bottom.

python -m scripts.base_train --config smollm-135m --target-tokens 1e9
torchrun --nproc_per_node=8 -m scripts.base_train --config smollm-360m --target-tokens 20e9
python -m scripts.base_train --recipe mor                  # the Mixture-of-Recursions Vanilla recipe (SmolLM-360M)
python -m scripts.base_train --from-manifest RUN.json --tag rerun   # relaunch a run from its manifest
python -m scripts.base_train ... --resume auto             # continue a stopped or killed run from its newest checkpoint

A run owns its checkpoint directory and its name (--tag) while it runs: a second run with either stops at once.
The Trainer below reads in its phases' order: resolve the settings, build, plan the budget, the loop, the finish.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import gc
import json
import math
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch

import ppt.model
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
from ppt.flops import NO_FORMULAS, mfu_flops_per_token
from ppt.formatting import duration
from ppt.locks import hold_lock, lock_directory, locks_held, release_locks
from ppt.loss_eval import DEFAULT_EVAL_TOKENS, autocast, evaluate_bpb
from ppt.memory import check_memory
from ppt.model import CONFIGS, DEFAULT_CONFIG, build_model, get_config
from ppt.optim import DEFAULT_LR, build_optimizer, lr_multiplier, set_lr
from ppt.profiling import StepProfiler
from ppt.run import Evaluation, RunRecord, TrainSettings, plot_losses
from ppt.shards import check_prepared, default_data_dir, load_data_tokenizer

OP_FORMULAS = getattr(ppt.model, "OP_FORMULAS", NO_FORMULAS)  # optional in model.py (SPEC.md)

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
# The comparison-FLOPs rule is refreshed every this many steps (learned windows move), on a schedule that does not
# depend on --log-every or on where a run was resumed, so an interrupted run counts what an uninterrupted one does.
RULE_REFRESH_STEPS = 50
# A config field of this name, if the config has one, is set to the training row length (SPEC.md, the model contract).
TRAIN_LENGTH_FIELD = "train_seq_len"
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # torch.compile modes that replay the step from CUDA graphs
# Devices that run queued work while the host goes on: there the loop reads each step a step late (Trainer.loop). A
# CPU computes as the host queues, so reading late would gain nothing and time each step by its successor's work.
LATE_READ_DEVICES = ("cuda",)
TOTAL_BATCH_TOKENS = 524_288  # tokens a step, all ranks together, unless --total-batch-tokens
CHECKPOINT_FORMAT = 2  # a checkpoint records its settings (TrainSettings), which a resume must continue


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
    g.add_argument("--total-batch-tokens", type=token_count, help="tokens per step, all ranks (default 524288)")
    g.add_argument("--device-batch-size", type=positive_int, help="rows per forward on a device; accumulation derived")
    g.add_argument("--target-tokens", type=token_count, help="training budget in tokens (default 20 x parameters)")
    g.add_argument(
        "--target-flops",
        type=positive_float,
        help="training budget in comparison FLOPs instead of tokens: converted once, at the start, into tokens "
        "(the manifest records the conversion; compare reports the FLOPs the run really counted)",
    )
    g = p.add_argument_group("optimization")
    g.add_argument("--optimizer", choices=["adamw", "muon", "aurora"], default="adamw")
    # bounded: past ~3e38 an fp32 optimizer step overflows; far below that no run learns
    g.add_argument("--lr", type=Number(float, 0, 1e6, above=True), help="peak learning rate (default per optimizer)")
    g.add_argument("--weight-decay", type=Number(float, 0, 1e6), default=0.1)
    g.add_argument("--schedule", choices=["constant", "cosine", "wsd"], default="wsd")
    g.add_argument("--warmup-tokens", type=nonneg_token_count, help="LR warmup in tokens (default 1%% of the budget)")
    g.add_argument(
        "--decay-frac", type=Number(float, 0, 1), default=0.2, help="wsd: the last fraction of steps, decayed linearly"
    )
    g.add_argument("--no-doc-masks", action="store_true", help="plain causal rows, ignoring document boundaries")
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
    g.add_argument("--seed", type=nonneg_int, default=0, help="sets --data-seed and --model-seed unless given")
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
        choices=["auto", "default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune"],
        default="auto",
        help="torch.compile's mode for the training step. auto: reduce-overhead (the step replayed from CUDA graphs) "
        "when one CUDA GPU trains, else default (DDP, CPU, MPS)",
    )
    g.add_argument("--loader-prefetch", type=nonneg_int, default=2, help="batches built ahead in a thread (0: none)")
    g.add_argument("--deterministic", action="store_true", help="deterministic kernels only: bitwise repeatable runs")
    g.add_argument("--log-every", type=positive_int, default=1, help="steps between log lines and record entries")
    g.add_argument("--max-steps", type=positive_int, help="stop at this step, the LR schedule unchanged (benchmarks)")
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


def parse_args(argv: list[str]) -> argparse.Namespace:
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
        recorded = RunRecord.load(path).args
    except PPTError as exc:
        raise PPTError(
            f"cannot relaunch from {path} ({exc}); pass the record base_train wrote for the run "
            "(<cache>/reports/<tag>.json or beside its checkpoints)"
        ) from exc
    if not isinstance(recorded, dict):
        raise PPTError(f"{path}'s 'args' is not a mapping of settings; pass the record base_train wrote")
    actions = {action.dest: action for action in parser._actions}
    if unknown := sorted(set(recorded) - set(actions)):
        warn0(f"{path} records settings this base_train does not have, ignored: {', '.join(unknown)}")
    return {
        k: checked_setting(path, actions[k], v) for k, v in recorded.items() if k in actions and k not in NOT_RELAUNCHED
    }


def checked_setting(path: Path, action: argparse.Action, value: Any) -> Any:
    """A recorded value through its flag's own checks, which parser defaults skip (a hand-edited manifest)."""
    if value is None or isinstance(value, bool):
        return value
    flag = action.option_strings[0]  # base_train's flags are all options
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


def main(argv: list[str] | None = None) -> None:
    """Train; the SIGTERM/SIGINT handlers the loop installs and the deterministic setting are put back afterwards
    (main may run in-process)."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    deterministic = torch.are_deterministic_algorithms_enabled()
    held = locks_held()  # a caller's own locks (a study's on its directory) stay held
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        trainer = Trainer(parse_args(argv), argv)
        trainer.loop()
        trainer.finish()
    finally:
        shutdown_runtime(wait=False)  # stopped by an error: the process then exits with its message, not an abort
        release_locks(keep=held)  # the output directory's and the run name's
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        if torch.are_deterministic_algorithms_enabled() != deterministic:  # the call imports torch._inductor
            torch.use_deterministic_algorithms(deterministic)


@dataclasses.dataclass
class QueuedStep:
    """A step whose forward and backward are queued: its loss and gradient norm (on the device, or on their way to
    the host once `copied` has passed), its document-position counts, the comparison rule they are booked by, its
    learning rate and its seconds spent waiting for data."""

    stats: torch.Tensor
    counts: np.ndarray
    rule: ComparisonFlops
    lr: float
    data_time: float
    copied: torch.cuda.Event | None = None


class Trainer:
    """One run in five phases: resolve the settings (every check that needs no model), build what they need (model,
    optimizer, data, output directory, a resumed state), plan the budget and start the record, then the loop and
    the finish. --benchmark and --profile hook into the loop from outside it (Measurement)."""

    def __init__(self, args: argparse.Namespace, argv: list[str]) -> None:
        self.started = time.perf_counter()
        self.args, self.argv = args, argv
        if args.deterministic:  # before the first cuBLAS call, which reads the workspace setting
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)  # an op with no such kernel raises, naming itself
        self.rt = init_runtime(args.device)
        self.resolve()
        self.build()
        self.plan()
        self.measure = Measurement(args, self.rt)
        self.stop_signal: list[int] = []
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: self.stop_signal.append(signum))

    # ---- phase 1: the settings that need no model ---------------------------------------------------------------
    def resolve(self) -> None:
        args, rt = self.args, self.rt
        if args.target_flops and args.target_tokens:
            raise PPTError("give the budget as --target-tokens or as --target-flops, not both")
        if args.config is None and args.depth is None:
            args.config = DEFAULT_CONFIG
        self.config_name = args.config or f"d{args.depth}"
        config = get_config(args.config, args.depth)
        self.data_dir = args.data_dir or default_data_dir()
        self.tokenizer = load_data_tokenizer(self.data_dir)
        if unfinished := check_prepared(self.data_dir):
            warn0(unfinished)
        if self.tokenizer.vocab_size != config.vocab_size:
            print0(
                f"note: vocab_size {config.vocab_size} -> {self.tokenizer.vocab_size} to match {self.tokenizer.name}"
            )
            config = dataclasses.replace(config, vocab_size=self.tokenizer.vocab_size)
        self.seq_len = args.seq_len or min(2048, config.max_seq_len)
        if self.seq_len > config.max_seq_len:
            raise PPTError(f"--seq-len {self.seq_len} exceeds the config's max_seq_len {config.max_seq_len}; lower it")
        if TRAIN_LENGTH_FIELD in {f.name for f in dataclasses.fields(config)}:  # recorded in every checkpoint
            config = dataclasses.replace(config, **{TRAIN_LENGTH_FIELD: self.seq_len})
        self.config = config
        self.config_dict = {"class": type(config).__name__, **dataclasses.asdict(config)}
        self.total_batch = args.total_batch_tokens or TOTAL_BATCH_TOKENS
        self.device_batch = args.device_batch_size or max(
            1, min(32, self.total_batch // (self.seq_len * rt.world_size))
        )
        tokens_per_micro = self.device_batch * self.seq_len * rt.world_size
        if self.total_batch % tokens_per_micro:
            raise PPTError(
                f"--total-batch-tokens {self.total_batch} is not divisible by device batch x seq-len x world "
                f"({self.device_batch} x {self.seq_len} x {rt.world_size} = {tokens_per_micro}); choose sizes that "
                "divide"
            )
        self.grad_accum = self.total_batch // tokens_per_micro
        if not args.benchmark and args.eval_tokens < self.seq_len * rt.world_size:  # found before training, not after
            raise PPTError(
                f"--eval-tokens {args.eval_tokens} is less than one row of --seq-len {self.seq_len} per rank "
                f"({rt.world_size} ranks): raise --eval-tokens to at least {self.seq_len * rt.world_size}"
            )
        if args.benchmark:  # a benchmark measures steps: it neither evaluates nor saves
            args.eval_every = args.save_every = 0
        self.tag = args.tag or self.config_name
        self.out_dir = args.out_dir or cache_dir() / "checkpoints" / self.tag
        self.reports_path = cache_dir() / "reports" / f"{self.tag}.json"
        self.data_seed = args.seed if args.data_seed is None else args.data_seed
        self.model_seed = args.seed if args.model_seed is None else args.model_seed
        self.use_compile = compile_enabled(args.compile, rt.device)
        self.compile_mode = compile_mode(args.compile_mode, rt)
        self.lr = args.lr or DEFAULT_LR[args.optimizer]

    # ---- phase 2: model, optimizer, data, output directory, and the state a resume brings ------------------------
    def build(self) -> None:
        args, rt = self.args, self.rt
        torch.manual_seed(self.model_seed)  # the weights' initialization; the data order has its own seed
        with torch.device("meta"):  # built on meta, then materialized: a 360M model never allocates twice
            self.model = build_model(self.config)
        check_memory(self.model, self.device_batch, self.seq_len, rt, OP_FORMULAS, eager=not self.use_compile)
        self.model.to_empty(device=rt.device)
        self.model.init_weights()
        self.n_params = sum(p.numel() for p in self.model.parameters())
        self.optimizer = build_optimizer(
            self.model, args.optimizer, lr=self.lr, weight_decay=args.weight_decay, compile=self.use_compile
        )
        self.train_loader = DataLoader(
            self.data_dir, "train", self.device_batch, self.seq_len, rt.rank, rt.world_size, self.data_seed,
            rt.device, expected_fingerprint=self.tokenizer.fingerprint, prefetch=args.loader_prefetch,
            vocab_size=self.config.vocab_size,
        )  # fmt: skip
        self.token_bytes = self.tokenizer.token_bytes().to(rt.device)
        if rt.is_master:
            made_out_dir = not self.out_dir.exists()
            ckpt.ensure_writable(self.out_dir, needed_bytes=self.n_params * 4 * 3)
            if not args.benchmark:  # one run per checkpoint directory and per run name (it names the record)
                lock_directory(self.out_dir, "give this run another --tag or --out-dir", made_by_this_run=made_out_dir)
                hold_lock(self.reports_path.with_name(f".{self.tag}.lock"), f"the run name {self.tag!r}",
                          "give this run another --tag")  # fmt: skip
        self.state = self.resumed_state()
        self.step = self.start_step = self.state.get("step", 0)
        self.tokens_seen = self.state.get("tokens", 0)
        self.skipped = self.state.get("skipped_nonfinite_steps", 0)  # the --skip-nonfinite budget spans restarts

    def resumed_state(self) -> dict[str, Any]:
        """The checkpoint --resume names, loaded into the model, optimizer, loader and RNGs ({} for a fresh run)."""
        args, rt = self.args, self.rt
        path = None
        if args.resume == "auto":
            path = ckpt.latest_checkpoint(self.out_dir) if rt.is_master else None
        elif args.resume:
            path = Path(args.resume)
        if rt.distributed:  # rank 0 picks, so every rank resumes from the same checkpoint (readable by all)
            chosen = [path]
            torch.distributed.broadcast_object_list(chosen, src=0)
            path = chosen[0]
        if path is None:
            if rt.is_master and not args.benchmark:
                # a fresh run here would prune the new checkpoints and evaluate the earlier run's
                if earlier := ckpt.list_checkpoints(self.out_dir):
                    raise PPTError(
                        f"{self.out_dir} holds checkpoints of an earlier run (up to step {earlier[-1][0]}); continue "
                        "it with --resume auto, or give this run another --tag or --out-dir"
                    )
                self.check_run_name_free()
            return {}
        state = ckpt.load_checkpoint(path, map_location=rt.device)
        if state.get("format") != CHECKPOINT_FORMAT:
            raise PPTError(
                f"checkpoint {path} is of format {state.get('format', 1)}, not {CHECKPOINT_FORMAT}: resume it with the "
                "ppt commit its run record names (git.commit), or start a new run"
            )
        if diff := ckpt.config_mismatch(state["config"], self.config_dict):
            raise PPTError(f"checkpoint {path} is from another config: " + "; ".join(diff))
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.train_loader.load_state_dict(state["loader"])
        ckpt.set_rng_state(state["rng"])
        self.resume_path = path
        print0(f"resumed from {path} at step {state['step']}")
        return state

    def check_run_name_free(self) -> None:
        """A fresh run may not take the name of a finished or stopped run elsewhere: its record would be replaced."""
        try:
            other = RunRecord.load(self.reports_path).out_dir
        except PPTError:  # no record by that name, or none that can be read
            return
        if other is not None and Path(other).resolve() != self.out_dir.resolve():
            raise PPTError(
                f"the run name {self.tag!r} is taken by the run in {other} ({self.reports_path}); give this run "
                "another --tag, or delete that record to reuse the name"
            )

    # ---- phase 3: FLOPs, the budget and the schedule, compilation, the record ----------------------------------
    def plan(self) -> None:
        args, rt, state = self.args, self.rt, self.state
        try:  # the MFU convention: a throughput figure, read from the (resumed) model
            self.mfu_flops, untraced = mfu_flops_per_token(self.model, self.seq_len, OP_FORMULAS), None
        except PPTError as exc:  # a forward that does not run on meta trains all the same, without MFU
            self.mfu_flops, untraced = None, str(exc)
        self.peak = peak_flops(rt.device, rt.dtype)
        if "comparison" in state:  # the comparison rule: what runs are compared by
            self.rule = ComparisonFlops.from_state_dict(state["comparison"]["rule"])
            self.rule_step, self.comparison_flops = state["comparison"]["rule_step"], state["comparison"]["flops"]
        else:
            self.rule = comparison_flops_rule(self.model, self.seq_len, OP_FORMULAS)
            self.rule_step, self.comparison_flops = 0, 0
        warnings = [rule_warning] if (rule_warning := self.rule.warning()) else []
        if untraced:  # one line when the rule's warning already says why the trace failed
            warnings = [f"{warnings[0]}; no MFU either"] if self.rule.untraced else [f"no MFU: {untraced}", *warnings]
        for warning in warnings:
            warn0(warning)

        self.settings = self.train_settings()
        if state and (diff := self.settings.resume_mismatch(TrainSettings(**state["settings"]))):
            raise PPTError(
                f"{self.resume_path} trained with other settings ({'; '.join(diff)}): its schedule and data order "
                "would not continue. Resume with the settings it recorded, or start a new run"
            )
        s = self.settings
        compiled = torch.compile(self.model, mode=self.compile_mode) if self.use_compile else self.model
        self.eval_model = self.train_model = compiled
        if rt.distributed:
            self.train_model = wrap_ddp(compiled, rt, find_unused_parameters=s.ddp_find_unused_parameters)
        self.keep_grads = self.use_compile and self.compile_mode in CUDA_GRAPH_MODES
        if self.keep_grads:  # under CUDA graphs every .grad is allocated once and zeroed, not freed (allocate_grads)
            allocate_grads(self.model)

        self.record = RunRecord(
            run=self.tag, out_dir=str(self.out_dir), argv=self.argv, args=self.relaunch_args(),
            config_name=self.config_name, config=self.config_dict,
            tokenizer={"name": self.tokenizer.name, "fingerprint": self.tokenizer.fingerprint,
                       "demo": self.tokenizer.is_demo},
            data={"dir": str(self.data_dir), "fingerprint": self.train_loader.fingerprint()},
            train=s, params=self.n_params, flops_per_token=self.mfu_flops,
            comparison_flops_rule={"per_token_one_document_per_row": self.rule.per_token(),
                                   "traced_at_step": self.rule_step, **self.rule.state_dict(),
                                   **({"warning": rule_warning} if rule_warning else {})},
            history=state.get("history", []), skipped_nonfinite_steps=self.skipped,
        )  # fmt: skip
        self.record.evals = [Evaluation(**h) for h in self.record.history if "val_bpb" in h]
        self.wandb_run = None
        if args.run and rt.is_master:
            import wandb

            self.wandb_run = wandb.init(project="ppt", name=args.run, id=state.get("wandb_id"), resume="allow",
                                        config=self.record.to_dict())  # fmt: skip
            self.record.wandb = {"project": "ppt", "name": args.run, "id": self.wandb_run.id}

        mfu_text = f"{self.mfu_flops['mfu'] / 1e9:.4g}G" if self.mfu_flops else "not traced"
        print0(
            f"{self.tag}: {self.n_params / 1e6:.1f}M params, {s.steps} steps x {s.total_batch_tokens} tokens "
            f"(device batch {s.device_batch_size} x {s.seq_len}, accum {s.grad_accum}, world {s.world_size}), "
            f"{rt.device} {str(rt.dtype).removeprefix('torch.')}, compile {'on' if s.compile else 'off'}, "
            f"FLOPs/token {mfu_text} (MFU convention), "
            f"{self.rule.per_token() / 1e9:.4g}G (comparison rule, one document per row)"
        )
        epochs = s.steps * s.total_batch_tokens / self.train_loader.tokens_per_epoch
        if epochs > 1:
            warn0(
                f"the budget is {epochs:.1f} epochs of {self.data_dir}: data repeats (prepare more shards to avoid it)"
            )

    def train_settings(self) -> TrainSettings:
        """The resolved settings: the budget in tokens (from --target-flops: converted once, at the start, by the
        rule and the first step's documents), the schedule in steps, and DDP's need to look for unused parameters."""
        args, rt = self.args, self.rt
        budget = self.state.get("settings", {}).get("budget")
        if args.target_flops and (budget or {}).get("target_flops") != args.target_flops:
            per_token = self.rule.per_token(self.first_step_doc_pos_counts())  # alike on every rank
            budget = {
                "target_flops": args.target_flops,
                "comparison_flops_per_token_estimate": per_token,
                "estimated_from": f"the first step's document positions and the model at step {self.step}",
                "target_tokens": int(args.target_flops / per_token),
            }
        target = int(budget["target_tokens"] if args.target_flops else args.target_tokens or 20 * self.n_params)
        if target > MAX_TOKENS:
            raise PPTError(
                f"--target-flops {args.target_flops:g} is {target:.3g} tokens for this model, more than the "
                f"{MAX_TOKENS:.0e} any run can count; lower --target-flops"
            )
        if target < self.total_batch:
            given = (
                f"--target-flops {args.target_flops:g} ({target} tokens)" if args.target_flops else "--target-tokens"
            )
            raise PPTError(
                f"{given} {target} is less than one step of {self.total_batch} tokens (--total-batch-tokens); raise "
                "the budget or lower --total-batch-tokens"
            )
        steps = target // self.total_batch
        warmup_tokens = 0.01 * target if args.warmup_tokens is None else args.warmup_tokens
        if warmup_tokens > target:
            raise PPTError(
                f"--warmup-tokens {warmup_tokens:g} is more than the run's {target} tokens: the learning rate would "
                "never reach its peak; lower --warmup-tokens"
            )
        return TrainSettings(
            seq_len=self.seq_len, total_batch_tokens=self.total_batch, device_batch_size=self.device_batch,
            grad_accum=self.grad_accum, world_size=rt.world_size, optimizer=args.optimizer, lr=self.lr,
            optimizer_groups=optimizer_settings(self.optimizer), weight_decay=args.weight_decay,
            grad_clip=args.grad_clip, schedule=args.schedule, warmup_tokens=warmup_tokens,
            warmup_steps=round(warmup_tokens / self.total_batch), decay_frac=args.decay_frac, steps=steps,
            last_step=min(steps, args.max_steps or steps),  # --max-steps stops early; the schedule is unchanged
            target_tokens=target, budget=budget, doc_masks=not args.no_doc_masks, deterministic=args.deterministic,
            seed=args.seed, data_seed=self.data_seed, model_seed=self.model_seed, dtype=str(rt.dtype),
            compile=self.use_compile, compile_mode=self.compile_mode if self.use_compile else None,
            loader_prefetch=args.loader_prefetch, skip_nonfinite=args.skip_nonfinite, eval_every=args.eval_every,
            eval_tokens=int(args.eval_tokens), recipe=args.recipe,
            ddp_find_unused_parameters=rt.distributed and self.unused_parameters(),
        )  # fmt: skip

    def first_step_doc_pos_counts(self) -> np.ndarray:
        """Document-position counts of the first step's rows, all ranks together: ranks read rows in blocks of a batch,
        so they are the first grad_accum x world batches of one process (which every rank reads alike)."""
        loader = DataLoader(self.data_dir, "train", self.device_batch, self.seq_len, seed=self.data_seed, prefetch=0)
        for _ in range(self.grad_accum * self.rt.world_size):
            next(loader)
        return self.doc_pos_counts(loader)

    def doc_pos_counts(self, loader: DataLoader) -> np.ndarray:
        """The document-position counts of the rows `loader` gave since the last call, as the model saw them: without
        document masks whole rows are the documents, so each position counts once per row."""
        counts = loader.take_doc_pos_counts()
        return np.full(self.seq_len, counts.sum() // self.seq_len, dtype=np.int64) if self.args.no_doc_masks else counts

    def unused_parameters(self) -> bool:
        """Under DDP: whether one forward and backward of a row leaves trainable parameters without a gradient on any
        rank (a router's unchosen expert, an early exit): DDP must then look for them after every forward (slower).
        Gradients and RNG are left as found."""
        rt = self.rt
        probe = DataLoader(self.data_dir, "train", 1, self.seq_len, rt.rank, rt.world_size, self.data_seed,
                           rt.device, prefetch=0)  # fmt: skip
        inputs, targets, doc_pos = next(probe)
        rng = ckpt.rng_state()
        with autocast(rt.device, rt.dtype):
            self.model(inputs, targets, None if self.args.no_doc_masks else doc_pos).backward()
        mine = [name for name, p in self.model.named_parameters() if p.requires_grad and p.grad is None]
        self.model.zero_grad(set_to_none=True)
        ckpt.set_rng_state(rng)
        every_rank: list[list[str] | None] = [None] * rt.world_size
        torch.distributed.all_gather_object(every_rank, mine)
        unused = sorted(set().union(*every_rank))
        if unused:
            print0(
                f"note: {len(unused)} parameters got no gradient in a first forward and backward ({few(unused)}); "
                "DDP runs with find_unused_parameters=True, which searches the autograd graph for them after every "
                "forward (slower)"
            )
        return bool(unused)

    def relaunch_args(self) -> dict[str, Any]:
        """Every flag, with what the run derived, so a relaunch trains the same even where defaults change later."""
        s = self.settings
        flags = {k: str(v) if isinstance(v, Path) else v for k, v in vars(self.args).items() if k not in NOT_RELAUNCHED}
        derived = {"config": self.args.config, "tag": self.tag, "data_dir": str(self.data_dir), "lr": s.lr}
        derived |= {"seq_len": s.seq_len, "total_batch_tokens": s.total_batch_tokens, "warmup_tokens": s.warmup_tokens}
        return flags | derived | ({} if self.args.target_flops else {"target_tokens": s.target_tokens})

    def wall_time(self) -> float:
        """Seconds this run has trained: this process's, plus those of earlier ones up to the resumed checkpoint."""
        return self.state.get("wall_time_s", 0.0) + time.perf_counter() - self.started

    def mfu(self, flops_per_token: float, tok_per_s: float) -> float | None:
        """The share of the devices' peak FLOP/s that a throughput uses; None where the peak is unknown."""
        return flops_per_token * tok_per_s / (self.peak * self.rt.world_size) if self.peak else None

    # ---- phase 4: the loop --------------------------------------------------------------------------------------
    def loop(self) -> None:
        """One host sync per step, when the host reads a step's loss and gradient norm. Where the optimizer skips a
        non-finite step on the device (fused AdamW, one CUDA process) the host reads each step a step late: it queues
        step n + 1 before it waits for step n, so the GPU does not idle while the host logs, steps the optimizer and
        launches the next forward (+12-17% tok/s at the study's shapes on one H200, docs/benchmarks.md). A step due
        for an evaluation or a save is read at once. The step time is the time between consecutive reads."""
        args, s = self.args, self.settings
        self.train_iter = iter(self.train_loader)
        self.last_saved, self.stopping = self.step, 0
        self.last_sync = time.perf_counter()
        # fused AdamW takes a found_inf flag and skips a step on the device (not so a resumed unfused state's groups)
        fused = all(g.get("fused") for g in self.optimizer.param_groups)
        self.reads_late = fused and self.rt.device.type in LATE_READ_DEVICES and not self.rt.distributed
        in_flight: QueuedStep | None = None  # queued and updated on the device, not yet read
        while (step := self.step + (in_flight is not None)) < s.last_step:  # the 0-based index of the step to queue
            self.measure.before_step(step)
            if self.stop_signal and not self.rt.distributed:  # a lone process stops before it starts another step
                self.stopping = self.stop_signal[0]
                break
            if step % RULE_REFRESH_STEPS == 0 and step != self.rule_step:  # learned windows move
                self.rule, self.rule_step = self.rule.refreshed(self.model, OP_FORMULAS), step
                self.last_sync = time.perf_counter()  # the refresh's time is not the step's
            set_lr(self.optimizer, lr_multiplier(step, s.steps, s.warmup_steps, s.schedule, s.decay_frac))
            queued = self.forward_backward()
            if not self.reads_late:
                self.settle(queued)
            else:
                self.step_on_device(queued, step + 1)
                if in_flight:
                    self.settle(in_flight)
                in_flight = queued
                if self.due(args.eval_every, step + 1) or self.due(args.save_every, step + 1) or self.stopping:
                    self.settle(in_flight)
                    in_flight = None
            if self.stopping:
                break
        if in_flight:
            self.settle(in_flight)

    def forward_backward(self) -> QueuedStep:
        """The step's micro-batches, queued: its loss and gradient norm stay on the device."""
        loss_sum = torch.zeros((), device=self.rt.device)
        data_time = 0.0
        for micro in range(self.grad_accum):
            t_data = time.perf_counter()
            inputs, targets, doc_pos = next(self.train_iter)
            doc_pos = None if self.args.no_doc_masks else doc_pos
            data_time += time.perf_counter() - t_data
            sync = micro == self.grad_accum - 1 or not self.rt.distributed
            with nullcontext() if sync else self.train_model.no_sync(), autocast(self.rt.device, self.rt.dtype):
                try:
                    loss = self.train_model(inputs, targets, doc_pos)
                except RuntimeError as exc:
                    if error := unused_parameter_error(exc, self.step):
                        raise error from exc
                    raise
            (loss / self.grad_accum).backward()
            loss_sum += loss.detach()
        counts = self.doc_pos_counts(self.train_loader)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.grad_clip or float("inf"))
        stats = torch.stack([loss_sum / self.grad_accum, norm.float()])
        return QueuedStep(stats, counts, self.rule, self.optimizer.param_groups[0]["lr"], data_time)

    def step_on_device(self, queued: QueuedStep, step: int) -> None:
        """Step the optimizer without reading the step: fused AdamW skips it on the device if its loss or gradient
        norm is not finite. The two values start on their way to the host, to be read a step later."""
        self.optimizer.found_inf = queued.stats.isfinite().all().logical_not().float()
        self.measure.optimizer_step(self.optimizer, step)
        self.optimizer.zero_grad(set_to_none=not self.keep_grads)
        queued.stats = queued.stats.to("cpu", non_blocking=True)  # into pinned memory, from a GPU
        if self.rt.device.type == "cuda":
            queued.copied = torch.cuda.Event()
            queued.copied.record()

    def settle(self, done: QueuedStep) -> None:
        """Read a queued step (the host sync) and finish it: skip it if not finite, else step the optimizer (unless
        it stepped on the device), count and log it, and evaluate or save where due."""
        loss, norm, finite, counts = self.sync(done)
        now = time.perf_counter()
        dt, self.last_sync = now - self.last_sync, now
        if self.step == self.start_step:
            # What torch.compile built in this first step lives all run. Freezing takes it out of the garbage
            # collector's full scans, which otherwise pause the host whenever they run (260 ms with a compiled
            # 32-layer model alive, on a 2-core CPU): under DDP one rank's pause holds up every rank.
            freeze_gc()
            self.first_sync = now
        if not finite:  # no update, evaluation or save for this step
            self.skip_step(loss)
            return
        if not self.reads_late:
            self.measure.optimizer_step(self.optimizer, self.step + 1)
            self.optimizer.zero_grad(set_to_none=not self.keep_grads)
        self.step += 1
        self.tokens_seen += self.settings.total_batch_tokens
        self.comparison_flops += done.rule.step_flops(counts)
        self.log_step(done, loss, norm, dt, now)
        if self.stopping:
            return
        if self.due(self.args.eval_every, self.step):
            self.evaluate()
            self.last_sync = time.perf_counter()  # evaluation time is not the next step's
        if self.due(self.args.save_every, self.step):
            self.save()
            self.last_sync = time.perf_counter()
        if self.step % 50 == 0:
            self.write_record()

    def due(self, every: int, step: int) -> bool:
        """Whether an evaluation or a save every `every` steps (0: never) falls after `step` (the last one's is the
        finish's)."""
        return bool(every) and step % every == 0 and step < self.settings.last_step

    def sync(self, done: QueuedStep) -> tuple[float, float, bool, np.ndarray]:
        """(loss averaged over ranks, gradient norm, both finite, every rank's document-position counts). Ranks can
        receive a signal in different steps; the flags ride on the loss all-reduce so that every rank stops after
        the same step (one that stopped alone would leave the others waiting in their next all-reduce). The counts
        ride along for the comparison FLOPs; fp32 holds them exactly (each is at most the step's tokens, < 2^24)."""
        stats, counts = done.stats, done.counts
        flags = [float(sig in self.stop_signal) for sig in (signal.SIGTERM, signal.SIGINT)]
        if self.rt.distributed:
            host = torch.from_numpy(np.concatenate([flags, counts]).astype(np.float32))
            stats = torch.cat([stats, host.to(self.rt.device)])
            torch.distributed.all_reduce(stats)  # summed: the loss and norm are divided by the world size below
            values = stats.cpu().numpy().astype(np.float64)
            loss_sum, norm_sum, flags = float(values[0]), float(values[1]), values[2:4].tolist()
            counts = np.rint(values[4:]).astype(np.int64)
        else:
            if done.copied:
                done.copied.synchronize()
            loss_sum, norm_sum = stats.tolist()
        loss_value, norm_value = loss_sum / self.rt.world_size, norm_sum / self.rt.world_size
        self.stopping = signal.SIGTERM if flags[0] else signal.SIGINT if flags[1] else 0
        return loss_value, norm_value, math.isfinite(loss_value) and math.isfinite(norm_value), counts

    def skip_step(self, loss: float) -> None:
        """A non-finite loss or gradient: stop, or with --skip-nonfinite N skip up to N such steps."""
        self.skipped += 1
        self.optimizer.zero_grad(set_to_none=not self.keep_grads)
        if self.skipped > self.args.skip_nonfinite:
            last = ckpt.latest_checkpoint(self.out_dir) or "none (no save yet)"
            raise PPTError(
                f"non-finite loss/gradient at step {self.step + 1} (loss {loss}); the last good checkpoint is {last}. "
                "Lower --lr, or pass --skip-nonfinite N to skip such steps"
            )
        warn0(
            f"step {self.step + 1}: non-finite loss/gradient, step skipped ({self.skipped}/{self.args.skip_nonfinite})"
        )
        self.step += 1

    def log_step(self, done: QueuedStep, loss: float, norm: float, dt: float, now: float) -> None:
        s, rt, step, lr, data_time = self.settings, self.rt, self.step, done.lr, done.data_time
        tok_per_s = s.total_batch_tokens / dt
        mfu = self.mfu(self.mfu_flops["mfu"], tok_per_s) if self.mfu_flops else None
        memory_key, memory = memory_gb(rt.device)
        entry = {"step": step, "tokens": self.tokens_seen, "comparison_flops": self.comparison_flops,
                 "wall_time_s": self.wall_time(), "loss": loss, "lr": lr, "grad_norm": norm, "tok_per_s": tok_per_s,
                 "step_time": dt, "data_time": data_time, **({"mfu": mfu} if mfu is not None else {}),
                 memory_key: memory}  # fmt: skip
        logged = step % self.args.log_every == 0 or step == s.last_step
        if logged or self.args.benchmark:  # the record keeps the logged steps (a benchmark's summary reads every one)
            self.record.history.append(entry)
        if not logged:
            return
        mfu_text = f" | mfu {100 * mfu:5.1f}%" if mfu is not None else ""
        done = step - self.start_step
        per_step = (now - self.first_sync) / (done - 1) if done > 1 else dt
        print0(
            f"step {step:6d}/{s.steps} ({100 * step / s.last_step:.1f}%) | loss {loss:.4f} | lr {lr:.2e} "
            f"| grad {norm:.3f} | {tok_per_s:,.0f} tok/s | {1000 * dt:.0f} ms{mfu_text} | mem {memory:.2f} GB "
            f"| {duration(self.wall_time())} elapsed, eta {duration(per_step * (s.last_step - step))}"
        )
        if self.wandb_run:
            self.wandb_run.log(for_wandb(entry), step=step)

    def evaluate(self) -> Evaluation:
        rt, s = self.rt, self.settings
        val_loader = DataLoader(
            self.data_dir, "val", self.device_batch, self.seq_len, rt.rank, rt.world_size, 0, rt.device,
            expected_fingerprint=self.tokenizer.fingerprint, vocab_size=self.config.vocab_size,
        )  # fmt: skip
        if not self.record.evals and (shortfall := val_loader.budget_shortfall(s.eval_tokens)):
            warn0(shortfall)  # said once; each evaluation records the tokens it scored
        result = evaluate_bpb(self.eval_model, val_loader.val_batches(s.eval_tokens), self.token_bytes, rt.dtype)
        freeze_gc()  # the first call compiled the evaluation graphs: out of the collector's scans too
        nll, bpb, tokens = result["nll"], result["bpb"], result["tokens"]
        print0(f"step {self.step:6d} | val nll {nll:.4f} | val bpb {bpb:.4f} ({tokens} tokens)")
        evaluation = Evaluation(self.step, self.tokens_seen, self.comparison_flops, self.wall_time(), nll, bpb, tokens)
        self.record.evals.append(evaluation)
        entry = dataclasses.asdict(evaluation)
        self.record.history.append(entry)
        if self.wandb_run:
            self.wandb_run.log(for_wandb(entry), step=self.step)
        return evaluation

    def save(self) -> None:
        self.last_saved = self.step
        if not self.rt.is_master:
            return
        payload = {
            "format": CHECKPOINT_FORMAT,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "config": self.config_dict,
            "settings": dataclasses.asdict(self.settings),
            "loader": self.train_loader.state_dict(),
            "rng": ckpt.rng_state(),
            "tokens": self.tokens_seen,
            "history": self.record.history,
            "skipped_nonfinite_steps": self.skipped,
            "tokenizer_fingerprint": self.tokenizer.fingerprint,
            "comparison": {"flops": self.comparison_flops, "rule": self.rule.state_dict(), "rule_step": self.rule_step},
            "wall_time_s": self.wall_time(),
            "wandb_id": (self.record.wandb or {}).get("id"),
        }
        print0(f"saved {ckpt.save_checkpoint(self.out_dir, self.step, payload, keep=self.args.keep)}")

    def write_record(self) -> None:
        if self.rt.is_master and not self.args.benchmark:  # a benchmark must not replace a real run's record
            self.record.write([self.reports_path, self.out_dir / f"{self.tag}.json"])

    # ---- phase 5: the end of the run: save first, so an evaluation crash loses nothing -------------------------
    def finish(self) -> None:
        if self.measure.end(self):  # --benchmark: the summary instead of a finished run
            shutdown_runtime()
            return
        if self.step != self.last_saved:
            self.save()
        record = self.record
        record.skipped_nonfinite_steps = self.skipped
        if self.stopping:
            print0(f"stopped by signal {self.stopping} at step {self.step}; resume with --resume auto")
            record.stopped_at = self.step
            self.write_record()
            shutdown_runtime()
            sys.exit(128 + self.stopping)
        final = self.evaluate()
        record.steps_done, record.tokens, record.comparison_flops = self.step, self.tokens_seen, self.comparison_flops
        record.wall_time_s, record.finished = final.wall_time_s, time.strftime("%Y-%m-%dT%H:%M:%S%z")
        self.write_record()
        if self.rt.is_master:
            print0(f"report: {self.reports_path}")
            if plot := plot_losses(record, self.out_dir / f"{self.tag}_loss.png"):
                print0(f"loss curve: {plot}")
            print0(f"checkpoint: {ckpt.latest_checkpoint(self.out_dir)}")
        if self.wandb_run:
            self.wandb_run.finish()
        shutdown_runtime()


class Measurement:
    """--benchmark and --profile, outside the loop: it calls these hooks, which for a training run only step the
    optimizer. --benchmark measures instead of training for keeps: no checkpoints, evaluations or record, the
    optimizer timed apart, and a JSON summary over the steps after the first five (compilation and warm-up),
    leaving out the steps the profiler slowed down."""

    def __init__(self, args: argparse.Namespace, rt: Runtime) -> None:
        self.benchmark, self.device = args.benchmark, rt.device
        self.profiler = StepProfiler(rt.device, first=5, steps=3) if args.profile and rt.is_master else None
        self.profiled_steps: set[int] = set()
        self.optimizer_times: dict[int, Callable[[], float]] = {}  # by step; read at the end, never waiting for the GPU

    def before_step(self, step: int) -> None:
        if self.profiler and self.profiler.step():  # slows the step it queues and, read a step late, the one before
            self.profiled_steps |= {step, step + 1}

    def optimizer_step(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        if self.benchmark:
            self.optimizer_times[step] = timed(optimizer.step, self.device)
        else:
            optimizer.step()

    def end(self, trainer: Trainer) -> bool:
        """Stop the profiler; under --benchmark print the summary and return True."""
        if self.profiler:
            self.profiler.stop()
        if not self.benchmark:
            return False
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # the last optimizer step's events
        steps = [h for h in trainer.record.history if "step_time" in h]
        after_warmup = [(h, self.optimizer_times[h["step"]]()) for h in steps][5:]
        kept = [(h, seconds) for h, seconds in after_warmup if h["step"] not in self.profiled_steps]
        if not kept:
            raise PPTError("--benchmark needs more than 5 steps (more than 9 with --profile); raise --max-steps")
        measured = [h for h, _ in kept]
        step_time = statistics.fmean(h["step_time"] for h in measured)
        tok_per_s = statistics.fmean(h["tok_per_s"] for h in measured)
        summary = {
            "params": trainer.n_params,
            "steps_measured": len(measured),
            "steps_profiled_left_out": len(after_warmup) - len(kept),
            "tok_per_s": tok_per_s,
            "step_time_s": step_time,
            "data_share": statistics.fmean(h["data_time"] for h in measured) / step_time,
            "optimizer_share": statistics.fmean(seconds for _, seconds in kept) / step_time,
        }
        per_token = measured[-1]["comparison_flops"] / measured[-1]["tokens"]  # the rule's, over the run so far
        summary |= {"comparison_flops_per_token": per_token, "comparison_tflops": per_token * tok_per_s / 1e12}
        if flops := trainer.mfu_flops:
            summary |= {"flops_per_token": flops["mfu"], "flops_per_token_6n": flops["6n"]}
            if trainer.peak:
                summary["mfu"] = trainer.mfu(flops["mfu"], tok_per_s)
                summary["mfu_6n"] = trainer.mfu(flops["6n"], tok_per_s)
        if torch.cuda.is_available():
            summary["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
        print0("benchmark " + json.dumps(summary))
        return True


def compile_mode(choice: str, rt: Runtime) -> str:
    """--compile-mode with auto resolved: CUDA graphs (reduce-overhead) when one CUDA GPU trains, which take the host
    out of a small model's step (1.0-2.7x the tokens/s at the study's shapes, docs/benchmarks.md); the default mode
    under DDP (its gradient all-reduce hooks with CUDA graphs are untested here) and off CUDA."""
    if choice != "auto":
        return choice
    return "reduce-overhead" if rt.device.type == "cuda" and not rt.distributed else "default"


def allocate_grads(model: torch.nn.Module) -> None:
    """Give every trainable parameter a zero .grad. CUDA graph trees own the memory of a replayed backward's outputs
    and overwrite it at the next replay, so no .grad may be such an output: with .grad allocated (and zeroed, not
    freed, between steps) autograd adds each micro-batch's gradients into it in place."""
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)


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


if __name__ == "__main__":
    run_cli(main)
