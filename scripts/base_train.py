"""Pretrain a model from ppt/model.py on prepared shards: the fixed training loop, top to bottom. Its flags (usage:
--help) resolve first, into one Settings, before anything is built: scripts/train_settings.py."""

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
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch

import ppt.model
from ppt import checkpoint as ckpt
from ppt.common import MAX_TOKENS, PPTError, few, init_runtime, print0, run_cli, shutdown_runtime, warn0, wrap_ddp
from ppt.comparison_flops import ComparisonFlops, comparison_flops_rule
from ppt.data import DataLoader
from ppt.devices import peak_flops
from ppt.flops import NO_FORMULAS, mfu_flops_per_token, traced_step
from ppt.formatting import duration
from ppt.locks import hold_lock, lock_directory, locks_held, missing_dirs, release_locks
from ppt.loss_eval import autocast, evaluate_bpb
from ppt.memory import check_memory
from ppt.model import build_model
from ppt.optim import build_optimizer, lr_multiplier, set_lr
from ppt.profiling import StepProfiler
from ppt.run import Evaluation, RunRecord, TrainSettings, plot_losses
from scripts.train_settings import parse_args, record_settings, resolve

OP_FORMULAS = getattr(ppt.model, "OP_FORMULAS", NO_FORMULAS)  # optional in model.py (SPEC.md)
# The comparison-FLOPs rule is refreshed every this many steps (learned windows move), on a schedule that does not
# depend on --log-every or on where a run was resumed, so an interrupted run counts what an uninterrupted one does.
RULE_REFRESH_STEPS = 50
RECORD_EVERY_STEPS = 50  # the run record is rewritten this often, so that a killed run's record shows its progress
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # torch.compile modes that replay the step from CUDA graphs
# Devices that run queued work while the host goes on: there each step is read a step late (train_step). A CPU
# computes as the host queues, so reading late would gain nothing and time each step by its successor's work.
LATE_READ_DEVICES = ("cuda",)
CHECKPOINT_FORMAT = 2  # a checkpoint records its settings (TrainSettings), which a resume must continue


def main(argv: list[str] | None = None) -> None:
    """Train, then put back the signal handlers and the deterministic setting (main may run in-process)."""
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
    """A step whose forward and backward are queued: its loss and gradient norm (`stats`: on the device, or on their
    way to the host once `copied` has passed) and what its log needs; loss, grad_norm and step_time once read."""

    stats: torch.Tensor
    counts: np.ndarray
    rule: ComparisonFlops
    lr: float
    data_time: float
    copied: torch.cuda.Event | None = None
    loss: float = math.nan
    grad_norm: float = math.nan
    step_time: float = math.nan

    def send_to_host(self) -> None:
        """Start the loss and gradient norm on their way to the host (into pinned memory, from a GPU)."""
        on_cuda = self.stats.is_cuda
        self.stats = self.stats.to("cpu", non_blocking=True)
        if on_cuda:
            self.copied = torch.cuda.Event()
            self.copied.record()


class Trainer:
    """One run: its Settings, what they name built (model, optimizer, data, output directory, a resumed state), what
    needs the model planned (the budget and schedule, compilation, the record), the loop of train_steps, the finish."""

    def __init__(self, args: argparse.Namespace, argv: list[str]) -> None:
        self.started = time.perf_counter()
        if args.deterministic:  # before the first cuBLAS call, which reads the workspace setting
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)  # an op with no such kernel raises, naming itself
        self.rt = init_runtime(args.device)
        self.settings = resolve(args, argv, self.rt)
        self.build()
        self.plan()
        self.measure = Measurement(self)
        self.stop_signal: list[int] = []
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: self.stop_signal.append(signum))

    # ---- model, optimizer, data, output directory, and the state a resume brings --------------------------------
    def build(self) -> None:
        s, rt = self.settings, self.rt
        torch.manual_seed(s.model_seed)  # the weights' initialization; the data order has its own seed
        with torch.device("meta"):  # built on meta, then materialized: a 360M model never allocates twice
            self.model = build_model(s.config)
        check_memory(self.model, s.device_batch_size, s.seq_len, rt, OP_FORMULAS, eager=not s.compile)
        self.model.to_empty(device=rt.device)
        self.model.init_weights()
        self.n_params = sum(p.numel() for p in self.model.parameters())
        self.optimizer = build_optimizer(self.model, s.optimizer, lr=s.lr, weight_decay=s.weight_decay,
                                         compile=s.compile)  # fmt: skip
        self.train_loader = DataLoader(
            s.data_dir, "train", s.device_batch_size, s.seq_len, rt.rank, rt.world_size, s.data_seed, rt.device,
            expected_fingerprint=s.tokenizer.fingerprint, prefetch=s.loader_prefetch, vocab_size=s.config.vocab_size,
        )  # fmt: skip
        self.token_bytes = s.tokenizer.token_bytes().to(rt.device)
        if rt.is_master:
            made = missing_dirs(s.out_dir), missing_dirs(s.reports_path.parent)
            ckpt.ensure_writable(s.out_dir, needed_bytes=self.n_params * 4 * 3)
            if not s.benchmark:  # one run per checkpoint directory and per run name (it names the record)
                lock_directory(s.out_dir, "give this run another --tag or --out-dir", made[0])
                hold_lock(s.reports_path.with_name(f".{s.tag}.lock"), f"the run name {s.tag!r}",
                          "give this run another --tag", made[1])  # fmt: skip
        self.state = self.resumed_state()
        self.step = self.start_step = self.state.get("step", 0)
        self.tokens_seen = self.state.get("tokens", 0)
        self.skipped = self.state.get("skipped_nonfinite_steps", 0)  # the --skip-nonfinite budget spans restarts

    def resumed_state(self) -> dict[str, Any]:
        """The checkpoint --resume names, loaded into the model, optimizer, loader and RNGs ({} for a fresh run)."""
        s, rt = self.settings, self.rt
        if s.resume == "auto":
            path = ckpt.latest_checkpoint(s.out_dir) if rt.is_master else None
        else:
            path = Path(s.resume) if s.resume else None
        if rt.distributed:  # rank 0 picks, so every rank resumes from the same checkpoint (readable by all)
            chosen = [path]
            torch.distributed.broadcast_object_list(chosen, src=0)
            path = chosen[0]
        if path is None:
            if rt.is_master and not s.benchmark:
                # a fresh run here would prune the new checkpoints and evaluate the earlier run's
                if earlier := ckpt.list_checkpoints(s.out_dir):
                    raise PPTError(f"{s.out_dir} holds checkpoints of an earlier run (up to step {earlier[-1][0]}); "
                                   f"{self.resume_advice()}give this run another --tag or --out-dir")  # fmt: skip
                self.check_run_name_free()
            return {}
        state = ckpt.load_checkpoint(path, map_location=rt.device)
        if state.get("format") != CHECKPOINT_FORMAT:
            raise PPTError(
                f"checkpoint {path} is of format {state.get('format', 1)}, not {CHECKPOINT_FORMAT}: resume it with the "
                "ppt commit its run record names (git.commit), or start a new run"
            )
        if diff := ckpt.config_mismatch(state["config"], s.config_dict):
            raise PPTError(f"checkpoint {path} is from another config: " + "; ".join(diff))
        here, trained_on = self.train_loader.fingerprint(), state.get("data_fingerprint")  # None: an older checkpoint
        if trained_on not in (None, here):
            raise PPTError(
                f"checkpoint {path} trained on other data (fingerprint {trained_on[:12]}) than {s.data_dir} holds "
                f"({here[:12]}): resume with the --data-dir it trained on, or start a new run"
            )
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.train_loader.load_state_dict(state["loader"])
        ckpt.set_rng_state(state["rng"])
        self.resume_path = path
        print0(f"resumed from {path} at step {state['step']}")
        return state

    def resume_advice(self) -> str:
        """What to say of an earlier run's checkpoints in this run's folder: to resume them only where that can work."""
        s = self.settings
        newest = None if s.resume == "auto" else ckpt.latest_checkpoint(s.out_dir)  # auto looked, and none loaded
        if newest is None:
            return "none of them loads (see above): delete them, or "
        saved = torch.load(newest, map_location="cpu", weights_only=True, mmap=True).get("config", {})
        if differences := ckpt.config_mismatch(saved, s.config_dict):
            return f"they are another model's ({differences[0]}): "
        return "continue it with --resume auto, or "

    def check_run_name_free(self) -> None:
        """A fresh run may not take the name of a finished or stopped run elsewhere: its record would be replaced."""
        s = self.settings
        try:
            other = RunRecord.load(s.reports_path).out_dir
        except PPTError:  # no record by that name, or none that can be read
            return
        if other is not None and Path(other).resolve() != s.out_dir.resolve():
            raise PPTError(
                f"the run name {s.tag!r} is taken by the run in {other} ({s.reports_path}); give this run "
                "another --tag, or delete that record to reuse the name"
            )

    # ---- what needs the model: FLOPs, the budget and schedule, compilation, the record --------------------------
    def plan(self) -> None:
        s, rt, state = self.settings, self.rt, self.state
        try:  # one traced step of the (resumed) model: the MFU convention's FLOPs, and the comparison rule's mixers
            trace = traced_step(self.model, 1, s.seq_len, torch.bfloat16, backward=True, formulas=OP_FORMULAS)
            self.mfu_flops, untraced = mfu_flops_per_token(self.model, s.seq_len, OP_FORMULAS, trace), None
        except PPTError as exc:  # a forward that does not run on meta trains all the same, without MFU
            trace, self.mfu_flops, untraced = None, None, str(exc)
        self.peak = peak_flops(rt.device, rt.dtype)
        if "comparison" in state:  # the comparison rule: what runs are compared by
            self.rule = ComparisonFlops.from_state_dict(state["comparison"]["rule"])
            self.rule_step, self.comparison_flops = state["comparison"]["rule_step"], state["comparison"]["flops"]
        else:
            self.rule = comparison_flops_rule(self.model, s.seq_len, OP_FORMULAS, trace)
            self.rule_step, self.comparison_flops = 0, 0
        warnings = [rule_warning] if (rule_warning := self.rule.warning()) else []
        if untraced:  # one line when the rule's warning already says why the trace failed
            warnings = [f"{warnings[0]}; no MFU either"] if self.rule.untraced else [f"no MFU: {untraced}", *warnings]
        for warning in warnings:
            warn0(warning)

        self.derived = d = self.derive()
        if state and (diff := d.resume_mismatch(TrainSettings(**state["settings"]))):
            raise PPTError(
                f"{self.resume_path} trained with other settings ({'; '.join(diff)}): its schedule and data order "
                "would not continue. Resume with the settings it recorded, or start a new run"
            )
        compiled = torch.compile(self.model, mode=s.compile_mode) if s.compile else self.model
        self.eval_model = self.train_model = compiled
        if rt.distributed:
            self.train_model = wrap_ddp(compiled, rt, find_unused_parameters=d.ddp_find_unused_parameters)
        self.keep_grads = s.compile_mode in CUDA_GRAPH_MODES
        if self.keep_grads:  # under CUDA graphs every .grad is allocated once and zeroed, not freed (allocate_grads)
            allocate_grads(self.model)

        self.record = RunRecord(
            run=s.tag, out_dir=str(s.out_dir), argv=s.argv, config_name=s.config_name, config=s.config_dict,
            args=s.flags | {"warmup_tokens": d.warmup_tokens}  # what a relaunch (--from-manifest) trains
                 | ({} if s.target_flops else {"target_tokens": d.target_tokens}),
            tokenizer={"name": s.tokenizer.name, "fingerprint": s.tokenizer.fingerprint, "demo": s.tokenizer.is_demo},
            data={"dir": str(s.data_dir), "fingerprint": self.train_loader.fingerprint()},
            train=d, params=self.n_params, flops_per_token=self.mfu_flops,
            comparison_flops_rule={"per_token_one_document_per_row": self.rule.per_token(),
                                   "traced_at_step": self.rule_step, **self.rule.state_dict(),
                                   **({"warning": rule_warning} if rule_warning else {})},
            history=state.get("history", []), skipped_nonfinite_steps=self.skipped,
        )  # fmt: skip
        self.record.evals = [Evaluation(**h) for h in self.record.history if "val_bpb" in h]
        self.wandb_run = None
        if s.run and rt.is_master:
            import wandb

            self.wandb_run = wandb.init(project="ppt", name=s.run, id=state.get("wandb_id"), resume="allow",
                                        config=self.record.to_dict())  # fmt: skip
            self.record.wandb = {"project": "ppt", "name": s.run, "id": self.wandb_run.id}

        mfu_text = f"{self.mfu_flops['mfu'] / 1e9:.4g}G" if self.mfu_flops else "not traced"
        print0(
            f"{s.tag}: {self.n_params / 1e6:.1f}M params, {d.steps} steps x {s.total_batch_tokens} tokens "
            f"(device batch {s.device_batch_size} x {s.seq_len}, accum {s.grad_accum}, world {rt.world_size}), "
            f"{rt.device} {str(rt.dtype).removeprefix('torch.')}, compile {'on' if s.compile else 'off'}, "
            f"FLOPs/token {mfu_text} (MFU convention), "
            f"{self.rule.per_token() / 1e9:.4g}G (comparison rule, one document per row)"
        )
        epochs = d.steps * s.total_batch_tokens / self.train_loader.tokens_per_epoch
        if epochs > 1:
            warn0(f"the budget is {epochs:.1f} epochs of {s.data_dir}: data repeats (prepare more shards to avoid it)")

    def derive(self) -> TrainSettings:
        """The record's settings, with those that need the model: the budget in tokens (--target-flops converted once,
        at the start, by the rule and the first step's documents), the schedule, the optimizer's groups, DDP's need."""
        s = self.settings
        budget = self.state.get("settings", {}).get("budget")
        if s.target_flops and (budget or {}).get("target_flops") != s.target_flops:
            per_token = self.rule.per_token(self.first_step_doc_pos_counts())  # alike on every rank
            budget = {
                "target_flops": s.target_flops,
                "comparison_flops_per_token_estimate": per_token,
                "estimated_from": f"the first step's document positions and the model at step {self.step}",
                "target_tokens": int(s.target_flops / per_token),
            }
        target = int(budget["target_tokens"] if s.target_flops else s.target_tokens or 20 * self.n_params)
        if target > MAX_TOKENS:
            raise PPTError(
                f"--target-flops {s.target_flops:g} is {target:.3g} tokens for this model, more than the "
                f"{MAX_TOKENS:.0e} any run can count; lower --target-flops"
            )
        if target < s.total_batch_tokens:
            given = f"--target-flops {s.target_flops:g} ({target} tokens)" if s.target_flops else "--target-tokens"
            raise PPTError(
                f"{given} {target} is less than one step of {s.total_batch_tokens} tokens (--total-batch-tokens); "
                "raise the budget or lower --total-batch-tokens"
            )
        steps = target // s.total_batch_tokens
        warmup_tokens = 0.01 * target if s.warmup_tokens is None else s.warmup_tokens
        if warmup_tokens > target:
            raise PPTError(
                f"--warmup-tokens {warmup_tokens:g} is more than the run's {target} tokens: the learning rate would "
                "never reach its peak; lower --warmup-tokens"
            )
        if s.benchmark and min(steps, s.max_steps or steps) <= (9 if s.profile else 5):  # said now, not after training
            raise PPTError("--benchmark needs more than 5 steps (more than 9 with --profile); raise --max-steps")
        return record_settings(
            s, self.rt, target_tokens=target, budget=budget, steps=steps, last_step=min(steps, s.max_steps or steps),
            warmup_tokens=warmup_tokens, warmup_steps=round(warmup_tokens / s.total_batch_tokens),
            optimizer_groups=[{k: v for k, v in g.items() if k not in ("params", "lr")}  # no tensors, no current lr
                              for g in self.optimizer.param_groups],
            ddp_find_unused_parameters=self.rt.distributed and self.unused_parameters(),
        )  # fmt: skip

    def first_step_doc_pos_counts(self) -> np.ndarray:
        """Document-position counts of the first step's rows, all ranks together: ranks read rows in blocks of a batch,
        so they are the first grad_accum x world batches of one process (which every rank reads alike)."""
        s = self.settings
        loader = DataLoader(s.data_dir, "train", s.device_batch_size, s.seq_len, seed=s.data_seed, prefetch=0)
        for _ in range(s.grad_accum * self.rt.world_size):
            next(loader)
        return self.doc_pos_counts(loader)

    def doc_pos_counts(self, loader: DataLoader) -> np.ndarray:
        """The document-position counts of the rows `loader` gave since the last call, as the model saw them: without
        document masks whole rows are the documents, so each position counts once per row."""
        counts, seq_len = loader.take_doc_pos_counts(), self.settings.seq_len
        return counts if self.settings.doc_masks else np.full(seq_len, counts.sum() // seq_len, dtype=np.int64)

    def unused_parameters(self) -> bool:
        """Under DDP: whether one forward and backward of a row leaves trainable parameters without a gradient on any
        rank (a router's unchosen expert, an early exit), which DDP must then look for. Gradients and RNG as found."""
        s, rt = self.settings, self.rt
        probe = DataLoader(s.data_dir, "train", 1, s.seq_len, rt.rank, rt.world_size, s.data_seed, rt.device,
                           prefetch=0)  # fmt: skip
        inputs, targets, doc_pos = next(probe)
        rng = ckpt.rng_state()
        with autocast(rt.device, rt.dtype):
            self.model(inputs, targets, doc_pos if s.doc_masks else None).backward()
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

    def wall_time(self) -> float:
        """Seconds this run has trained: this process's, plus those of earlier ones up to the resumed checkpoint."""
        return self.state.get("wall_time_s", 0.0) + time.perf_counter() - self.started

    def mfu(self, flops_per_token: float, tok_per_s: float) -> float | None:
        """The share of the devices' peak FLOP/s that a throughput uses; None where the peak is unknown."""
        return flops_per_token * tok_per_s / (self.peak * self.rt.world_size) if self.peak else None

    # ---- the loop -----------------------------------------------------------------------------------------------
    def loop(self) -> None:
        """Train to the last step, one train_step at a time. A lone process stops before its next step once signalled;
        ranks stop together, after the step whose read carried the signal (read)."""
        s = self.settings
        self.batches = iter(self.train_loader)
        self.last_saved, self.stopping, self.last_read = self.step, 0, time.perf_counter()
        self.in_flight: QueuedStep | None = None  # read late: queued and updated on the device, not yet read
        # fused AdamW takes a found_inf flag and skips a step on the device (not so a resumed unfused state's groups)
        fused = all(g.get("fused") for g in self.optimizer.param_groups)
        self.reads_late = fused and self.rt.device.type in LATE_READ_DEVICES and not self.rt.distributed
        while (step := self.step + (self.in_flight is not None)) < self.derived.last_step:  # 0-based, to queue
            self.measure.before_step(step)
            if self.stop_signal and not self.rt.distributed:
                self.stopping = self.stop_signal[0]
                break
            if step % RULE_REFRESH_STEPS == 0 and step != self.rule_step:  # learned windows move
                self.rule, self.rule_step = self.rule.refreshed(self.model, OP_FORMULAS), step
                self.last_read = time.perf_counter()  # the refresh's time is not the step's
            self.train_step(step)
            if self.due(s.eval_every, step + 1) or self.due(s.save_every, step + 1) or self.stopping:
                self.read_in_flight()  # a step with an evaluation or a save after it, or a stop, is read at once
            if self.stopping:
                break
        self.read_in_flight()

    def train_step(self, step: int) -> None:
        """Step `step` + 1: batch → forward → backward → clip → optimizer step → zero_grad → history entry. Read at
        once, the optimizer steps once the host has read the loss and gradient norm and found them finite. Read late
        (fused AdamW, one GPU), the optimizer skips a non-finite step on the device, and the host reads the step
        before while this one runs: the GPU does not idle while the host logs and launches (+12-17% tok/s at the
        study's shapes on one H200, docs/benchmarks.md)."""
        s, d = self.settings, self.derived
        set_lr(self.optimizer, lr_multiplier(step, d.steps, d.warmup_steps, s.schedule, s.decay_frac))
        loss_sum, data_time = torch.zeros((), device=self.rt.device), 0.0
        for micro in range(s.grad_accum):
            t_data = time.perf_counter()
            inputs, targets, doc_pos = next(self.batches)
            data_time += time.perf_counter() - t_data
            with self.forward_context(last_micro=micro == s.grad_accum - 1):
                loss = self.train_model(inputs, targets, doc_pos if s.doc_masks else None)
            (loss / s.grad_accum).backward()
            loss_sum += loss.detach()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), s.grad_clip or float("inf"))
        stats = torch.stack([loss_sum / s.grad_accum, norm.float()])
        lr = self.optimizer.param_groups[0]["lr"]
        queued = QueuedStep(stats, self.doc_pos_counts(self.train_loader), self.rule, lr, data_time)
        if self.reads_late:  # fused AdamW skips the update on the device if the step is not finite
            self.optimizer.found_inf = stats.isfinite().all().logical_not().float()
        elif not self.read(queued):  # not finite: skipped, no update
            return
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=not self.keep_grads)
        if self.reads_late:  # on its way to the host, which meanwhile reads the step before
            queued.send_to_host()
            self.read_in_flight()
            self.in_flight = queued
        else:
            self.finish_step(queued)  # counted: its history entry, then an evaluation or a save where due

    @contextmanager
    def forward_context(self, last_micro: bool) -> Iterator[None]:
        """A micro-batch's forward: under autocast; under DDP without the gradient all-reduce but in a step's last
        micro-batch, and DDP's error for parameters without a gradient in the step before as one line with the fix."""
        sync = last_micro or not self.rt.distributed
        with nullcontext() if sync else self.train_model.no_sync(), autocast(self.rt.device, self.rt.dtype):
            try:
                yield
            except RuntimeError as exc:
                if "Expected to have finished reduction in the prior iteration" not in str(exc):
                    raise
                raise PPTError(
                    f"under DDP, some parameters got no gradient in step {self.step} though all had one in a first "
                    "forward and backward before training, so DDP runs without find_unused_parameters; make every "
                    "parameter take part in every step's loss in ppt/model.py (e.g. add 0 * p.sum() for a branch a "
                    "step may skip)"
                ) from exc

    def read(self, done: QueuedStep) -> bool:
        """The host sync: a queued step's loss and gradient norm (averaged over ranks), every rank's document-position
        counts and the stop flags; False for a step that is not finite, which is skipped. The flags ride on the loss
        all-reduce so that every rank stops after the same step, whichever step each was signalled in (one that stopped
        alone would leave the others waiting); fp32 holds the counts exactly (each < the step's tokens < 2^24)."""
        rt = self.rt
        flags = [float(sig in self.stop_signal) for sig in (signal.SIGTERM, signal.SIGINT)]
        if rt.distributed:
            host = torch.from_numpy(np.concatenate([flags, done.counts]).astype(np.float32))
            stats = torch.cat([done.stats, host.to(rt.device)])
            torch.distributed.all_reduce(stats)  # summed: the loss and norm are divided by the world size below
            values = stats.cpu().numpy().astype(np.float64)
            loss_sum, norm_sum, flags = float(values[0]), float(values[1]), values[2:4].tolist()
            done.counts = np.rint(values[4:]).astype(np.int64)
        else:
            if done.copied:
                done.copied.synchronize()
            loss_sum, norm_sum = done.stats.tolist()
        done.loss, done.grad_norm = loss_sum / rt.world_size, norm_sum / rt.world_size
        self.stopping = signal.SIGTERM if flags[0] else signal.SIGINT if flags[1] else 0
        now = time.perf_counter()
        done.step_time, self.last_read = now - self.last_read, now
        if self.step == self.start_step:
            # What torch.compile built in the first step lives all run: frozen, it is out of the collector's full scans,
            # which pause the host (260 ms with a compiled 32-layer model, 2-core CPU) and under DDP every rank.
            freeze_gc()
            self.first_read = now
        if math.isfinite(done.loss) and math.isfinite(done.grad_norm):
            return True
        self.skip_step(done.loss)
        return False

    def read_in_flight(self) -> None:
        """Read the step queued and not yet read (steps read late), if any, and finish it."""
        done, self.in_flight = self.in_flight, None
        if done and self.read(done):
            self.finish_step(done)

    def skip_step(self, loss: float) -> None:
        """A non-finite loss or gradient: stop, or with --skip-nonfinite N skip up to N such steps."""
        self.skipped += 1
        self.optimizer.zero_grad(set_to_none=not self.keep_grads)
        if self.skipped > self.settings.skip_nonfinite:
            last = ckpt.latest_checkpoint(self.settings.out_dir) or "none (no save yet)"
            raise PPTError(
                f"non-finite loss/gradient at step {self.step + 1} (loss {loss}); the last good checkpoint is {last}. "
                "Lower --lr, or pass --skip-nonfinite N to skip such steps"
            )
        warn0(
            f"step {self.step + 1}: non-finite loss/gradient, step skipped ({self.skipped}/"
            f"{self.settings.skip_nonfinite})"
        )
        self.step += 1

    def finish_step(self, done: QueuedStep) -> None:
        """Count a finite step, add its history entry, then evaluate or save where due."""
        s = self.settings
        self.step += 1
        self.tokens_seen += s.total_batch_tokens
        self.comparison_flops += done.rule.step_flops(done.counts)
        self.log_step(done)
        if self.stopping:
            return
        if self.due(s.eval_every, self.step):
            self.evaluate()
            self.last_read = time.perf_counter()  # evaluation time is not the next step's
        if self.due(s.save_every, self.step):
            self.save()
            self.last_read = time.perf_counter()
        if self.step % RECORD_EVERY_STEPS == 0:
            self.write_record()

    def due(self, every: int, step: int) -> bool:
        """Whether an evaluation or a save every `every` steps (0: never) falls after `step` (not the last)."""
        return bool(every) and step % every == 0 and step < self.derived.last_step

    def log_step(self, done: QueuedStep) -> None:
        """The step's history entry (at logged steps, and at every step under --benchmark, whose summary reads them
        all), its log line and its wandb metrics."""
        s, rt, step, last_step = self.settings, self.rt, self.step, self.derived.last_step
        tok_per_s = s.total_batch_tokens / done.step_time
        mfu = self.mfu(self.mfu_flops["mfu"], tok_per_s) if self.mfu_flops else None
        memory_key, memory = memory_gb(rt.device)
        entry = {"step": step, "tokens": self.tokens_seen, "comparison_flops": self.comparison_flops,
                 "wall_time_s": self.wall_time(), "loss": done.loss, "lr": done.lr, "grad_norm": done.grad_norm,
                 "tok_per_s": tok_per_s, "step_time": done.step_time, "data_time": done.data_time,
                 **({"mfu": mfu} if mfu is not None else {}), memory_key: memory}  # fmt: skip
        logged = step % s.log_every == 0 or step == last_step
        if logged or s.benchmark:
            self.record.history.append(entry)
        if not logged:
            return
        mfu_text = f" | mfu {100 * mfu:5.1f}%" if mfu is not None else ""
        steps_done = step - self.start_step
        per_step = (self.last_read - self.first_read) / (steps_done - 1) if steps_done > 1 else done.step_time
        print0(
            f"step {step:6d}/{last_step} ({100 * step / last_step:.1f}%) | loss {done.loss:.4f} "
            f"| lr {done.lr:.2e} | grad {done.grad_norm:.3f} | {tok_per_s:,.0f} tok/s | {1000 * done.step_time:.0f} ms"
            f"{mfu_text} | mem {memory:.2f} GB | {duration(self.wall_time())} elapsed, "
            f"eta {duration(per_step * (last_step - step))}"
        )
        self.log_wandb(entry)

    def evaluate(self) -> Evaluation:
        s, rt = self.settings, self.rt
        val_loader = DataLoader(
            s.data_dir, "val", s.device_batch_size, s.seq_len, rt.rank, rt.world_size, 0, rt.device,
            expected_fingerprint=s.tokenizer.fingerprint, vocab_size=s.config.vocab_size,
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
        self.log_wandb(entry)
        return evaluation

    def log_wandb(self, entry: dict[str, Any]) -> None:
        """wandb's metrics, with integers past 2^53 (cumulative FLOPs) as floats. A resumed wandb run already holds the
        steps a killed run logged after its last checkpoint: those are not sent twice."""
        if self.wandb_run and self.step >= self.wandb_run.starting_step:
            self.wandb_run.log(
                {k: float(v) if isinstance(v, int) and abs(v) > 2**53 else v for k, v in entry.items()}, step=self.step
            )

    def save(self) -> None:
        s = self.settings
        self.last_saved = self.step
        if not self.rt.is_master:
            return
        payload = {
            "format": CHECKPOINT_FORMAT,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "config": s.config_dict,
            "settings": dataclasses.asdict(self.record.train),
            "loader": self.train_loader.state_dict(),
            "rng": ckpt.rng_state(),
            "tokens": self.tokens_seen,
            "history": self.record.history,
            "skipped_nonfinite_steps": self.skipped,
            "tokenizer_fingerprint": s.tokenizer.fingerprint,
            "data_fingerprint": self.train_loader.fingerprint(),
            "comparison": {"flops": self.comparison_flops, "rule": self.rule.state_dict(), "rule_step": self.rule_step},
            "wall_time_s": self.wall_time(),
            "wandb_id": (self.record.wandb or {}).get("id"),
        }
        print0(f"saved {ckpt.save_checkpoint(s.out_dir, self.step, payload, keep=s.keep)}")

    def write_record(self) -> None:
        s = self.settings
        if self.rt.is_master and not s.benchmark:  # a benchmark must not replace a real run's record
            self.record.write([s.reports_path, s.out_dir / f"{s.tag}.json"])

    # ---- the end of the run: save first, so an evaluation crash loses nothing -----------------------------------
    def finish(self) -> None:
        s, record = self.settings, self.record
        if self.measure.end(self):  # --benchmark: the summary instead of a finished run
            shutdown_runtime()
            return
        if self.step != self.last_saved:
            self.save()
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
            print0(f"report: {s.reports_path}")
            if plot := plot_losses(record, s.out_dir / f"{s.tag}_loss.png"):
                print0(f"loss curve: {plot}")
            print0(f"checkpoint: {ckpt.latest_checkpoint(s.out_dir)}")
        if self.wandb_run:
            self.wandb_run.finish()
        shutdown_runtime()


class Measurement:
    """--benchmark and --profile, from outside the step: the profiler steps before each step, and --benchmark's hooks
    on the optimizer time its every step, for a JSON summary over the steps after the first five (compilation and
    warm-up) but those the profiler slowed down."""

    def __init__(self, trainer: Trainer) -> None:
        s, rt = trainer.settings, trainer.rt
        self.benchmark, self.device = s.benchmark, rt.device
        self.profiler = StepProfiler(rt.device, first=5, steps=3) if s.profile and rt.is_master else None
        self.profiled_steps: set[int] = set()
        self.step = 0  # the number of the step the loop queues next
        # by step: the optimizer step's start and end (CUDA events or host seconds), read at the end, never waiting
        self.optimizer_marks: dict[int, list[Any]] = {}
        if s.benchmark:
            trainer.optimizer.register_step_pre_hook(self.mark)
            trainer.optimizer.register_step_post_hook(self.mark)

    def before_step(self, step: int) -> None:
        self.step = step + 1
        if self.profiler and self.profiler.step():  # slows the step it queues and, read a step late, the one before
            self.profiled_steps |= {step, step + 1}

    def mark(self, *_: object) -> None:
        """An optimizer hook: the time the optimizer step starts or ends, on the GPU an event read later."""
        if self.device.type == "cuda":
            now = torch.cuda.Event(enable_timing=True)
            now.record()
        else:
            now = time.perf_counter()
        self.optimizer_marks.setdefault(self.step, []).append(now)

    def optimizer_seconds(self, step: int) -> float:
        start, end = self.optimizer_marks[step]
        return start.elapsed_time(end) / 1000 if self.device.type == "cuda" else end - start

    def end(self, trainer: Trainer) -> bool:
        """Stop the profiler; under --benchmark print the summary and return True."""
        if self.profiler:
            self.profiler.stop()
        if not self.benchmark:
            return False
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # the last optimizer step's events
        after_warmup = [h for h in trainer.record.history if "step_time" in h][5:]
        measured = [h for h in after_warmup if h["step"] not in self.profiled_steps]
        if not measured:
            raise PPTError("--benchmark needs more than 5 steps (more than 9 with --profile); raise --max-steps")
        step_time = statistics.fmean(h["step_time"] for h in measured)
        tok_per_s = statistics.fmean(h["tok_per_s"] for h in measured)
        summary = {
            "params": trainer.n_params,
            "steps_measured": len(measured),
            "steps_profiled_left_out": len(after_warmup) - len(measured),
            "tok_per_s": tok_per_s,
            "step_time_s": step_time,
            "data_share": statistics.fmean(h["data_time"] for h in measured) / step_time,
            "optimizer_share": statistics.fmean(self.optimizer_seconds(h["step"]) for h in measured) / step_time,
        }
        per_token = measured[-1]["comparison_flops"] / measured[-1]["tokens"]  # the rule's, over the run so far
        summary |= {"comparison_flops_per_token": per_token, "comparison_tflops": per_token * tok_per_s / 1e12}
        if flops := trainer.mfu_flops:
            summary |= {"flops_per_token": flops["mfu"], "flops_per_token_6n": flops["6n"]}
            if trainer.peak:
                summary |= {"mfu": trainer.mfu(flops["mfu"], tok_per_s), "mfu_6n": trainer.mfu(flops["6n"], tok_per_s)}
        if torch.cuda.is_available():
            summary["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
        print0("benchmark " + json.dumps(summary))
        return True


def allocate_grads(model: torch.nn.Module) -> None:
    """Give every trainable parameter a zero .grad: CUDA graph trees overwrite a replayed backward's outputs at the
    next replay, so no .grad may be one; allocated (and zeroed, not freed), autograd adds into it in place."""
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)


def memory_gb(device: torch.device) -> tuple[str, float]:
    """The memory figure of the log: CUDA's peak allocated memory, elsewhere the process's peak resident size."""
    if device.type == "cuda":
        return "cuda_max_alloc_gb", torch.cuda.max_memory_allocated(device) / 1e9
    import resource  # POSIX; ru_maxrss is KiB on Linux, bytes on macOS

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return "max_rss_gb", peak * (1 if sys.platform == "darwin" else 1024) / 1e9


def freeze_gc() -> None:
    """gc.freeze(), undone at exit: without the unfreeze libtriton's nanobind finds its frozen objects alive at exit
    and prints ~80 lines of "nanobind: leaked ..." (they are not leaks: the collector was told to skip them)."""
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # once, however often a process (a test session) calls main
    atexit.register(gc.unfreeze)


if __name__ == "__main__":
    run_cli(main)
