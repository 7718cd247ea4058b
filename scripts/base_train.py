"""Pretrain a model from ppt/model.py on prepared shards: the fixed training loop, top to bottom.

python -m scripts.base_train --config smollm-135m --target-tokens 1e9
torchrun --nproc_per_node=8 -m scripts.base_train --config smollm-360m --target-tokens 20e9
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
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch

from ppt import checkpoint as ckpt
from ppt.common import (
    PPTError,
    cache_dir,
    init_runtime,
    maybe_compile,
    print0,
    run_cli,
    shutdown_runtime,
    warn0,
    wrap_ddp,
)
from ppt.data import DataLoader, default_data_dir, load_data_tokenizer
from ppt.flops import mfu_flops_per_token, peak_flops
from ppt.loss_eval import DEFAULT_EVAL_TOKENS, autocast, evaluate_bpb
from ppt.model import CONFIGS, build_model, get_config
from ppt.optim import DEFAULT_LR, build_optimizer, lr_multiplier, set_lr
from ppt.profiling import StepProfiler
from ppt.report import RunReport


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--config", help=f"a named config: {', '.join(CONFIGS)} (default smollm-360m unless --depth)")
    g.add_argument("--depth", type=int, help="the scaling dial: width and heads derived from depth")
    g = p.add_argument_group("data and batch")
    g.add_argument("--data-dir", type=Path, help="prepared shards (default <cache>/data/fineweb-edu)")
    g.add_argument("--seq-len", type=int, help="tokens per row (default min(2048, the config's max_seq_len))")
    g.add_argument("--total-batch-tokens", type=int, help="tokens per optimizer step, all ranks (default 524288)")
    g.add_argument("--device-batch-size", type=int, help="rows per forward on one device; accumulation derived")
    g.add_argument("--target-tokens", type=float, help="training budget in tokens (default 20 x parameters)")
    g = p.add_argument_group("optimization")
    g.add_argument("--optimizer", choices=["adamw", "muon", "aurora"], default="adamw")
    g.add_argument("--lr", type=float, help="peak learning rate (default per optimizer)")
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--schedule", choices=["constant", "cosine", "wsd"], default="wsd")
    g.add_argument("--warmup-tokens", type=float, help="LR warmup length in tokens (default 1%% of the budget)")
    g.add_argument(
        "--no-doc-masks",
        action="store_true",
        help="train on plain causal rows, ignoring document boundaries (to measure what the masks cost)",
    )
    g.add_argument("--grad-clip", type=float, default=1.0, help="max global grad norm (0 disables)")
    g.add_argument("--skip-nonfinite", type=int, default=0, help="skip up to N steps whose loss/grad is NaN/inf")
    g = p.add_argument_group("run")
    g.add_argument("--tag", help="checkpoint/report name (default: the config name or d<depth>)")
    g.add_argument("--out-dir", type=Path, help="checkpoint dir (default <cache>/checkpoints/<tag>)")
    g.add_argument("--eval-every", type=int, default=250, help="steps between val bpb (0: only at the end)")
    g.add_argument(
        "--eval-tokens",
        type=float,
        default=DEFAULT_EVAL_TOKENS,
        help=f"val tokens per evaluation (default {DEFAULT_EVAL_TOKENS:,}; base_eval scores as many)",
    )
    g.add_argument("--save-every", type=int, default=1000, help="steps between checkpoints (0: only at the end)")
    g.add_argument("--keep", type=int, default=3, help="checkpoints to keep (0 keeps all)")
    g.add_argument("--resume", help="'auto' (latest complete checkpoint in --out-dir, if any) or a checkpoint path")
    g.add_argument("--run", help="wandb run name; wandb stays off without it")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--compile", choices=["auto", "on", "off"], default="auto", help="torch.compile (auto: on CUDA)")
    g.add_argument(
        "--compile-mode",
        choices=["default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune"],
        default="default",
        help="torch.compile's mode for the training step (reduce-overhead: CUDA graphs)",
    )
    g.add_argument(
        "--loader-prefetch",
        type=int,
        default=2,
        help="batches a background thread builds ahead (0: built in the main thread, in next())",
    )
    g.add_argument(
        "--deterministic",
        action="store_true",
        help="deterministic kernels only (slower; an op without one stops the run): identical runs, identical losses",
    )
    g.add_argument("--log-every", type=int, default=1)
    g.add_argument("--max-steps", type=int, help="stop at this step without changing the LR schedule (benchmarks)")
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
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Train; the SIGTERM/SIGINT handlers the loop installs and the deterministic setting are put back afterwards
    (main may run in-process)."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        train(parse_args(argv))
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        torch.use_deterministic_algorithms(deterministic)


def train(args: argparse.Namespace) -> None:
    if args.deterministic:  # before the first cuBLAS call, which reads the workspace setting
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)  # an op with no such kernel raises, naming itself
    rt = init_runtime(args.device)
    torch.manual_seed(args.seed)

    # ---- model config, tokenizer and data ----------------------------------------------------------------------
    if args.config is None and args.depth is None:
        args.config = "smollm-360m"
    config = get_config(args.config, args.depth)
    data_dir = args.data_dir or default_data_dir()
    tokenizer = load_data_tokenizer(data_dir)
    if tokenizer.vocab_size != config.vocab_size:
        print0(
            f"note: vocab_size {config.vocab_size} -> {tokenizer.vocab_size} to match {tokenizer.name} in {data_dir}"
        )
        config = dataclasses.replace(config, vocab_size=tokenizer.vocab_size)
    seq_len = args.seq_len or min(2048, config.max_seq_len)
    if seq_len > config.max_seq_len:
        raise PPTError(f"--seq-len {seq_len} exceeds the config's max_seq_len {config.max_seq_len}; lower --seq-len")
    total_batch = args.total_batch_tokens or 524_288
    device_batch = args.device_batch_size or max(1, min(32, total_batch // (seq_len * rt.world_size)))
    tokens_per_micro = device_batch * seq_len * rt.world_size
    if total_batch % tokens_per_micro:
        raise PPTError(
            f"--total-batch-tokens {total_batch} is not divisible by device batch x seq-len x world "
            f"({device_batch} x {seq_len} x {rt.world_size} = {tokens_per_micro}); choose sizes that divide"
        )
    grad_accum = total_batch // tokens_per_micro

    # ---- model, built on meta then materialized, so a 360M model never allocates twice ------------------------
    with torch.device("meta"):
        model = build_model(config)
    model.to_empty(device=rt.device)
    model.init_weights()
    n_params = sum(p.numel() for p in model.parameters())
    target_tokens = int(args.target_tokens or 20 * n_params)
    total_steps = max(1, target_tokens // total_batch)
    last_step = min(total_steps, args.max_steps or total_steps)  # --max-steps stops early; the schedule is unchanged
    flops = mfu_flops_per_token(model, seq_len)
    peak = peak_flops(rt.device, rt.dtype)

    optimizer = build_optimizer(
        model, args.optimizer, lr=args.lr or DEFAULT_LR[args.optimizer], weight_decay=args.weight_decay
    )
    warmup_steps = round((args.warmup_tokens or 0.01 * target_tokens) / total_batch)
    train_loader = DataLoader(
        data_dir,
        "train",
        device_batch,
        seq_len,
        rt.rank,
        rt.world_size,
        args.seed,
        rt.device,
        expected_fingerprint=tokenizer.fingerprint,
        prefetch=args.loader_prefetch,
    )
    token_bytes = tokenizer.token_bytes().to(rt.device)

    # ---- output dir and resume ---------------------------------------------------------------------------------
    tag = args.tag or args.config or f"d{args.depth}"
    out_dir = args.out_dir or cache_dir() / "checkpoints" / tag
    if rt.is_master:
        ckpt.ensure_writable(out_dir, needed_bytes=n_params * 4 * 3)
    config_dict = {"class": type(config).__name__, **dataclasses.asdict(config)}
    start_step, tokens_seen, history, skipped = 0, 0, [], 0
    resume_path = None
    if args.resume == "auto":
        resume_path = ckpt.latest_checkpoint(out_dir) if rt.is_master else None
    elif args.resume:
        resume_path = Path(args.resume)
    if rt.distributed:  # rank 0 picks, so every rank resumes from the same checkpoint (it must be readable by all)
        chosen = [resume_path]
        torch.distributed.broadcast_object_list(chosen, src=0)
        resume_path = chosen[0]
    if resume_path is not None:
        state = ckpt.load_checkpoint(resume_path, map_location=rt.device)
        if diff := ckpt.config_mismatch(state["config"], config_dict):
            raise PPTError(f"checkpoint {resume_path} is from another config: " + "; ".join(diff))
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        train_loader.load_state_dict(state["loader"])
        ckpt.set_rng_state(state["rng"])
        start_step, tokens_seen, history = state["step"], state["tokens"], state.get("history", [])
        skipped = state.get("skipped_nonfinite_steps", 0)  # the --skip-nonfinite budget spans restarts
        print0(f"resumed from {resume_path} at step {start_step}")

    # ---- compile and DDP --------------------------------------------------------------------------------------
    if args.benchmark:
        args.eval_every = args.save_every = 0
    compiled_model = maybe_compile(model, args.compile, rt.device, args.compile_mode)
    use_compile = compiled_model is not model
    train_model = compiled_model
    if rt.distributed:
        train_model = wrap_ddp(train_model, rt)

    # a benchmark writes no manifest: it must not overwrite the report of a real run with the same tag
    report = RunReport(tag, [cache_dir() / "reports", out_dir], enabled=rt.is_master and not args.benchmark)
    report.history = history
    report.update(
        config=config_dict,
        tokenizer={"name": tokenizer.name, "fingerprint": tokenizer.fingerprint, "demo": tokenizer.is_demo},
        data={"dir": str(data_dir), "fingerprint": train_loader.fingerprint()},
        train={
            "seq_len": seq_len,
            "total_batch_tokens": total_batch,
            "device_batch_size": device_batch,
            "grad_accum": grad_accum,
            "world_size": rt.world_size,
            "optimizer": args.optimizer,
            "lr": args.lr or DEFAULT_LR[args.optimizer],
            "schedule": args.schedule,
            "steps": total_steps,
            "target_tokens": target_tokens,
            "seed": args.seed,
            "dtype": str(rt.dtype),
            "compile": use_compile,
            "compile_mode": args.compile_mode if use_compile else None,
            "loader_prefetch": args.loader_prefetch,
            "eval_tokens": int(args.eval_tokens),  # base_eval scores as many by default
        },
        params=n_params,
        flops_per_token=flops,
    )
    wandb_run = None
    if args.run and rt.is_master:
        import wandb

        wandb_run = wandb.init(project="ppt", name=args.run, config=report.data)

    print0(
        f"{tag}: {n_params / 1e6:.1f}M params, {total_steps} steps x {total_batch} tokens "
        f"(device batch {device_batch} x {seq_len}, accum {grad_accum}, world {rt.world_size}), "
        f"{rt.device} {str(rt.dtype).removeprefix('torch.')}, compile {'on' if use_compile else 'off'}, "
        f"{flops['mfu'] / 1e9:.3f} GFLOP/token"
    )
    epochs = total_steps * total_batch / train_loader.tokens_per_epoch
    if epochs > 1:
        warn0(f"the budget is {epochs:.1f} epochs of {data_dir}: data repeats (prepare more shards to avoid it)")

    stop_signal: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop_signal.append(signum))

    def sync_step(train_loss: torch.Tensor, grad_norm: torch.Tensor) -> tuple[float, bool, int]:
        """The step's one host sync: (loss averaged over ranks, finite loss and gradient, signal to stop on or 0).
        Ranks can receive a signal in different steps; the flags ride on the loss all-reduce so that every rank
        stops after the same step (one that stopped alone would leave the others waiting in their next all-reduce).
        """
        stats = torch.stack([train_loss, grad_norm.float()])
        flags = [float(sig in stop_signal) for sig in (signal.SIGTERM, signal.SIGINT)]
        if rt.distributed:
            stats = torch.cat([stats, torch.tensor(flags, device=rt.device)])
            torch.distributed.all_reduce(stats)  # summed: the loss is divided by the world size below
            loss_sum, norm_sum, *flags = stats.tolist()
        else:
            loss_sum, norm_sum = stats.tolist()
        loss = loss_sum / rt.world_size
        stop = signal.SIGTERM if flags[0] else signal.SIGINT if flags[1] else 0
        return loss, math.isfinite(loss) and math.isfinite(norm_sum), int(stop)

    def save(step: int) -> None:
        if rt.is_master:
            payload = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "config": config_dict,
                "loader": train_loader.state_dict(),
                "rng": ckpt.rng_state(),
                "tokens": tokens_seen,
                "history": report.history,
                "skipped_nonfinite_steps": skipped,
                "tokenizer_fingerprint": tokenizer.fingerprint,
            }
            path = ckpt.save_checkpoint(out_dir, step, payload, keep=args.keep)
            print0(f"saved {path}")

    def evaluate(step: int) -> dict[str, float]:
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
        )
        result = evaluate_bpb(compiled_model, val_loader.val_batches(int(args.eval_tokens)), token_bytes, rt.dtype)
        freeze_gc()  # the first call compiled the evaluation graphs: out of the collector's scans too
        print0(
            f"step {step:6d} | val nll {result['nll']:.4f} | val bpb {result['bpb']:.4f} ({result['tokens']} tokens)"
        )
        report.log_step(step=step, tokens=tokens_seen, val_nll=result["nll"], val_bpb=result["bpb"])
        return result

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
    while step < last_step:
        if profiler and profiler.step():
            profiled_steps.add(step + 1)
        if stop_signal and not rt.distributed:  # a lone process stops before it starts another step
            stopping = stop_signal[0]
            break
        set_lr(optimizer, lr_multiplier(step, total_steps, warmup_steps, args.schedule))
        loss_sum = torch.zeros((), device=rt.device)
        data_time = 0.0
        for micro in range(grad_accum):
            t_data = time.perf_counter()
            inputs, targets, doc_pos = next(train_iter)
            doc_pos = None if args.no_doc_masks else doc_pos
            data_time += time.perf_counter() - t_data
            sync = micro == grad_accum - 1 or not rt.distributed
            with nullcontext() if sync else train_model.no_sync(), autocast(rt.device, rt.dtype):
                loss = train_model(inputs, targets, doc_pos)
            (loss / grad_accum).backward()
            loss_sum += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip or float("inf"))
        loss_value, finite, stopping = sync_step(loss_sum / grad_accum, grad_norm)
        now = time.perf_counter()
        dt, last_sync = now - last_sync, now
        if step == start_step:
            # What torch.compile built in this first step lives all run. Freezing takes it out of the garbage
            # collector's full scans, which otherwise pause the host whenever they run (260 ms with a compiled
            # 32-layer model alive, on a 2-core CPU): under DDP one rank's pause holds up every rank.
            freeze_gc()
        if not finite:
            skipped += 1
            optimizer.zero_grad(set_to_none=True)
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
        optimizer.zero_grad(set_to_none=True)
        step += 1
        tokens_seen += total_batch
        tok_per_s = total_batch / dt
        mfu = flops["mfu"] * tok_per_s / (peak * rt.world_size) if peak else None
        report.log_step(
            step=step,
            tokens=tokens_seen,
            loss=loss_value,
            lr=optimizer.param_groups[0]["lr"],
            tok_per_s=tok_per_s,
            step_time=dt,
            data_time=data_time,
            **({"mfu": mfu} if mfu is not None else {}),
        )
        if step % args.log_every == 0 or step == last_step:
            mfu_text = f" | mfu {100 * mfu:5.1f}%" if mfu is not None else ""
            print0(
                f"step {step:6d}/{total_steps} | loss {loss_value:.4f} | lr {optimizer.param_groups[0]['lr']:.2e} "
                f"| {tok_per_s:,.0f} tok/s | {1000 * dt:.0f} ms{mfu_text}"
            )
            if wandb_run:
                wandb_run.log(report.history[-1], step=step)
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
    flops: dict,
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
        "flops_per_token": flops["mfu"],
        "flops_per_token_6n": flops["6n"],
    }
    if peak:
        summary["mfu"] = flops["mfu"] * tok_per_s / (peak * rt.world_size)
        summary["mfu_6n"] = flops["6n"] * tok_per_s / (peak * rt.world_size)
    if torch.cuda.is_available():
        summary["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
    return summary


if __name__ == "__main__":
    run_cli(main)
