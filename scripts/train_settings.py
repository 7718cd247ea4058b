"""Pretrain a model from ppt/model.py on prepared shards.

python -m scripts.base_train --config smollm-135m --target-tokens 1e9
torchrun --nproc_per_node=8 -m scripts.base_train --config smollm-360m --target-tokens 20e9
python -m scripts.base_train --recipe mor                  # the Mixture-of-Recursions Vanilla recipe (SmolLM-360M)
python -m scripts.base_train --from-manifest RUN.json --tag rerun   # relaunch a run from its manifest
python -m scripts.base_train ... --resume auto             # continue a stopped or killed run from its newest checkpoint

A run owns its checkpoint directory and its name (--tag) while it runs: a second run with either stops at once.
"""
# The docstring above is `python -m scripts.base_train --help`. This module holds base_train's flags, recipes and
# relaunch, and resolves them into one Settings before anything is built.

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from ppt.common import (
    COMPILE_CHOICES,
    ArgumentParser,
    Number,
    PPTError,
    Runtime,
    cache_dir,
    compile_enabled,
    nonneg_float,
    nonneg_int,
    nonneg_token_count,
    positive_float,
    positive_int,
    print0,
    run_tag,
    token_count,
    warn0,
)
from ppt.loss_eval import DEFAULT_EVAL_TOKENS
from ppt.model import CONFIGS, DEFAULT_CONFIG, get_config
from ppt.optim import DEFAULT_LR
from ppt.run import RunRecord, TrainSettings
from ppt.shards import check_prepared, default_data_dir, load_data_tokenizer
from ppt.tokenizer import Tokenizer

# Published recipes, as their public configurations state them; flags given beside --recipe override single values.
MOR_BATCH_TOKENS = 2_097_152  # 1024 rows of 2048 tokens
RECIPES: dict[str, dict[str, Any]] = {
    "mor": {  # Mixture-of-Recursions, the Vanilla SmolLM-360M baseline
        "config": "smollm-360m", "seq_len": 2048, "total_batch_tokens": MOR_BATCH_TOKENS, "target_tokens": 19.8e9,
        "optimizer": "adamw", "lr": 3e-3, "weight_decay": 0.1, "grad_clip": 1.0, "schedule": "wsd",
        "warmup_tokens": 57 * MOR_BATCH_TOKENS, "decay_frac": 0.2, "no_doc_masks": True,
    },
}  # fmt: skip
SEED = Number(int, 0, 2**32 - 1)  # what every generator a run seeds takes (numpy's legacy one the least)
TOTAL_BATCH_TOKENS = 524_288  # tokens a step, all ranks together, unless --total-batch-tokens
# A config field of this name, if the config has one, is set to the training row length (SPEC.md, the model contract).
TRAIN_LENGTH_FIELD = "train_seq_len"
# Flags a relaunch does not take from the manifest: how to launch, not what to train
NOT_RELAUNCHED = ("from_manifest", "resume")


@dataclasses.dataclass(frozen=True)
class Settings:
    """Every setting of a run, resolved from its flags before anything is built: the training reads each by this one
    name. Fields named as flags hold the flag's value where resolution has nothing to add; what needs the built
    model (the budget in tokens and steps, the optimizer's groups) is in the record's TrainSettings."""

    config_name: str  # --config, or d<depth>
    config: Any  # ppt/model.py's config dataclass, at the data's vocabulary (and training row length, if it has one)
    config_dict: dict[str, Any]  # {"class": the config class, **its fields}: what records and checkpoints keep
    data_dir: Path
    tokenizer: Tokenizer  # the one that made the shards
    seq_len: int
    total_batch_tokens: int  # all ranks together
    device_batch_size: int
    grad_accum: int
    target_tokens: int | None  # as given; the budget is TrainSettings.target_tokens
    target_flops: float | None
    optimizer: str
    lr: float
    weight_decay: float
    schedule: str
    warmup_tokens: float | None  # as given; the warmup is TrainSettings.warmup_tokens
    decay_frac: float
    doc_masks: bool
    grad_clip: float
    skip_nonfinite: int
    tag: str
    out_dir: Path
    reports_path: Path  # <cache>/reports/<tag>.json
    eval_every: int  # 0 under --benchmark, as save_every
    eval_tokens: int
    save_every: int
    keep: int
    resume: str | None
    run: str | None  # the wandb run's name
    seed: int
    data_seed: int
    model_seed: int
    compile: bool
    compile_mode: str | None  # None when not compiled
    loader_prefetch: int
    deterministic: bool
    log_every: int
    max_steps: int | None
    benchmark: bool
    profile: bool
    recipe: str | None
    argv: list[str]
    flags: dict[str, Any]  # every flag as this run resolved it: what the record keeps for --from-manifest


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("recipe and relaunch")
    g.add_argument("--recipe", choices=sorted(RECIPES), help="a published recipe's settings as defaults; other flags "
                   "override them. mor: " + ", ".join(f"{k}={v}" for k, v in RECIPES["mor"].items()))  # fmt: skip
    g.add_argument("--from-manifest", type=Path, help="relaunch a run: every setting its manifest recorded (the 'args' "
                   "key) becomes the default, flags given beside it override (e.g. --tag NAME to run it again "
                   "elsewhere, --resume auto to continue it)")  # fmt: skip
    g = p.add_argument_group("model")
    g.add_argument("--config", help=f"a named config: {', '.join(CONFIGS)}, or a name ppt/model.py's get_config "
                   f"resolves (its size dials: d12, multiscreen-d16; default {DEFAULT_CONFIG} unless "
                   "--depth)")  # fmt: skip
    g.add_argument("--depth", type=positive_int, help="the scaling dial: width and heads derived from depth (1 to 64)")
    g = p.add_argument_group("data and batch")
    g.add_argument("--data-dir", type=Path, help="prepared shards (default <cache>/data/fineweb-edu)")
    g.add_argument("--seq-len", type=positive_int, help="tokens per row (default min(2048, the config's max_seq_len))")
    g.add_argument("--total-batch-tokens", type=token_count, help="tokens per step, all ranks (default 524288)")
    g.add_argument("--device-batch-size", type=positive_int, help="rows per forward on a device; accumulation derived")
    g.add_argument("--target-tokens", type=token_count, help="training budget in tokens (default 20 x parameters)")
    g.add_argument("--target-flops", type=positive_float, help="training budget in comparison FLOPs instead of tokens: "
                   "converted once, at the start, into tokens (the manifest records the conversion; compare reports "
                   "the FLOPs the run really counted)")  # fmt: skip
    g = p.add_argument_group("optimization")
    g.add_argument("--optimizer", choices=["adamw", "muon", "aurora"], default="adamw")
    # bounded: past ~3e38 an fp32 optimizer step overflows; far below that no run learns
    g.add_argument("--lr", type=Number(float, 0, 1e6, above=True), help="peak learning rate (default per optimizer)")
    g.add_argument("--weight-decay", type=Number(float, 0, 1e6), default=0.1)
    g.add_argument("--schedule", choices=["constant", "cosine", "wsd"], default="wsd")
    g.add_argument("--warmup-tokens", type=nonneg_token_count, help="LR warmup in tokens (default 1%% of the budget)")
    g.add_argument("--decay-frac", type=Number(float, 0, 1), default=0.2,
                   help="wsd: the last fraction of steps, decayed linearly")  # fmt: skip
    g.add_argument("--no-doc-masks", action="store_true", help="plain causal rows, ignoring document boundaries")
    g.add_argument("--doc-masks", dest="no_doc_masks", action="store_false",
                   help="document masks (the default; undoes a recipe's)")  # fmt: skip
    g.add_argument("--grad-clip", type=nonneg_float, default=1.0, help="max global grad norm (0 disables)")
    g.add_argument("--skip-nonfinite", type=nonneg_int, default=0, help="skip up to N steps whose loss/grad is NaN/inf")
    g = p.add_argument_group("run")
    g.add_argument("--tag", type=run_tag, help="checkpoint/report name (default: the config name or d<depth>)")
    g.add_argument("--out-dir", type=Path, help="checkpoint dir (default <cache>/checkpoints/<tag>)")
    g.add_argument("--eval-every", type=nonneg_int, default=250, help="steps between val bpb (0: only at the end)")
    g.add_argument("--eval-tokens", type=token_count, default=DEFAULT_EVAL_TOKENS, help="val tokens per evaluation "
                   f"(default {DEFAULT_EVAL_TOKENS:,}; base_eval scores as many)")  # fmt: skip
    g.add_argument("--save-every", type=nonneg_int, default=1000, help="steps between checkpoints (0: only at the end)")
    g.add_argument("--keep", type=nonneg_int, default=3, help="checkpoints to keep (0 keeps all)")
    g.add_argument("--resume", help="'auto' (latest complete checkpoint in --out-dir, if any) or a checkpoint path")
    g.add_argument("--run", help="wandb run name; wandb stays off without it")
    g.add_argument("--seed", type=SEED, default=0, help="sets --data-seed and --model-seed unless given")
    g.add_argument("--data-seed", type=SEED, help="the order of the training rows: at one data seed, sequence "
                   "length and batch every architecture sees the same tokens in the same order")  # fmt: skip
    g.add_argument("--model-seed", type=SEED, help="the initialization of the weights, and nothing else")
    g.add_argument("--compile", choices=COMPILE_CHOICES, default="auto",
                   help="torch.compile the model, and Muon/Aurora's orthogonalizations (auto: on CUDA)")  # fmt: skip
    g.add_argument("--compile-mode", default="auto",
                   choices=["auto", "default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune"],
                   help="torch.compile's mode for the training step. auto: reduce-overhead (the step replayed from "
                   "CUDA graphs) when one CUDA GPU trains, else default (DDP, CPU, MPS)")  # fmt: skip
    g.add_argument("--loader-prefetch", type=nonneg_int, default=2, help="batches built ahead in a thread (0: none)")
    g.add_argument("--deterministic", action="store_true", help="deterministic kernels only: bitwise repeatable runs")
    g.add_argument("--log-every", type=positive_int, default=1, help="steps between log lines and record entries")
    g.add_argument("--max-steps", type=positive_int, help="stop at this step, the LR schedule unchanged (benchmarks)")
    g.add_argument("--device", help="override the device (cpu, cuda, mps)")
    g.add_argument("--benchmark", action="store_true", help="measure instead of train for keeps: no checkpoints or "
                   "evals, a synchronized phase breakdown per step, a JSON summary at the end (steps after the first "
                   "5 count)")  # fmt: skip
    g.add_argument("--profile", action="store_true", help="torch.profiler over steps 6-8 of this loop: prints where "
                   "their time went (steps 5-9 run slower for it; a --benchmark summary leaves them out)")  # fmt: skip
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


def resolve(args: argparse.Namespace, argv: list[str], rt: Runtime) -> Settings:
    """The flags resolved into Settings, with every check that needs no model: the config at the data's vocabulary,
    the row length, the batch and its accumulation, the output paths, the seeds, compilation."""
    if args.target_flops and args.target_tokens:
        raise PPTError("give the budget as --target-tokens or as --target-flops, not both")
    if args.config is None and args.depth is None:
        args.config = DEFAULT_CONFIG
    config_name = args.config or f"d{args.depth}"
    config = get_config(args.config, args.depth)
    data_dir = args.data_dir or default_data_dir()
    tokenizer = load_data_tokenizer(data_dir)
    if unfinished := check_prepared(data_dir):
        warn0(unfinished)
    if tokenizer.vocab_size != config.vocab_size:
        print0(f"note: vocab_size {config.vocab_size} -> {tokenizer.vocab_size} to match {tokenizer.name}")
        config = dataclasses.replace(config, vocab_size=tokenizer.vocab_size)
    seq_len = args.seq_len or min(2048, config.max_seq_len)
    if seq_len > config.max_seq_len:
        raise PPTError(f"--seq-len {seq_len} exceeds the config's max_seq_len {config.max_seq_len}; lower it")
    if TRAIN_LENGTH_FIELD in {f.name for f in dataclasses.fields(config)}:  # recorded in every checkpoint
        config = dataclasses.replace(config, **{TRAIN_LENGTH_FIELD: seq_len})
    total_batch = args.total_batch_tokens or TOTAL_BATCH_TOKENS
    device_batch = args.device_batch_size or max(1, min(32, total_batch // (seq_len * rt.world_size)))
    tokens_per_micro = device_batch * seq_len * rt.world_size
    if total_batch % tokens_per_micro:
        raise PPTError(
            f"--total-batch-tokens {total_batch} is not divisible by device batch x seq-len x world "
            f"({device_batch} x {seq_len} x {rt.world_size} = {tokens_per_micro}); choose sizes that divide"
        )
    if not args.benchmark and args.eval_tokens < seq_len * rt.world_size:  # found before training, not after
        raise PPTError(
            f"--eval-tokens {args.eval_tokens} is less than one row of --seq-len {seq_len} per rank "
            f"({rt.world_size} ranks): raise --eval-tokens to at least {seq_len * rt.world_size}"
        )
    if args.benchmark:  # a benchmark measures steps: it neither evaluates nor saves
        args.eval_every = args.save_every = 0
    tag, lr = args.tag or config_name, args.lr or DEFAULT_LR[args.optimizer]
    use_compile = compile_enabled(args.compile, rt.device)
    flags = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in NOT_RELAUNCHED}
    flags |= {"tag": tag, "data_dir": str(data_dir), "lr": lr, "seq_len": seq_len, "total_batch_tokens": total_batch}
    given = {k: v for k, v in vars(args).items() if k in {f.name for f in dataclasses.fields(Settings)}}
    return Settings(**given | dict(
        config_name=config_name, config=config, data_dir=data_dir, tokenizer=tokenizer, seq_len=seq_len,
        config_dict={"class": type(config).__name__, **dataclasses.asdict(config)},
        total_batch_tokens=total_batch, device_batch_size=device_batch, grad_accum=total_batch // tokens_per_micro,
        lr=lr, doc_masks=not args.no_doc_masks, tag=tag, out_dir=args.out_dir or cache_dir() / "checkpoints" / tag,
        reports_path=cache_dir() / "reports" / f"{tag}.json", eval_tokens=int(args.eval_tokens),
        data_seed=args.seed if args.data_seed is None else args.data_seed,
        model_seed=args.seed if args.model_seed is None else args.model_seed,
        compile=use_compile, compile_mode=compile_mode(args.compile_mode, rt) if use_compile else None,
        argv=argv, flags=flags,
    ))  # fmt: skip


def compile_mode(choice: str, rt: Runtime) -> str:
    """--compile-mode with auto resolved: CUDA graphs (reduce-overhead) when one CUDA GPU trains, which take the host
    out of a small model's step (1.0-2.7x the tokens/s at the study's shapes, docs/benchmarks.md); the default mode
    under DDP (its gradient all-reduce hooks with CUDA graphs are untested here) and off CUDA."""
    if choice != "auto":
        return choice
    return "reduce-overhead" if rt.device.type == "cuda" and not rt.distributed else "default"


def record_settings(s: Settings, rt: Runtime, **derived: Any) -> TrainSettings:
    """What a run record and a checkpoint keep of the settings, by their names here and in `derived` (derive's)."""
    values = vars(s) | derived | {"world_size": rt.world_size, "dtype": str(rt.dtype)}
    return TrainSettings(**{f.name: values[f.name] for f in dataclasses.fields(TrainSettings)})
