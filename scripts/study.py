"""Run an architecture study: each architecture's compute-optimal frontier over several sizes and budgets, and the
verdict between them as a compute multiplier with a 95% interval over seeds.

    python -m scripts.study docs/studies/mixed.toml --out runs/mixed
    python -m scripts.study GRID.toml --dry-run                # the runs called for next, and their time; run nothing
    python -m scripts.study GRID.toml --deadline 540           # start no run that would end later (a GPU lease)

The grid file (TOML):

    data_dir = "~/.cache/ppt/data/mixed-bpe16k"   # prepared shards
    seeds = [0, 1, 2]                 # run i of every setting trains with --seed i: the same data order and the same
                                      # initialization seed for every architecture and size (a paired design)
    budgets = [1e15, 3e15, 1e16]      # comparison FLOPs per run (--target-flops)
    baseline = "vanilla"              # the architecture the others are measured against
    sizes_per_budget = 3              # sizes trained at each budget, at least 3
    tokens_per_param = 20             # where the first sizes tried at a budget are centred (a prior, not a rule)
    max_epochs = 4                    # no size trains more passes over the train split (see allowed_sizes)
    args = ["--seq-len", "1024"]      # flags every run gets

    [arch.vanilla]
    sizes = ["d3", "d4", "d6", "d8"]  # config names of ppt/model.py, smallest first (the size dials)
    lrs = [1e-3, 2e-3, 4e-3]          # the sweep each size starts from
    args = []                         # flags this architecture's runs get

How it decides, all from the runs finished so far, so that rerunning the same command resumes where it stopped:
- Sizes. At each budget it trains the `sizes_per_budget` sizes nearest (in log parameters) to the one the prior
  puts there, then, while the best of them (lowest mean final val bpb over the seeds) is at an end of those trained
  and the list goes on, the next size past that end.
- Learning rates. Each size's rate is swept at the smallest budget that trains it (the first seed only), not
  where it would read a few steps; a best rate at either end of the sweep adds the next rate past it (the sweep's own
  ratio), up to 3 times a side. A diverged run counts as infinitely bad. The rate is then used at every budget, for
  every seed.
- Noise. Runs are --deterministic (bitwise reproducible; --no-deterministic turns it off). The baseline's first
  run is also run again as it was (bitwise equal expected) and twice without --deterministic: the rerun floor.
- The verdict (ppt/frontier.py): per architecture and budget, loss against log parameters as a parabola, its
  minimum the frontier point; B's multiplier at A's budget is the compute at which B's frontier reaches A's loss,
  over A's compute, in comparison FLOPs, in tokens and in GPU-seconds (a run's tokens over its size's median
  training tokens/s in the grid's --compile-mode, runs one at a time), with intervals over the seeds.

Runs train in this process, one at a time, each in <out>/runs/<name>/ with its record and a log in <out>/logs/; a
study directory may move (a finished run stands wherever its data and output directory now are).
<out>/study.json records every decision; <out>/results.md the tables (each budget's runs as scripts.compare shows
them, with the count baselines of the val tokens; the rates; the frontier points and the multipliers; why a best
size at an end of those trained has none past it; the rerun floor), <out>/frontier.png the frontiers against FLOPs,
tokens and GPU-seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import signal
import statistics
import sys
import time
import tomllib
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from ppt import frontier
from ppt.baselines import ngram_bpb
from ppt.common import ArgumentParser, PPTError, atomic_file, positive_float, run_cli
from ppt.formatting import duration
from ppt.locks import lock_directory, release_locks
from ppt.run import RunRecord
from scripts import base_train, compare

# Flags the study sets itself for every run; a grid that passed them would make runs that are not what they say
OWNED_FLAGS = ("--config", "--depth", "--data-dir", "--data-seed", "--model-seed", "--seed", "--lr", "--target-flops",
               "--target-tokens", "--tag", "--out-dir", "--resume", "--from-manifest", "--deterministic")  # fmt: skip
GRID_KEYS = ("name", "data_dir", "seeds", "budgets", "baseline", "sizes_per_budget", "tokens_per_param", "max_epochs",
             "args", "arch")  # fmt: skip
MAX_EXTENSIONS = 3  # rates added past either end of a sweep


@dataclass
class Arch:
    name: str
    sizes: list[str]
    lrs: list[float]
    args: list[str] = field(default_factory=list)


@dataclass
class Grid:
    name: str
    data_dir: Path
    seeds: list[int]
    budgets: list[float]
    baseline: str
    archs: list[Arch]
    args: list[str]
    sizes_per_budget: int = 3
    tokens_per_param: float = 20.0
    max_epochs: float = 4.0


@dataclass(frozen=True)
class Run:
    """One base_train run of the study; `variant` marks the reruns of the noise floor."""

    arch: str
    size: str
    budget: float
    lr: float
    seed: int
    variant: str = ""

    @property
    def name(self) -> str:
        return f"{self.size}-f{self.budget:.3g}-lr{self.lr:.3g}-s{self.seed}{self.variant}"  # sizes name one arch


# ---------------------------------------------------------------------------------------------------------------------
# The grid file


def _fail(path: Path, problem: str) -> PPTError:
    return PPTError(f"{path}: {problem}")


def _numbers(path: Path, table: dict, key: str, kind: type, default: object = None) -> list:
    value = table.get(key, default)
    if value is None:
        raise _fail(path, f"`{key}` is missing; give a list, e.g. {key} = [1, 2]")
    values = value if isinstance(value, list) else [value]
    if not values or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in values):
        raise _fail(path, f"`{key}` must be a non-empty list of numbers, got {value!r}")
    if kind is int and any(not float(v).is_integer() for v in values):
        raise _fail(path, f"`{key}` must hold whole numbers, got {value!r}")
    if any(not math.isfinite(v) or v < 0 or (kind is float and v == 0) for v in values):
        raise _fail(path, f"`{key}` must hold finite {'positive' if kind is float else 'non-negative'} numbers")
    names = {f"{v:.3g}" if kind is float else str(int(v)) for v in values}  # as run names spell them (Run.name)
    if len(names) < len(values):
        raise _fail(path, f"`{key}` repeats a value (to the 3 digits run names carry): {value!r}; give each once")
    return [kind(v) for v in values]


def _flags(path: Path, value: object, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
        raise _fail(path, f"{where} must be a list of strings (base_train flags), got {value!r}")
    owned = [a for a in value if a.split("=")[0] in OWNED_FLAGS]
    if owned:
        raise _fail(path, f"{where} sets {', '.join(owned)}, which the study sets for each run; remove them")
    return value


def load_grid(path: Path) -> Grid:
    """Read and check a grid file; every problem is one PPTError naming the key."""
    try:
        raw = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise PPTError(f"cannot read the grid file {path} ({exc.strerror or exc}); pass an existing .toml") from exc
    except tomllib.TOMLDecodeError as exc:
        raise PPTError(f"{path} is not valid TOML ({exc}); fix the line it names") from exc
    if unknown := set(raw) - set(GRID_KEYS):
        raise _fail(path, f"unknown keys {sorted(unknown)}; see `python -m scripts.study --help`")
    if "data_dir" not in raw:
        raise _fail(path, "`data_dir` is missing: the prepared shards every run reads")
    archs_raw = raw.get("arch")
    if not isinstance(archs_raw, dict) or len(archs_raw) < 2:
        raise _fail(path, "a study compares at least two architectures: add [arch.NAME] tables with `sizes` and `lrs`")
    archs = []
    for name, table in archs_raw.items():
        if not isinstance(table, dict) or set(table) - {"sizes", "lrs", "args"}:
            raise _fail(path, f"[arch.{name}] takes `sizes`, `lrs` and `args`, got {table!r}")
        sizes = table.get("sizes")
        if not isinstance(sizes, list) or len(sizes) < 3 or not all(isinstance(s, str) for s in sizes):
            raise _fail(path, f"[arch.{name}] `sizes` must list at least 3 config names, smallest first")
        lrs = _numbers(path, table, "lrs", float)
        archs.append(Arch(name, sizes, lrs, _flags(path, table.get("args", []), f"[arch.{name}] args")))
    baseline = raw.get("baseline", archs[0].name)
    if baseline not in archs_raw:
        raise _fail(path, f"baseline {baseline!r} is not an [arch.*] table; use one of {', '.join(archs_raw)}")
    grid = Grid(
        name=str(raw.get("name", Path(path).stem)),
        data_dir=Path(raw["data_dir"]).expanduser(),
        seeds=_numbers(path, raw, "seeds", int, [0, 1, 2]),
        budgets=sorted(_numbers(path, raw, "budgets", float)),
        baseline=baseline,
        archs=archs,
        args=_flags(path, raw.get("args", []), "args"),
        sizes_per_budget=_numbers(path, raw, "sizes_per_budget", int, 3)[0],
        tokens_per_param=_numbers(path, raw, "tokens_per_param", float, 20.0)[0],
        max_epochs=_numbers(path, raw, "max_epochs", float, 4.0)[0],
    )
    if grid.sizes_per_budget < 3:
        raise _fail(path, "`sizes_per_budget` must be at least 3: a parabola through fewer sizes has no minimum")
    for arch in archs:
        for size in arch.sizes:
            _check_argv(path, grid, Run(arch.name, size, grid.budgets[0], arch.lrs[0], grid.seeds[0]))
    return grid


class _Refused(Exception):
    pass


def _check_argv(path: Path, grid: Grid, run: Run) -> None:
    """Parse a run's flags as base_train will, so a value it refuses stops the study before any run starts."""
    parser = base_train.build_parser()

    def refuse(message: str) -> None:
        raise _Refused(message)

    parser.error = refuse
    try:
        parser.parse_args(Study(grid, Path("out"), deterministic=True).argv(run))
    except _Refused as exc:
        raise _fail(path, f"base_train refuses run {run.name}: {exc}; fix `args` or [arch.{run.arch}]") from None


# Flags that say where a run's files are and how its kernels launch, not what it computes: a study may change them
# midway. --compile-mode: CUDA graphs replay the same kernels (bitwise equal runs, docs/benchmarks.md); --data-dir and
# --out-dir: a study directory or its data may move (the data's identity is its fingerprint, checked apart).
LAUNCH_FLAGS = ("--compile-mode", "--data-dir", "--out-dir")


def _compile_mode(argv: list[str]) -> str | None:
    return argv[argv.index("--compile-mode") + 1] if "--compile-mode" in argv else None


def _computation(argv: list[str]) -> list[str]:
    """The flags without LAUNCH_FLAGS and their values."""
    return [flag for prev, flag in zip([None, *argv], argv) if flag not in LAUNCH_FLAGS and prev not in LAUNCH_FLAGS]


# ---------------------------------------------------------------------------------------------------------------------
# The plan: the runs that the finished ones call for next


class Study:
    def __init__(self, grid: Grid, out: Path, deterministic: bool) -> None:
        self.grid, self.out, self.deterministic = grid, out, deterministic
        self.archs = {a.name: a for a in grid.archs}
        self.params: dict[str, int] = {}  # config name -> parameters, filled by measure_sizes
        self.train_tokens = math.inf  # tokens of the train split, filled by measure_sizes
        self.data_fingerprint: str | None = None  # of the data's tokens (ppt.shards), filled by measure_sizes
        self.decisions: dict[str, Any] = {"rates": {}, "sizes": {}}
        self.finished: dict[Run, RunRecord] = {}  # records of finished runs, read once

    def run_dir(self, run: Run) -> Path:
        return self.out / "runs" / run.name

    def record(self, run: Run) -> RunRecord | None:
        """The run's record once it has finished; None before (a run that stopped midway resumes)."""
        path = self.run_dir(run) / f"{self.grid.name}-{run.name}.json"
        if run in self.finished or not path.is_file():
            return self.finished.get(run)
        record = RunRecord.load(path)
        if _computation(record.argv) != _computation(self.argv(run)):
            raise PPTError(
                f"{path.parent} holds a run made by another command ({' '.join(record.argv)}); the grid changed "
                "since it ran. Use another --out, or delete that run directory to rerun it"
            )
        if self.data_fingerprint not in (None, record.data["fingerprint"]):
            raise PPTError(
                f"{path.parent} trained on other tokens (data fingerprint {record.data['fingerprint'][:12]}) than "
                f"{self.grid.data_dir} holds ({self.data_fingerprint[:12]}): prepare the data it used again (the "
                "same documents and tokenizer) or use another --out"
            )
        if record.final_val:
            self.finished[run] = record
        return self.finished.get(run)

    def loss(self, run: Run) -> float | None:
        """Final val bpb; inf for a diverged run; None while it has not run."""
        if (self.run_dir(run) / "DIVERGED").is_file():
            return math.inf
        record = self.record(run)
        return record.final_val.val_bpb if record else None

    def argv(self, run: Run) -> list[str]:
        """base_train's flags for one run: the grid's, the architecture's, then what the study owns."""
        grid = self.grid
        flags = [*grid.args, *self.archs[run.arch].args, "--config", run.size, "--data-dir", str(grid.data_dir),
                 "--seed", str(run.seed), "--lr", repr(run.lr), "--target-flops", repr(run.budget), "--tag",
                 f"{grid.name}-{run.name}", "--out-dir", str(self.run_dir(run)), "--resume", "auto"]  # fmt: skip
        return flags + (["--deterministic"] if self.deterministic and not run.variant.startswith("-nondet") else [])

    def plan(self) -> list[Run]:
        """Every run the finished ones call for now, unfinished first, smaller budgets first (a study stopped midway
        has whole frontiers at its smaller budgets)."""
        todo: list[Run] = []
        for budget in self.grid.budgets:
            for arch in self.grid.archs:
                sizes, waiting = self.sizes_at(arch, budget)
                todo += waiting
                self.decisions["sizes"][f"{arch.name} {budget:.3g}"] = sizes
            if budget == self.grid.budgets[0]:
                todo += self.floor_runs()
        return list(dict.fromkeys(r for r in todo if self.loss(r) is None))

    def sizes_at(self, arch: Arch, budget: float) -> tuple[list[str], list[Run]]:
        """The sizes trained at a budget and the runs still needed to decide them: the prior's neighbourhood, then
        one size further while the best trained so far is at an end (and the list goes on)."""
        sizes = self.prior_sizes(arch, budget)
        while True:
            waiting, means = [], {}
            for size in sizes:
                lr, sweep = self.rate(arch, size, self.first_budget(arch, size, budget))
                runs = sweep if lr is None else [Run(arch.name, size, budget, lr, s) for s in self.grid.seeds]
                waiting += [r for r in runs if self.loss(r) is None]
                if lr is not None and not waiting:
                    means[size] = statistics.fmean(self.loss(r) for r in runs)
            if waiting:
                return sizes, waiting
            allowed = self.allowed_sizes(arch, budget)
            best = allowed.index(min(means, key=means.get))
            first, last = allowed.index(sizes[0]), allowed.index(sizes[-1])
            if best == first and first > 0:
                sizes = [allowed[first - 1], *sizes]
            elif best == last and last < len(allowed) - 1:
                sizes = [*sizes, allowed[last + 1]]
            else:
                return sizes, []

    def allowed_sizes(self, arch: Arch, budget: float) -> list[str]:
        """The sizes that read at most max_epochs of the train split at this budget."""
        return [s for s in arch.sizes if self.tokens_at(s, budget) <= self.grid.max_epochs * self.train_tokens]

    def tokens_at(self, size: str, budget: float) -> float:
        """Tokens a run of the size reads at the budget: at the comparison FLOPs per token that a finished run of
        the size realized (its attention and screening counted over real documents), else C / 6N."""
        done = [rec for run, rec in self.finished.items() if run.size == size]
        return budget * done[0].tokens / done[0].comparison_flops if done else budget / (6 * self.params[size])

    def prior_sizes(self, arch: Arch, budget: float) -> list[str]:
        """The sizes_per_budget sizes nearest, in log parameters, to where tokens_per_param puts the optimum:
        C = 6 N D and D = k N give N = sqrt(C / 6k)."""
        target = math.log(math.sqrt(budget / (6 * self.grid.tokens_per_param)))
        ranked = sorted(self.allowed_sizes(arch, budget), key=lambda s: abs(math.log(self.params[s]) - target))
        chosen = set(ranked[: self.grid.sizes_per_budget])
        if len(chosen) < self.grid.sizes_per_budget:
            raise PPTError(
                f"{arch.name} has {len(chosen)} sizes that read at most {self.grid.max_epochs:g} epochs at "
                f"{budget:.3g} FLOPs, fewer than sizes_per_budget: add larger sizes or lower the budget"
            )
        return [s for s in arch.sizes if s in chosen]

    def first_budget(self, arch: Arch, size: str, budget: float) -> float:
        """The smallest budget that trains the size: a smaller one whose sizes (decided first) hold it, or this one."""
        return next((b for b in self.grid.budgets if b < budget and size in self.decided_sizes(arch, b)), budget)

    def rate(self, arch: Arch, size: str, budget: float) -> tuple[float | None, list[Run]]:
        """(the size's learning rate, its sweep's runs at the budget); None until the sweep has decided."""
        lrs, seed = list(arch.lrs), self.grid.seeds[0]
        while True:
            sweep = [Run(arch.name, size, budget, lr, seed) for lr in lrs]
            losses = [self.loss(r) for r in sweep]
            if None in losses:
                return None, sweep
            best = lrs[losses.index(min(losses))]
            if all(math.isinf(x) for x in losses):
                raise PPTError(f"every learning rate of {arch.name} {size} diverged ({lrs}); give lower `lrs`")
            below, above = sum(lr < min(arch.lrs) for lr in lrs), sum(lr > max(arch.lrs) for lr in lrs)
            if len(lrs) > 1 and best == lrs[0] and below < MAX_EXTENSIONS:
                lrs.insert(0, lrs[0] ** 2 / lrs[1])
            elif len(lrs) > 1 and best == lrs[-1] and above < MAX_EXTENSIONS:
                lrs.append(lrs[-1] ** 2 / lrs[-2])
            else:
                self.decisions["rates"][f"{arch.name} {size}"] = {
                    "lr": best, "swept_at": budget, "sweep": {repr(lr): x for lr, x in zip(lrs, losses)},
                    "at_edge": len(lrs) > 1 and best in (lrs[0], lrs[-1]),
                }  # fmt: skip
                return best, sweep

    def floor_runs(self) -> list[Run]:
        """The baseline's first grid run again as it was, and twice without --deterministic."""
        first = self.first_baseline_run()
        if first is None or self.loss(first) is None:
            return []
        variants = (["-rerun"] if self.deterministic else []) + ["-nondet1", "-nondet2"]
        return [replace(first, variant=v) for v in variants]

    def decided_sizes(self, arch: Arch, budget: float) -> list[str]:
        """The sizes plan() has decided to train at the budget so far (none before it reaches the budget)."""
        return self.decisions["sizes"].get(f"{arch.name} {budget:.3g}", [])

    def first_baseline_run(self) -> Run | None:
        """The run the rerun floor repeats: the baseline's middle size at the smallest budget, first seed; None
        until that size and its rate are decided."""
        arch, budget = self.archs[self.grid.baseline], self.grid.budgets[0]
        if not (sizes := self.decided_sizes(arch, budget)):
            return None
        size = sizes[len(sizes) // 2]
        rate = self.decisions["rates"].get(f"{arch.name} {size}")
        return Run(arch.name, size, budget, rate["lr"], self.grid.seeds[0]) if rate else None

    def grid_runs(self) -> list[Run]:
        """The runs the verdict reads: every seed of every size trained at each budget, at the size's rate."""
        runs = []
        for arch in self.grid.archs:
            for budget in self.grid.budgets:
                for size in self.decided_sizes(arch, budget):
                    lr = self.decisions["rates"][f"{arch.name} {size}"]["lr"]
                    runs += [Run(arch.name, size, budget, lr, seed) for seed in self.grid.seeds]
        return runs

    def measure_sizes(self) -> None:
        """Parameters of every listed size at the data's vocabulary (built on meta: no memory, no time)."""
        from ppt.model import build_model, get_config
        from ppt.shards import dataset_fingerprint, load_data_tokenizer, read_meta

        vocab = load_data_tokenizer(self.grid.data_dir).vocab_size
        self.train_tokens = read_meta(self.grid.data_dir)["train"]["tokens"]
        self.data_fingerprint = dataset_fingerprint(self.grid.data_dir)
        for arch in self.grid.archs:
            for size in arch.sizes:
                with torch.device("meta"):
                    model = build_model(replace(get_config(size), vocab_size=vocab))
                self.params[size] = sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------------------------------------
# Training the runs: in this process, one at a time


class _Deadline(Exception):
    pass


def _at_deadline(signum: int, frame: object) -> None:
    """SIGALRM at the deadline: base_train's SIGTERM handler, once installed, stops the run at the end of a step
    with a checkpoint saved; before that the run stops where it is."""
    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        raise _Deadline
    signal.raise_signal(signal.SIGTERM)


def train(study: Study, run: Run, deadline: float | None) -> str:
    """Train one run through base_train.main, its output in its log. Returns "finished", "diverged" or "stopped"
    (at the deadline: it resumes when the study runs again, from its checkpoint if it saved one)."""
    log = study.out / "logs" / f"{run.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    argv = study.argv(run)
    if deadline is not None:
        signal.signal(signal.SIGALRM, _at_deadline)
        signal.setitimer(signal.ITIMER_REAL, max(1.0, deadline - time.time()))
    torch._dynamo.reset()  # graphs of the last run's model: dynamo would count them against this one's recompiles
    with open(log, "a") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        print(f"$ python -m scripts.base_train {' '.join(argv)}", flush=True)
        try:
            base_train.main(argv)
            status = "finished"
        except PPTError as exc:
            print(f"error: {exc}", flush=True)
            status = "diverged" if "non-finite loss" in str(exc) else f"failed: {exc}"
        except _Deadline:
            status = "stopped"
        except SystemExit as exc:  # the deadline's SIGTERM
            status = "stopped" if exc.code == 128 + signal.SIGTERM else f"failed: exit {exc.code}"
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    if status == "diverged":
        (study.run_dir(run) / "DIVERGED").touch()
    if status.startswith("failed"):
        raise PPTError(f"{run.name} {status}; its log: {log}. Fix the cause and rerun the same command to resume")
    return status


def seconds_needed(study: Study, run: Run) -> float:
    """A run's wall time as the finished runs of its size predict it (the median): each one's time outside training
    (compilation, evaluation) plus this run's tokens at its training speed. A size not run yet: the median wall time
    of its architecture's runs at this budget (equal FLOPs take roughly equal time); 0 when there are none."""
    estimates, neighbours = [], []
    for done, record in study.finished.items():
        if done.size == run.size:
            speed = record.median_tok_per_s()
            overhead = record.wall_time_s - record.tokens / speed
            estimates.append(overhead + study.tokens_at(run.size, run.budget) / speed)
        elif (done.arch, done.budget) == (run.arch, run.budget):
            neighbours.append(record.wall_time_s)
    return statistics.median(estimates or neighbours) if estimates or neighbours else 0.0


def execute(study: Study, deadline: float | None) -> bool:
    """Train what the plan calls for until nothing is left (True), or until no run left fits before the deadline
    or the deadline stops one (False)."""
    done = 0
    while runs := study.plan():
        if deadline is not None:
            runs = [r for r in runs if time.time() + seconds_needed(study, r) < deadline]
            if not runs:
                return False
        for run in runs:
            if deadline is not None and time.time() + seconds_needed(study, run) > deadline:
                continue
            started = time.perf_counter()
            status = train(study, run, deadline)
            done += 1
            result = f"val bpb {study.loss(run):.4f}" if status == "finished" else status
            print(f"[{done}] {run.name}: {result}, {duration(time.perf_counter() - started)}", flush=True)
            if status == "stopped":
                return False
        # the finished runs may call for more (sweep extensions, sizes): plan again
    return True


# ---------------------------------------------------------------------------------------------------------------------
# The results


def run_results(study: Study) -> list[frontier.RunResult]:
    """The verdict's runs. GPU-seconds: a run's tokens at its size's training speed, the median over the size's
    finished --deterministic runs made in the grid's --compile-mode (each alone on the GPU): one setting times all."""
    mode = _compile_mode(study.grid.args)
    speeds: dict[str, list[float]] = {}
    for run, record in study.finished.items():
        if _compile_mode(record.argv) == mode and not run.variant.startswith("-nondet"):
            speeds.setdefault(run.size, []).append(record.median_tok_per_s())
    results = []
    for run in study.grid_runs():
        record = study.record(run)
        seconds = record.tokens / statistics.median(speeds[run.size]) if run.size in speeds else None
        results.append(frontier.RunResult(run.arch, run.budget, record.params, run.seed, record.final_val.val_bpb,
                                          record.comparison_flops, record.tokens, seconds))  # fmt: skip
    return results


def floor_text(study: Study) -> str:
    """The rerun floor: the deterministic rerun against the original, and the two runs without --deterministic."""
    first = study.first_baseline_run()
    runs = {r.variant: r for r in study.floor_runs()}
    original, lines = study.record(first), [f"Rerun floor ({first.name}):"]
    if "-rerun" in runs:
        rerun = study.record(runs["-rerun"])
        same = [h.get("loss") for h in rerun.history] == [h.get("loss") for h in original.history]
        lines.append(
            f"- rerun with --deterministic: every training loss {'bitwise equal' if same else 'DIFFERENT'}, final "
            f"val bpb {rerun.final_val.val_bpb:.6f} against {original.final_val.val_bpb:.6f}"
        )
    a, b = (study.record(runs[v]).final_val.val_bpb for v in ("-nondet1", "-nondet2"))
    lines.append(f"- two runs without --deterministic: {a:.6f} and {b:.6f} (|difference| {abs(a - b):.6f} bpb)")
    return "\n".join(lines)


def budget_settings(study: Study, budget: float) -> list[compare.Setting]:
    """The budget's grid runs as scripts.compare's settings, one per size (its seeds), labelled with the size's rate
    and the passes its runs made over the train split."""
    settings: dict[str, compare.Setting] = {}
    for run in (r for r in study.grid_runs() if r.budget == budget):
        record = study.record(run)
        if run.size not in settings:
            label = f"{run.size} (lr {run.lr:g}, {record.tokens / study.train_tokens:.2g} epochs)"
            fields = compare.setting_fields(record) | {"arch": run.arch, "size": run.size}
            settings[run.size] = compare.Setting(label, fields, [])
        settings[run.size].runs.append(record)
    return list(settings.values())


def best_setting(settings: list[compare.Setting], arch: str) -> compare.Setting:
    """The architecture's size with the lowest mean final val bpb among a budget's settings."""
    return min((s for s in settings if s.fields["arch"] == arch), key=lambda s: statistics.fmean(s.final("val_bpb")))


def edge_notes(study: Study, tables: dict[float, list[compare.Setting]]) -> list[str]:
    """Where a budget's best size is at an end of the sizes it trained, why no size past it ran: the grid lists
    none, or the epoch cap ruled it out (then the frontier point there is limited by the data)."""
    notes = []
    for arch in study.grid.archs:
        for budget, settings in tables.items():
            sizes = study.decided_sizes(arch, budget)
            best = best_setting(settings, arch.name).fields["size"]
            if best not in (sizes[0], sizes[-1]):
                continue
            end, step = ("smallest", -1) if best == sizes[0] else ("largest", 1)
            where = f"- {arch.name} at {budget:.3g}: its best size {best} is the {end} trained"
            at = arch.sizes.index(best) + step
            if not 0 <= at < len(arch.sizes):
                notes.append(f"{where}, and the grid lists none past it: the optimum may lie beyond; add sizes")
            else:
                epochs = study.tokens_at(arch.sizes[at], budget) / study.train_tokens
                notes.append(f"{where}; {arch.sizes[at]} would read {epochs:.2g} epochs, over max_epochs "
                             f"{study.grid.max_epochs:g}: the frontier point there is limited by the data")  # fmt: skip
    return notes


def write_results(study: Study, grid_path: Path) -> str:
    grid, out = study.grid, study.out
    first = study.record(study.grid_runs()[0])
    counts = ngram_bpb(grid.data_dir, first.train.eval_tokens, first.train.seq_len, first.train.world_size)
    regimes = {name: counts[name] for name in ("unigram", "bigram")}  # the bpb rows under each comparison table
    verdict = frontier.verdict(run_results(study), grid.baseline)
    frontier.plot(verdict, out / "frontier.png")
    hardware = first.hardware
    walls = [r.wall_time_s for r in map(RunRecord.load, sorted(out.glob("runs/*/*.json"))) if r.final_val]
    sources = dict.fromkeys(f"{(r.git.get('commit') or '?')[:8]} (model source {r.model_source.get('sha256', '?')[:8]})"
                            for r in map(study.record, study.grid_runs()))  # fmt: skip
    commits = f"commit{'s' * (len(sources) > 1)} {', '.join(sources)}"
    text = [
        f"# {grid.name}\n",
        f"`python -m scripts.study {grid_path}`; {commits}; {hardware.get('gpu', 'CPU')}, torch "
        f"{hardware['torch']}, triton {hardware.get('triton')}; data {grid.data_dir} (fingerprint "
        f"{first.data['fingerprint'][:12]}), tokenizer {first.tokenizer['name']}; "
        f"{'deterministic' if study.deterministic else 'not deterministic'}.\n",
        f"Count baselines of the val tokens (train-split counts): unigram {regimes['unigram']:.4f}, bigram "
        f"{regimes['bigram']:.4f} bpb.\n",
        f"Run time: {len(walls)} finished runs in {out / 'runs'} (sweeps, floor and runs past the grid's included), "
        f"{duration(sum(walls))} of run wall time, compilation and evaluation included.\n",
        "## Learning rates\n\n| architecture size | swept at | val bpb by rate | chosen |\n|---|---|---|---|",
    ]
    for key, rate in study.decisions["rates"].items():
        sweep = ", ".join(f"{float(lr):g}: {x:.4f}" for lr, x in rate["sweep"].items())
        text.append(f"| {key} | {rate['swept_at']:.3g} | {sweep} | {rate['lr']:g}{' (at an edge)' * rate['at_edge']} |")
    tables = {budget: budget_settings(study, budget) for budget in grid.budgets}
    text += ["", "## The verdict\n", frontier.markdown(verdict), "", *edge_notes(study, tables), ""]
    text += [floor_text(study), ""]
    for budget, settings in tables.items():
        table = compare.table(settings, best_setting(settings, grid.baseline), [], regimes)
        text.append(f"## {budget:.3g} comparison FLOPs\n\n{table}\n")
    (out / "results.md").write_text("\n".join(text))
    return "\n".join(text)


def study_main(
    grid_path: Path, out: Path, deterministic: bool, dry_run: bool, deadline_s: float | None, data_dir: Path | None
) -> int:
    grid = load_grid(grid_path)
    grid.data_dir = data_dir or grid.data_dir
    if not (grid.data_dir / "meta.json").is_file():
        raise PPTError(f"data_dir {grid.data_dir} holds no prepared shards (no meta.json); prepare it first")
    study = Study(grid, out, deterministic)
    study.measure_sizes()
    if dry_run:
        runs = study.plan()
        for run in runs:
            print(f"{run.name}: python -m scripts.base_train {' '.join(study.argv(run))}")
        seconds = [seconds_needed(study, r) for r in runs]
        unknown = f"; {seconds.count(0.0)} with no estimate (nothing like them has run)" if 0.0 in seconds else ""
        print(
            f"{len(runs)} runs called for now (finishing them may call for more), about {duration(sum(seconds))} as "
            f"the finished runs time them{unknown}"
        )
        return 0
    lock_directory(out, "wait for the study using it, or pass another --out")  # makes `out`, or says why it cannot
    try:
        complete = execute(study, None if deadline_s is None else time.time() + deadline_s)
        decided = {"grid_file": str(grid_path), "grid": asdict(grid), "deterministic": deterministic}
        decided |= {"params": study.params, **study.decisions}
        with atomic_file(out / "study.json") as f:
            f.write(json.dumps(decided, indent=1, default=str).encode())
        if not complete:
            print(f"deadline: {len(study.plan())} or more runs left; rerun the same command to continue", flush=True)
            return 3
        print(write_results(study, grid_path))
        print(f"\nstudy record: {out / 'study.json'}\nresults: {out / 'results.md'}\nplot: {out / 'frontier.png'}")
        return 0
    finally:
        release_locks()


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(
        prog="python -m scripts.study", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("grid", type=Path, help="the grid file (TOML, as above)")
    p.add_argument("--out", type=Path, help="study directory (default runs/<grid name>)")
    p.add_argument("--data-dir", type=Path, help="prepared shards, instead of the grid's data_dir")
    p.add_argument("--no-deterministic", action="store_true", help="train without --deterministic (faster)")
    p.add_argument("--dry-run", action="store_true", help="print the runs called for next and their time; run nothing")
    p.add_argument("--deadline", type=positive_float, help="seconds: start no run after this, stop one still going")
    args = p.parse_args(argv)
    out = args.out or Path("runs") / load_grid(args.grid).name
    return study_main(args.grid, out, not args.no_deterministic, args.dry_run, args.deadline, args.data_dir)


if __name__ == "__main__":
    run_cli(lambda: sys.exit(main()))
