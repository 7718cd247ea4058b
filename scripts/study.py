"""Run an architecture study: each architecture's compute-optimal frontier over several sizes and budgets, and the
verdict between them as a compute multiplier with a 95% interval over seeds.

    python -m scripts.study docs/studies/mixed.toml --out runs/mixed   # every visible GPU, 4 runs to a GPU
    python -m scripts.study GRID.toml --dry-run                # the runs called for next, and their time; run nothing
    python -m scripts.study GRID.toml --gpus 0,1 --deadline 540     # start no run that would end later (a lease)
    python -m scripts.study GRID.toml --launcher slurm --partition gpu --time-min 120    # one Slurm job a run
    python -m scripts.study GRID.toml --time 3                 # after the runs: each size timed alone, 3 times
    python -m scripts.study GRID.toml --report                 # the results again, from the records alone

The grid file (TOML):

    data_dir = "~/.cache/ppt/data/mixed-bpe16k"   # prepared shards
    seeds = [0, 1, 2]                 # run i of every setting trains with --seed i: the same data order and the same
                                      # initialization seed for every architecture and size (a paired design)
    budgets = [1e15, 3e15, 1e16]      # comparison FLOPs per run (--target-flops), 2 or more
    baseline = "vanilla"              # the architecture the others are measured against
    sizes_per_budget = 3              # sizes trained at each budget, at least 3
    tokens_per_param = 20             # where the first sizes tried at a budget are centred (a prior, not a rule)
    max_epochs = 4                    # no size trains more passes over the train split (see allowed_sizes)
    args = ["--seq-len", "1024"]      # flags every run gets

    [arch.vanilla]
    sizes = ["d3", "d4", "d6", "d8"]  # config names of ppt/model.py, smallest first (the size dials), each in one
    lrs = [1e-3, 2e-3, 4e-3]          # the sweep each size starts from                           architecture only
    args = []                         # flags this architecture's runs get

    [slurm]                           # --launcher slurm's sbatch settings (flags override them; docs/usage.md)
    partition = "gpu"
    time_min = 120
    gpus_per_run = 1
    sbatch = ["--qos=normal"]

How it decides, all from the runs finished so far (not the order they finished in), so that rerunning the same
command resumes where it stopped, and runs trained several at once decide as one at a time:
- Sizes. At each budget it trains the `sizes_per_budget` sizes nearest (in log parameters) to the one the prior
  puts there, then, while the best of them (lowest mean final val bpb over the seeds) is at an end of those trained
  and the list goes on, the next size past that end. Never a size that would read more than max_epochs of the train
  split, or less than one step and the warmup.
- Learning rates. Each size's rate is swept at the smallest budget that trains it (the first seed only), not
  where it would read a few steps; a best rate at either end of the sweep adds the next rate past it (the sweep's own
  ratio), up to 3 times a side. A diverged run counts as infinitely bad. At a budget RATE_CHECK times or more the
  FLOPs of its sweep the rate is checked (seed 0 at it and one neighbour each side, swept on past a neighbour that
  wins); every seed trains at the rate of its budget.
- Noise. Runs are --deterministic (bitwise reproducible; --no-deterministic turns it off). The baseline's first
  run is also run again as it was (bitwise equal expected) and twice without --deterministic: the rerun floor.
- Forecast. From 3 budgets on, the top one waits until its frontiers, fitted on the budgets below, predict it
  (ppt/forecast.py, <out>/forecast.json, written once): the results set the prediction against the measurement.
- The verdict (ppt/frontier.py): per architecture and budget, loss against log parameters as a parabola, its
  minimum the frontier point; B's multiplier at A's budget is the compute at which B's frontier reaches A's loss,
  over A's compute, in comparison FLOPs, in tokens and in GPU-seconds (--time's speeds), with intervals over the
  seeds, under every analysis ppt/frontier.ANALYSES names; a budget where either architecture's best is not below
  4-gram counts of the train split (ppt/baselines.py) is in the n-gram regime and gives no headline.

Each run trains in a process of its own (scripts/launchers.py: a local pool of slots on each GPU, or Slurm), in
<out>/runs/<name>/ with its record, its log in <out>/logs/; a study directory may move (a finished run stands
wherever its data and output directory now are). <out>/study.json records every decision; <out>/results.md the
verdict, the forecast, the count baselines and each budget's regime, the rates and where each was chosen, the
rerun floor, and each budget's runs as scripts.compare shows them; <out>/frontier.png the frontiers.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import statistics
import sys
import time
import tomllib
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn

import torch

from ppt import forecast, frontier
from ppt.baselines import NGRAM_MARGIN, in_ngram_regime, ngram_bpb, order_name
from ppt.common import (
    ArgumentParser,
    PPTError,
    atomic_file,
    checked_device,
    few,
    nonneg_int,
    positive_float,
    positive_int,
    run_cli,
    run_tag,
)
from ppt.formatting import duration
from ppt.locks import lock_directory, release_locks, remove_leftovers
from ppt.run import RunRecord, git_state, hardware
from scripts import compare, train_settings
from scripts.launchers import LocalPool, SlurmLauncher, SlurmSettings, chosen_gpus, jobs_in_flight, last_error

# Flags the study sets itself for every run; a grid that passed them would make runs that are not what they say
OWNED_FLAGS = ("--config", "--depth", "--data-dir", "--data-seed", "--model-seed", "--seed", "--lr", "--target-flops",
               "--target-tokens", "--tag", "--out-dir", "--resume", "--from-manifest", "--deterministic")  # fmt: skip
SLURM_FLAGS = ("partition", "time_min", "gpus_per_run", "cpus_per_run", "account", "sbatch")  # the [slurm] keys
GRID_KEYS = ("name", "data_dir", "seeds", "budgets", "baseline", "sizes_per_budget", "tokens_per_param", "max_epochs",
             "args", "arch", "slurm")  # fmt: skip
# Runs a GPU trains at once by default: the mixed study's runs are launch- and compile-bound, and 4 at once trained a
# budget's runs 3.1x (6.3e13) and 2.5x (3.5e14) as fast as one at a time on an H100, bit for bit (docs/benchmarks.md)
RUNS_PER_GPU = 4
MAX_EXTENSIONS = 3  # rates added past either end of a sweep
RATE_CHECK = 5  # a size's rate is checked at a budget this many times the FLOPs of the one it was swept at
FORECAST_BUDGETS = 3  # from this many budgets the top one is predicted from the others before its runs start
STATUS_EVERY = 180  # seconds between status lines off a terminal
WAIT_S = 2.0  # how long the study waits for a run to end before it looks at signals and the deadline again
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
TIMING_STEPS = 40  # steps a --time measurement runs
ORDER_NAMES = [order_name(n) for n in range(1, 5)]  # the count baselines' orders (ppt/baselines.py)
# The largest change of a final val bpb seen when archived runs were trained again on another GPU kind and commit
# (three runs of the mixed study at 6573827 on an H100 against their H200 records: 0.0006, 0.0005, 0.0031): a verdict
# whose records mix commits, model sources or GPUs carries it in its intervals (ppt.frontier.widened_multipliers)
CROSS_MACHINE_FLOOR = 0.0031


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
    slurm: SlurmSettings = field(default_factory=SlurmSettings)


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


def _number(path: Path, table: dict, key: str, kind: type, default: float) -> float:
    if isinstance(table.get(key), list):
        raise _fail(path, f"`{key}` takes one number, got the list {table[key]!r}")
    return _numbers(path, table, key, kind, default)[0]


def _flags(path: Path, value: object, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
        raise _fail(path, f"{where} must be a list of strings (base_train flags), got {value!r}")
    if owned := [a for a in value if a.split("=")[0] in OWNED_FLAGS]:
        raise _fail(path, f"{where} sets {', '.join(owned)}, which the study sets for each run; remove them")
    return value


def _slurm_settings(path: Path, table: object) -> SlurmSettings:
    if not isinstance(table, dict) or set(table) - set(SLURM_FLAGS):
        raise _fail(path, f"[slurm] takes {', '.join(SLURM_FLAGS)}, got {table!r}")
    kinds = {"partition": str, "account": str, "time_min": int, "gpus_per_run": int, "cpus_per_run": int}
    for key, value in table.items():
        if key == "sbatch":
            _flags(path, value, "[slurm] sbatch")
        elif not isinstance(value, kinds[key]) or isinstance(value, bool) or (kinds[key] is int and value < 0):
            raise _fail(path, f"[slurm] {key} must be a {'non-negative integer' if kinds[key] is int else 'string'}, "
                              f"got {value!r}")  # fmt: skip
    return SlurmSettings(**table)


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
    if not isinstance(raw.get("data_dir"), str):
        raise _fail(path, f"`data_dir` must be the path of the prepared shards every run reads, as a string; got "
                          f"{raw.get('data_dir', 'none')!r}")  # fmt: skip
    name = raw.get("name", Path(path).stem)
    try:
        run_tag(f"{name}-x")  # it starts every run's name
    except (argparse.ArgumentTypeError, TypeError):
        raise _fail(path, f"`name` {name!r} cannot start run names: give letters, digits, '.', '_' or '-'") from None
    archs_raw = raw.get("arch")
    if not isinstance(archs_raw, dict) or len(archs_raw) < 2:
        raise _fail(path, "a study compares at least two architectures: add [arch.NAME] tables with `sizes` and `lrs`")
    archs = []
    for arch_name, table in archs_raw.items():
        if not isinstance(table, dict) or set(table) - {"sizes", "lrs", "args"}:
            raise _fail(path, f"[arch.{arch_name}] takes `sizes`, `lrs` and `args`, got {table!r}")
        sizes = table.get("sizes")
        if not isinstance(sizes, list) or len(sizes) < 3 or not all(isinstance(s, str) for s in sizes):
            raise _fail(path, f"[arch.{arch_name}] `sizes` must list at least 3 config names, smallest first")
        if len(set(sizes)) < len(sizes):
            raise _fail(path, f"[arch.{arch_name}] `sizes` names a size twice ({sizes}); give each once")
        lrs = _numbers(path, table, "lrs", float)
        archs.append(Arch(arch_name, sizes, lrs, _flags(path, table.get("args", []), f"[arch.{arch_name}] args")))
    baseline = raw.get("baseline", archs[0].name)
    if baseline not in archs_raw:
        raise _fail(path, f"baseline {baseline!r} is not an [arch.*] table; use one of {', '.join(archs_raw)}")
    grid = Grid(
        name=name,
        data_dir=Path(raw["data_dir"]).expanduser(),
        seeds=_numbers(path, raw, "seeds", int, [0, 1, 2]),
        budgets=sorted(_numbers(path, raw, "budgets", float)),
        baseline=baseline,
        archs=archs,
        args=_flags(path, raw.get("args", []), "args"),
        sizes_per_budget=_number(path, raw, "sizes_per_budget", int, 3),
        tokens_per_param=_number(path, raw, "tokens_per_param", float, 20.0),
        max_epochs=_number(path, raw, "max_epochs", float, 4.0),
        slurm=_slurm_settings(path, raw.get("slurm", {})),
    )
    if grid.sizes_per_budget < 3:
        raise _fail(path, "`sizes_per_budget` must be at least 3: a parabola through fewer sizes has no minimum")
    if len(grid.budgets) < 2:
        raise _fail(path, f"`budgets` has {len(grid.budgets)}: a frontier joins optima at 2 budgets or more; add one")
    # sizes in two architectures would share run directories
    if shared := [size for i, a in enumerate(archs) for b in archs[i + 1 :] for size in a.sizes if size in b.sizes]:
        raise _fail(path, f"[arch.*] tables share sizes {shared}: each size belongs to one architecture; an ablation "
                          "of one config through `args` needs a config name of its own in ppt/model.py")  # fmt: skip
    for arch in archs:  # what base_train's parser refuses, found now: each size, and each seed at each budget
        runs = [Run(arch.name, size, grid.budgets[0], arch.lrs[0], grid.seeds[0]) for size in arch.sizes]
        runs += [Run(arch.name, arch.sizes[0], b, arch.lrs[0], seed) for seed in grid.seeds for b in grid.budgets]
        for run in runs:
            _check_argv(path, grid, run)
    return grid


def _round(lr: float) -> float:
    """A rate as its run's name spells it (3 digits), so that a rate reached two ways is one run."""
    return float(f"{lr:.3g}")


def _check_argv(path: Path, grid: Grid, run: Run) -> None:
    """Parse a run's flags as base_train will, so a value it refuses stops the study before any run starts."""
    parser = train_settings.build_parser()

    def refuse(message: str) -> NoReturn:
        raise _fail(path, f"base_train refuses run {run.name}: {message}; fix `args` or [arch.{run.arch}]") from None

    parser.error = refuse
    parser.parse_args(Study(grid, Path("out"), deterministic=True).argv(run))


# Flags that say where a run's files are and how its kernels launch, not what it computes: a study may change them
# midway. --compile-mode: CUDA graphs replay the same kernels (bitwise equal runs, docs/benchmarks.md); --data-dir and
# --out-dir: a study directory or its data may move (the data's identity is its fingerprint, checked apart).
LAUNCH_FLAGS = ("--compile-mode", "--data-dir", "--out-dir")


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
        self.min_tokens: dict[str, float] = {}  # arch -> the tokens base_train needs at least (one step, the warmup)
        self.train_tokens = math.inf  # tokens of the train split, filled by measure_sizes
        self.data_fingerprint: str | None = None  # of the data's tokens (ppt.shards), filled by measure_sizes
        self.decisions: dict[str, Any] = {"rates": {}, "rate_at": {}, "sizes": {}, "baselines": {}}
        self.finished: dict[Run, RunRecord] = {}  # records of finished runs, read once
        self.forecast_path = out / "forecast.json"  # the top budget predicted before its runs start
        self.awaiting_forecast = False  # set by plan: every budget below the top is done, the forecast is due
        # the runs' records register in the study's directory (<out>/reports), not in the user's cache: run names
        # are the study's, and another study of the same grid elsewhere has runs of the same names
        self.run_env = {"PPT_CACHE": str(out.resolve())}

    def run_dir(self, run: Run) -> Path:
        return self.out / "runs" / run.name

    def save(self, grid_path: Path) -> None:
        """<out>/study.json: every decision, and what the data says that the results need (restore reads it back)."""
        decided = {"grid_file": str(grid_path), "grid": asdict(self.grid), "deterministic": self.deterministic,
                   "params": self.params, "train_tokens": self.train_tokens, "data_fingerprint": self.data_fingerprint,
                   "min_tokens": self.min_tokens, **self.decisions}  # fmt: skip
        with atomic_file(self.out / "study.json") as f:
            f.write(json.dumps(decided, indent=1, default=str).encode())

    def restore(self) -> None:
        """--report: what measure_sizes and the count baselines read from the data, from study.json instead."""
        try:
            saved = json.loads((self.out / "study.json").read_text())
            self.params, self.train_tokens = saved["params"], saved["train_tokens"]
            self.min_tokens, self.data_fingerprint = saved["min_tokens"], saved["data_fingerprint"]
            self.decisions["baselines"] = saved["baselines"]
        except (OSError, ValueError, KeyError) as exc:
            raise PPTError(f"--report reads {self.out / 'study.json'} as a finished study wrote it ({exc!r}); run the "
                           "study (without --report) with its data once") from None  # fmt: skip

    def baselines(self, record: RunRecord) -> dict[str, Any]:
        """The count baselines on the val targets `record`'s final evaluation scored (kept in study.json)."""
        key = f"{record.train.eval_tokens} {record.train.seq_len} {record.train.world_size}"
        if key not in self.decisions["baselines"]:
            self.decisions["baselines"][key] = ngram_bpb(self.grid.data_dir, *map(int, key.split()))
        return self.decisions["baselines"][key]

    def cell_order(self, key: str) -> tuple:
        """Where a decision's key ("arch size", "arch size at budget", "arch size budget") sorts: grid order, budget."""
        arch, size, *budget = key.replace(" at ", " ").split()
        return [a.name for a in self.grid.archs].index(arch), self.archs[arch].sizes.index(size), [*map(float, budget)]

    def speeds(self) -> dict[str, Any]:
        """What `--time` measured ({} before it has run)."""
        path = self.out / "speeds.json"
        return json.loads(path.read_text()) if path.is_file() else {}

    def log(self, run: Run) -> Path:
        return self.out / "logs" / f"{run.name}.log"

    def record(self, run: Run) -> RunRecord | None:
        """The run's record once it has finished; None before (a run that stopped midway resumes)."""
        path = self.run_dir(run) / f"{self.tag(run.name)}.json"
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
                f"{path.parent} trained on other tokens (data fingerprint {record.data['fingerprint'][:12]})"
                f" than {self.grid.data_dir} holds ({self.data_fingerprint[:12]}): prepare the data it used "
                "again (the same documents and tokenizer) or use another --out"
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

    def tag(self, run_name: str) -> str:
        """The run's name in base_train (--tag): its record's and its lock's name in <out>/reports."""
        return f"{self.grid.name}-{run_name}"

    def argv(self, run: Run) -> list[str]:
        """base_train's flags for one run: the grid's, the architecture's, then what the study owns."""
        grid = self.grid
        flags = [*grid.args, *self.archs[run.arch].args, "--config", run.size, "--data-dir", str(grid.data_dir),
                 "--seed", str(run.seed), "--lr", repr(run.lr), "--target-flops", repr(run.budget), "--tag",
                 self.tag(run.name), "--out-dir", str(self.run_dir(run)), "--resume", "auto"]  # fmt: skip
        return flags + (["--deterministic"] if self.deterministic and not run.variant.startswith("-nondet") else [])

    def plan(self) -> list[Run]:
        """Every run the finished ones call for now, unfinished first, smaller budgets first (a study stopped midway
        has whole frontiers at its smaller budgets)."""
        todo: list[Run] = []
        self.awaiting_forecast = False
        for budget in self.grid.budgets:
            if budget == self.grid.budgets[-1] and self.holds_top_budget():
                self.awaiting_forecast = all(self.loss(r) is not None for r in todo)
                break
            for arch in self.grid.archs:
                sizes, waiting = self.sizes_at(arch, budget)
                todo += waiting
                self.decisions["sizes"][f"{arch.name} {budget:.3g}"] = sizes
            if budget == self.grid.budgets[0]:
                todo += self.floor_runs()
        return list(dict.fromkeys(r for r in todo if self.loss(r) is None))

    def holds_top_budget(self) -> bool:
        """Whether the top budget waits for its forecast: not written yet, and none of its runs started (after that
        it could only be a retrodiction)."""
        top = f"-f{self.grid.budgets[-1]:.3g}-"
        started = any(top in path.name for path in (self.out / "runs").glob("*"))
        return len(self.grid.budgets) >= FORECAST_BUDGETS and not self.forecast_path.exists() and not started

    def sizes_at(self, arch: Arch, budget: float) -> tuple[list[str], list[Run]]:
        """The sizes trained at a budget (module docstring, "Sizes") and the runs still needed to decide them."""
        sizes = self.prior_sizes(arch, budget)
        while True:
            waiting, means = [], {}
            for size in sizes:
                lr, sweep = self.rate_at(arch, size, budget)
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
        return [s for s in arch.sizes if self.why_not(arch, s, budget) is None]

    def why_not(self, arch: Arch, size: str, budget: float) -> str | None:
        """Why the size cannot train at the budget, or None."""
        tokens = self.tokens_at(size, budget)
        if tokens > self.grid.max_epochs * self.train_tokens:
            return f"would read {tokens / self.train_tokens:.2g} epochs, over max_epochs {self.grid.max_epochs:g}"
        if tokens < (least := self.min_tokens[arch.name]):
            return f"would read {tokens:,.0f} tokens, less than one step and the warmup ({least:,.0f})"
        return None

    def tokens_at(self, size: str, budget: float) -> float:
        """Tokens a run of the size reads at the budget: at the comparison FLOPs per token that a finished run of
        the size realized (its attention and screening counted over real documents), else C / 6N. The run is the
        first by (budget, seed, rate, variant), so that the order runs finished in does not matter."""
        done = [run for run in self.finished if run.size == size]
        if not done:
            return budget / (6 * self.params[size])
        record = self.finished[min(done, key=lambda r: (r.budget, r.seed, r.lr, r.variant))]
        return budget * record.tokens / record.comparison_flops

    def prior_sizes(self, arch: Arch, budget: float) -> list[str]:
        """The sizes_per_budget sizes nearest, in log parameters, to where tokens_per_param puts the optimum:
        C = 6 N D and D = k N give N = sqrt(C / 6k)."""
        target = math.log(math.sqrt(budget / (6 * self.grid.tokens_per_param)))
        ranked = sorted(self.allowed_sizes(arch, budget), key=lambda s: abs(math.log(self.params[s]) - target))
        chosen = set(ranked[: self.grid.sizes_per_budget])
        if len(chosen) < self.grid.sizes_per_budget:
            why = [f"{s} {self.why_not(arch, s, budget)}" for s in arch.sizes if s not in chosen]
            raise PPTError(f"{arch.name} has {len(chosen)} sizes it can train at {budget:.3g} FLOPs, fewer than "
                           f"sizes_per_budget ({few(why)}): change the sizes or the budget")  # fmt: skip
        return [s for s in arch.sizes if s in chosen]

    def rate_at(self, arch: Arch, size: str, budget: float) -> tuple[float | None, list[Run]]:
        """(the size's learning rate at a budget, None until decided; the runs still needed): module docstring,
        "Learning rates". A grid of one rate (no sweep) is not checked."""
        # the smallest budget that trains the size: a smaller one whose sizes (decided first) hold it, or this one
        swept_at = next((b for b in self.grid.budgets if b < budget and size in self.decided_sizes(arch, b)), budget)
        lr, sweep = self.rate(arch, size, swept_at, arch.lrs, f"{arch.name} {size}")
        step = arch.lrs[1] / arch.lrs[0] if len(arch.lrs) > 1 else None
        cell = f"{arch.name} {size} {budget:.3g}"
        for later in self.grid.budgets:
            if lr is None or step is None or not swept_at < later <= budget or later < RATE_CHECK * swept_at:
                continue
            if later == budget or size in self.decided_sizes(arch, later):
                start = [_round(lr / step), lr, _round(lr * step)]
                checked, sweep = self.rate(arch, size, later, start, f"{arch.name} {size} at {later:.3g}")
                if checked is None:  # the check has runs left: the rate so far, marked (a report of what there is)
                    self.decisions["rate_at"][cell] = {"lr": lr, "swept_at": swept_at, "check_pending_at": later}
                    return None, sweep
                lr, swept_at = checked, later
        if lr is not None:
            self.decisions["rate_at"][cell] = {"lr": lr, "swept_at": swept_at}
        return lr, sweep

    def rate(
        self, arch: Arch, size: str, budget: float, start: list[float], key: str
    ) -> tuple[float | None, list[Run]]:
        """(the best rate of a sweep from `start` at the budget, None until decided; its runs, seed 0 only)."""
        lrs, seed = list(start), self.grid.seeds[0]
        while True:
            sweep = [Run(arch.name, size, budget, lr, seed) for lr in lrs]
            losses = [self.loss(r) for r in sweep]
            if None in losses:
                return None, sweep
            best = lrs[losses.index(min(losses))]
            if all(math.isinf(x) for x in losses):
                raise PPTError(f"every learning rate of {arch.name} {size} diverged ({lrs}); give lower `lrs`")
            below, above = sum(lr < min(start) for lr in lrs), sum(lr > max(start) for lr in lrs)
            if len(lrs) > 1 and best == lrs[0] and below < MAX_EXTENSIONS:
                lrs.insert(0, _round(lrs[0] ** 2 / lrs[1]))
            elif len(lrs) > 1 and best == lrs[-1] and above < MAX_EXTENSIONS:
                lrs.append(_round(lrs[-1] ** 2 / lrs[-2]))
            else:
                self.decisions["rates"][key] = {
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
        """The run the rerun floor repeats: the baseline's middle size at the smallest budget, first seed."""
        arch, budget = self.archs[self.grid.baseline], self.grid.budgets[0]
        if not (sizes := self.decided_sizes(arch, budget)):
            return None
        size = sizes[len(sizes) // 2]
        rate = self.decisions["rates"].get(f"{arch.name} {size}")
        return Run(arch.name, size, budget, rate["lr"], self.grid.seeds[0]) if rate else None

    def grid_runs(self) -> list[Run]:
        """The runs the verdict reads: every seed of every size trained at each budget, at the size's rate there."""
        runs = []
        for arch in self.grid.archs:
            for budget in self.grid.budgets:
                for size in self.decided_sizes(arch, budget):
                    lr = self.decisions["rate_at"][f"{arch.name} {size} {budget:.3g}"]["lr"]
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
            flags = train_settings.parse_args(self.argv(Run(arch.name, arch.sizes[0], 1.0, 1.0, 0)))
            if flags.device:  # refused here, not by every run
                checked_device(flags.device)
            self.min_tokens[arch.name] = max(flags.total_batch_tokens or train_settings.TOTAL_BATCH_TOKENS,
                                             flags.warmup_tokens or 0)  # fmt: skip
            for size in arch.sizes:
                config = replace(get_config(size), vocab_size=vocab)
                if flags.seq_len and flags.seq_len > config.max_seq_len:
                    raise PPTError(f"{size} takes rows of at most {config.max_seq_len} tokens, and the grid's runs "
                                   f"get --seq-len {flags.seq_len}: lower it, or drop {size}")  # fmt: skip
                with torch.device("meta"):
                    model = build_model(config)
                self.params[size] = sum(p.numel() for p in model.parameters())
            if (params := [self.params[size] for size in arch.sizes]) != sorted(params):
                raise PPTError(f"[arch.{arch.name}] sizes must go smallest first: {arch.sizes} have {params} "
                               "parameters; reorder them")  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------------
# Training the runs: as many at once as the launcher has slots (scripts/launchers.py)


def seconds_needed(study: Study, run: Run) -> float:
    """A run's wall time, the median over the finished runs of its size (their time outside training plus this run's
    tokens at their speed), else over its architecture's runs at its budget (equal FLOPs, similar time), else 0."""
    estimates, neighbours = [], []
    for done, record in study.finished.items():
        if done.size == run.size:
            speed = record.median_tok_per_s()
            overhead = record.wall_time_s - record.tokens / speed
            estimates.append(overhead + study.tokens_at(run.size, run.budget) / speed)
        elif (done.arch, done.budget) == (run.arch, run.budget):
            neighbours.append(record.wall_time_s)
    return statistics.median(estimates or neighbours) if estimates or neighbours else 0.0


def describe(run: Run) -> str:
    return f"{run.size} at {run.budget:.3g} FLOPs, seed {run.seed}{run.variant}, lr {run.lr:g}"


def status_line(study: Study, launcher: LocalPool | SlurmLauncher, running: int, queued: list[Run]) -> str:
    """Where the study stands (printed off a terminal every STATUS_EVERY seconds)."""
    done = [r for r in study.finished.values() if r.finished]
    hours = sum(r.wall_time_s / r.hardware.get("runs_per_gpu", 1) for r in done) / 3600
    left = sum(seconds_needed(study, r) for r in queued)
    return (
        f"status: {len(done)} runs done, {running} running, {len(queued)} queued; {hours:.2f} {launcher.device}-"
        f"hours so far; the queued runs need about {duration(left)} of run time by the finished runs' speeds "
        "(their results may call for more)"
    )


def execute(study: Study, launcher: LocalPool | SlurmLauncher, deadline: float | None) -> str:
    """Train what the plan calls for, up to the launcher's slots at once, planning again whenever a run ends. Returns
    "complete", "deadline" (no run left fits before it, or it stopped runs), "stopped" (SIGINT or SIGTERM: the runs
    were stopped, each with a checkpoint) or "failed" (runs that failed twice, reported; the others went on)."""
    runs_by_name = {r.name: r for r in study.plan()}
    running = {runs_by_name[job.name]: job for job in launcher.adopt(
        {name: study.run_dir(run) for name, run in runs_by_name.items()}) if job.name in runs_by_name}  # fmt: skip
    in_flight = {run.name for run in running}
    for run_dir in sorted((study.out / "runs").glob("*/")):  # what runs killed with an earlier study left behind
        if run_dir.name not in in_flight:
            remove_leftovers(run_dir)
            remove_leftovers(study.out / "reports", prefix=f"{study.tag(run_dir.name)}.")
    attempts: dict[Run, int] = {}
    failed: dict[Run, str] = {}
    signals: list[int] = []
    handlers = {sig: signal.signal(sig, lambda signum, frame: signals.append(signum)) for sig in STOP_SIGNALS}
    shown = time.time()
    print(f"training on {launcher.describe()}", flush=True)
    if running:
        print(f"following {len(running)} runs an earlier study left in flight: "
              f"{', '.join(f'{r.name} ({j.where})' for r, j in running.items())}", flush=True)  # fmt: skip
    try:
        while True:
            out_of_time = deadline is not None and time.time() >= deadline
            if (signals or out_of_time) and running:
                for job in running.values():
                    launcher.stop(job)
            queued = [r for r in study.plan() if r not in running and r not in failed]
            for run in [] if signals or out_of_time else queued:
                if launcher.capacity < 1:
                    break
                if deadline is not None and time.time() + seconds_needed(study, run) > deadline:
                    continue
                study.log(run).parent.mkdir(parents=True, exist_ok=True)
                running[run] = job = launcher.start(run.name, study.argv(run), study.log(run), study.run_env)
                attempts[run] = attempts.get(run, 0) + 1
                print(f"start {describe(run)} on {job.where}", flush=True)
            if not running and study.awaiting_forecast and not (signals or out_of_time):
                write_forecast(study)
                continue
            if not running:
                break
            if not sys.stdout.isatty() and time.time() - shown >= STATUS_EVERY:
                shown = time.time()
                print(status_line(study, launcher, len(running), [r for r in queued if r not in running]), flush=True)
            for job, code in launcher.wait(timeout=WAIT_S):
                run = next(r for r, j in running.items() if j is job)
                del running[run]
                outcome = outcome_of(study, run, code, asked_to_stop=bool(signals) or out_of_time)
                if outcome.startswith("failed") and attempts.get(run, 1) >= 2:
                    failed[run] = outcome
                    outcome += f"; its log: {study.log(run)}"
                elif outcome.startswith("failed"):
                    outcome += "; trying it once more, resumed"
                print(
                    f"end   {describe(run)} on {job.where}: {outcome}, {duration(time.time() - job.started)} "
                    f"({len(study.finished)} done, {len(running)} running)",
                    flush=True,
                )
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    if signals:
        return "stopped"
    if failed:
        print(f"{len(failed)} runs failed twice:", flush=True)
        for run, outcome in failed.items():
            print(f"- {run.name}: {outcome}", flush=True)
        return "failed"
    return "deadline" if study.plan() else "complete"


def write_forecast(study: Study) -> None:
    """The top budget predicted from the budgets below (ppt/forecast.py), before any of its runs starts."""
    top = study.grid.budgets[-1]
    predicted = forecast.predict([r for r in run_results(study) if r.budget < top], study.grid.baseline, top)
    forecast.write(predicted, study.forecast_path)
    print(f"forecast, before the {top:.3g} runs start ({study.forecast_path}):\n{forecast.markdown(predicted)}")


def outcome_of(study: Study, run: Run, code: int | None, asked_to_stop: bool) -> str:
    """What a run's exit status means: its val bpb, "diverged" (marked for the plan), "stopped" (by the study), or
    "failed (...)" and the log's last error line."""
    if code == 0 and (loss := study.loss(run)) is not None:
        return f"val bpb {loss:.4f}"
    error = last_error(study.log(run))
    if code == 2 and "non-finite loss" in error:
        (study.run_dir(run) / "DIVERGED").touch()
        return "diverged"
    if code == 128 + signal.SIGTERM and asked_to_stop:
        return "stopped"
    return f"failed ({'killed' if code is None else f'exit {code}'}): {error}"


# ---------------------------------------------------------------------------------------------------------------------
# The results


def run_results(study: Study) -> list[frontier.RunResult]:
    """The verdict's runs; GPU-seconds: tokens at the size's speed as `--time` measured it alone (else None)."""
    speeds = {size: statistics.median(s) for size, s in study.speeds().get("tok_per_s", {}).items()}
    results = []
    for run in study.grid_runs():
        record = study.record(run)
        seconds = record.tokens / speeds[run.size] if run.size in speeds else None
        results.append(frontier.RunResult(run.arch, run.budget, record.params, run.seed, record.final_val.val_bpb,
                                          record.comparison_flops, record.tokens, seconds))  # fmt: skip
    return results


def time_sizes(study: Study, launcher: LocalPool, repeats: int) -> None:
    """--time N: each size the verdict reads N times, interleaved, alone on a GPU (base_train --benchmark for
    TIMING_STEPS steps), into <out>/speeds.json with the code and hardware."""
    sizes = {run.size: run for run in sorted(study.grid_runs(), key=lambda r: -r.budget)}  # the longest run's flags
    todo = [(size, i) for i in range(repeats) for size in sizes]
    speeds: dict[str, list[float]] = {}
    jobs: dict[str, tuple[str, Path]] = {}
    while todo or jobs:
        while todo and launcher.capacity:
            size, i = todo.pop(0)
            log = study.out / "timing" / f"{size}-{i}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            argv = [*study.argv(sizes[size]), "--benchmark", "--max-steps", str(TIMING_STEPS)]
            argv += ["--out-dir", str(log.parent)]
            jobs[launcher.start(f"{size}-{i}", argv, log, study.run_env).name] = (size, log)
        for job, code in launcher.wait(timeout=WAIT_S):
            size, log = jobs.pop(job.name)
            summary = [line for line in log.read_text().splitlines() if line.startswith("benchmark {")]
            if code != 0 or not summary:
                raise PPTError(f"timing {job.name} failed: {last_error(log)}; its log: {log}")
            speeds.setdefault(size, []).append(json.loads(summary[-1].removeprefix("benchmark "))["tok_per_s"])
            print(f"timed {job.name} on {job.where}: {speeds[size][-1]:,.0f} tok/s", flush=True)
    timed = {"measured": time.strftime("%Y-%m-%d"), "git": git_state(), "hardware": hardware(), "steps": TIMING_STEPS,
             "tok_per_s": speeds}  # fmt: skip
    with atomic_file(study.out / "speeds.json") as f:
        f.write(json.dumps(timed, indent=1).encode())


def floor_text(study: Study) -> str:
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


def forecast_text(study: Study, results: list[frontier.RunResult], verdict: frontier.Verdict) -> list[str]:
    """The top budget's forecast against its measurement, and whether it was pre-registered; else a retrodiction."""
    top = study.grid.budgets[-1]
    if len(study.grid.budgets) < FORECAST_BUDGETS:
        return []
    if not study.forecast_path.exists():
        return [
            "### Retrodiction, not a prediction\n",
            "No forecast was written before the top budget's runs started; "
            "this one is fitted after them, on the same records.\n",
            forecast.markdown(forecast.predict(results, study.grid.baseline, top), verdict),
        ]
    predicted, written = forecast.read(study.forecast_path)
    started = min(study.record(r).started for r in study.grid_runs() if r.budget == top)
    why = forecast.why_not_preregistered(study.forecast_path, started)
    said = f"NOT pre-registered: {why}" if why else f"pre-registered: written {written}, before the runs started"
    return [f"### The forecast of {top:.3g}, {said}\n", forecast.markdown(predicted, verdict)]


def budget_settings(study: Study, budget: float) -> list[compare.Setting]:
    """The budget's grid runs as scripts.compare's settings, one per size (its seeds)."""
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
    return min((s for s in settings if s.fields["arch"] == arch), key=lambda s: statistics.fmean(s.final("val_bpb")))


def edge_notes(study: Study, tables: dict[float, list[compare.Setting]]) -> list[str]:
    """Where a budget's best size is at an end of the sizes it trained, why no size past it ran."""
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
            elif why := study.why_not(arch, arch.sizes[at], budget):
                limit = "the data" if "epochs" in why else "the budget"
                notes.append(f"{where}; {arch.sizes[at]} {why}: the frontier point there is limited by {limit}")
    return notes


def write_results(study: Study, grid_path: Path) -> str:
    grid, out = study.grid, study.out
    runs = [study.record(run) for run in study.grid_runs()]
    first = runs[0]
    counts = study.baselines(first)
    models = {name: bpb for name, bpb in counts.items() if name in ORDER_NAMES}  # each count model's bpb
    results = run_results(study)
    verdict = frontier.verdict(results, grid.baseline)
    frontier.plot(verdict, out / "frontier.png")
    tables = {budget: budget_settings(study, budget) for budget in grid.budgets}
    best = {budget: {a.name: best_setting(settings, a.name) for a in grid.archs} for budget, settings in tables.items()}
    # the budgets where an architecture's best is not clearly below the counts
    ngram = [
        b
        for b, by_arch in best.items()
        if any(in_ngram_regime(statistics.fmean(s.final("val_bpb")), counts) for s in by_arch.values())
    ]
    trees = {(r.git.get("commit"), r.model_source.get("sha256"), r.hardware.get("gpu")) for r in runs}
    floor = CROSS_MACHINE_FLOOR if len(trees) > 1 else 0.0
    rows = frontier.robustness(results, grid.baseline, "flops", floor)
    hardware = first.hardware
    walls = [r.wall_time_s for r in map(RunRecord.load, sorted(out.glob("runs/*/*.json"))) if r.final_val]
    sources = dict.fromkeys(f"{(r.git.get('commit') or '?')[:8]}{' (dirty)' * bool(r.git.get('dirty'))} (model "
                            f"source {r.model_source.get('sha256', '?')[:8]})" for r in runs)  # fmt: skip
    dirty = sum(bool(r.git.get("dirty")) for r in runs)
    commits = f"commit{'s' * (len(sources) > 1)} {', '.join(sources)}" + (
        f" ({dirty} of {len(runs)} runs from a tree with uncommitted changes)" if dirty else ""
    )
    speeds = study.speeds()
    timed = (f"GPU-seconds: each size's tokens/s timed alone by `--time` ({speeds['hardware'].get('gpu', 'CPU')}, "
             f"commit {(speeds['git'].get('commit') or '?')[:8]}, {speeds['measured']})" if speeds else
             "GPU-seconds: not timed (`--time N` times each size alone; the runs' own speeds depend on what trained "
             "beside them)")  # fmt: skip
    text = [
        f"# {grid.name}\n",
        f"`python -m scripts.study {grid_path}`; {commits}; {hardware.get('gpu', 'CPU')}, torch "
        f"{hardware['torch']}, triton {hardware.get('triton')}; data {grid.data_dir} (fingerprint "
        f"{first.data['fingerprint'][:12]}), tokenizer {first.tokenizer['name']}; "
        f"{'deterministic' if study.deterministic else 'not deterministic'}.\n",
        f"Run time: {len(walls)} finished runs in {out / 'runs'} (sweeps, floor and runs past the grid's included), "
        f"{duration(sum(walls))} of run wall time, compilation and evaluation included.\n",
        "## The verdict\n",
        "The primary analysis, fixed before any study ran: each size's seed-mean loss, a parabola in ln size whose "
        "vertex is the budget's optimum, realized comparison FLOPs, frontiers joined piecewise linearly, intervals by "
        "the jackknife over seeds. A budget's verdict is clear only where every analysis below excludes 1, and no "
        "headline comes from a budget in the n-gram regime.\n",
        frontier.headline(rows, ngram) + "\n",
        "N-gram regime: " + (", ".join(f"{b:.3g}" for b in ngram) or "no budget") + " (where an architecture's best "
        f"size is not below the best count model, {counts['best']} at {models[counts['best']]:.4f} bpb, by "
        f"{NGRAM_MARGIN:g} bpb or more).\n",
        f"Rerun floor across machines: {floor:g} bpb added to every interval (the records come from "
        f"{len(trees)} (commit, model source, GPU) combinations; {CROSS_MACHINE_FLOOR:g} is the largest difference "
        "seen when archived runs were trained again on another GPU kind and commit)\n"
        if floor
        else "Rerun floor across machines: not applied (every record from one commit, model source and GPU kind; "
        f"across them runs have moved by up to {CROSS_MACHINE_FLOOR:g} bpb)\n",
        frontier.robustness_markdown(rows),
        frontier.markdown(verdict),
        *forecast_text(study, results, verdict),
        timed + "\n",
        *edge_notes(study, tables),
        "",
        "## Count baselines\n",
        "Kneser-Ney count models of the train split, scored on the val targets the runs' final evaluation scored "
        "(ppt/baselines.py): " + ", ".join(f"{name} {bpb:.4f}" for name, bpb in models.items()) + " bpb.\n",
        "| budget | " + " | ".join(f"best {a.name} (bpb)" for a in grid.archs) + " | regime |",
        "|---" * (len(grid.archs) + 2) + "|",
        *(
            f"| {b:.3g} | "
            + " | ".join(f"{s.fields['size']} {statistics.fmean(s.final('val_bpb')):.4f}" for s in by_arch.values())
            + f" | {'n-gram' if b in ngram else 'learned'} |"
            for b, by_arch in best.items()
        ),  # fmt: skip
        "",
        "## Learning rates\n\n| architecture size | swept at | val bpb by rate | chosen |\n|---|---|---|---|",
    ]
    for key, rate in sorted(study.decisions["rates"].items(), key=lambda item: study.cell_order(item[0])):
        sweep = ", ".join(f"{float(lr):g}: {x:.4f}" for lr, x in rate["sweep"].items())
        text.append(f"| {key} | {rate['swept_at']:.3g} | {sweep} | {rate['lr']:g}{' (at an edge)' * rate['at_edge']} |")
    text += ["", "Each cell's rate and where it was chosen (checked at a budget 5x or more its sweep's FLOPs):\n"]
    text.append("| architecture size | budget | rate | chosen at |\n|---|---|---|---|")
    for cell, rate in sorted(study.decisions["rate_at"].items(), key=lambda item: study.cell_order(item[0])):
        *name, budget = cell.split()
        pending = f"; its check at {rate['check_pending_at']:.3g} has runs left" if "check_pending_at" in rate else ""
        text.append(f"| {' '.join(name)} | {budget} | {rate['lr']:g} | {rate['swept_at']:.3g}{pending} |")
    text += ["", floor_text(study), ""]
    for budget, settings in tables.items():
        table = compare.table(settings, best_setting(settings, grid.baseline), [], models, times=False)
        text.append(f"## {budget:.3g} comparison FLOPs\n\n{table}\n")
    (out / "results.md").write_text("\n".join(text))
    return "\n".join(text)


def study_main(args: argparse.Namespace) -> int:
    grid = load_grid(args.grid)
    grid.data_dir = args.data_dir or grid.data_dir
    out = args.out or Path("runs") / grid.name
    study = Study(grid, out, not args.no_deterministic)
    launcher = None if args.dry_run or args.report else make_launcher(args, grid, out)  # a pool starts its server
    if (grid.data_dir / "meta.json").is_file():
        study.measure_sizes()
    elif args.report:
        study.restore()  # what the data says, from study.json
    else:
        raise PPTError(f"data_dir {grid.data_dir} holds no prepared shards (no meta.json); prepare it first")
    if args.dry_run:
        runs = study.plan()
        for run in runs:
            print(f"{run.name}: python -m scripts.base_train {' '.join(study.argv(run))}")
        seconds = [seconds_needed(study, r) for r in runs]
        unknown = f"; {seconds.count(0.0)} with no estimate (nothing like them has run)" if 0.0 in seconds else ""
        print(
            f"{len(runs)} runs called for now (finishing them may call for more), about {duration(sum(seconds))} "
            f"as the finished runs time them{unknown}"
        )
        if study.awaiting_forecast:
            print(f"the budgets below {grid.budgets[-1]:.3g} are done: the study writes the forecast next, then "
                  "trains the top budget")  # fmt: skip
        return 0
    if args.report:
        if missing := [run.name for run in study.plan()]:
            print(f"warning: {len(missing)} runs the plan calls for have not run in {out} ({few(missing)}); the "
                  "results say what the finished runs say (train them: the same command without --report)")  # fmt: skip
        print(write_results(study, args.grid))
        return 0
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PPTError(f"cannot write into {out} ({exc.strerror or exc}); pass another --out") from None
    lock_directory(out, "wait for the study using it, or pass another --out")
    try:
        if args.time:
            if study.plan():
                raise PPTError(f"{out} has runs left to train; finish the study before timing its sizes")
            time_sizes(study, launcher, args.time)
        else:
            ended = execute(study, launcher, None if args.deadline is None else time.time() + args.deadline)
            study.save(args.grid)
            if ended != "complete":
                print(f"{ended}: {len(study.plan())} or more runs left; rerun the same command to continue", flush=True)
                return {"deadline": 3, "stopped": 128 + signal.SIGINT, "failed": 1}[ended]
        print(write_results(study, args.grid))
        study.save(args.grid)  # with the count baselines the results computed
        if not args.time:
            print(f"\nstudy record: {out / 'study.json'}\nresults: {out / 'results.md'}\nplot: {out / 'frontier.png'}")
        return 0
    finally:
        release_locks()


def make_launcher(args: argparse.Namespace, grid: Grid, out: Path) -> LocalPool | SlurmLauncher:
    """The launcher the flags ask for; a study whose runs are still Slurm jobs goes on only through Slurm."""
    if args.launcher == "slurm":
        settings = replace(grid.slurm, **{k: v for k, v in vars(args).items() if k in SLURM_FLAGS and v is not None})
        return SlurmLauncher(out / "slurm", settings)
    if in_flight := jobs_in_flight(out / "slurm"):
        jobs = " ".join(in_flight.values())
        raise PPTError(f"{len(in_flight)} runs of {out} are Slurm jobs still queued or running ({jobs}); rerun with "
                       f"--launcher slurm to follow them, or cancel them first: scancel {jobs}")  # fmt: skip
    gpus = chosen_gpus(args.gpus)
    return LocalPool(gpus, 1 if args.time else args.runs_per_gpu or (RUNS_PER_GPU if gpus else 1))


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(
        prog="python -m scripts.study", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("grid", type=Path, help="the grid file (TOML, as above)")
    p.add_argument("--out", type=Path, help="study directory (default runs/<grid name>)")
    p.add_argument("--data-dir", type=Path, help="prepared shards, instead of the grid's data_dir")
    p.add_argument("--no-deterministic", action="store_true", help="train without --deterministic (faster)")
    p.add_argument("--dry-run", action="store_true", help="print the runs called for next and their time; run nothing")
    p.add_argument("--deadline", type=positive_float, help="seconds: start no run that would end later, stop those "
                   "still going then (each with a checkpoint)")  # fmt: skip
    p.add_argument("--report", action="store_true", help="write results.md from the runs finished so far, training "
                   "nothing (without the prepared data: from the records and study.json alone)")  # fmt: skip
    p.add_argument("--time", type=positive_int, metavar="N", help="after the runs: time each size N times alone on a "
                   "GPU (--benchmark, sizes interleaved) for the verdict's GPU-seconds; then the results")  # fmt: skip
    g = p.add_argument_group("where the runs train")
    g.add_argument("--launcher", choices=["local", "slurm"], default="local", help="this machine's GPUs (or CPU), "
                   "or one Slurm job a run through submitit (uv sync --extra slurm)")  # fmt: skip
    g.add_argument("--gpus", default="all", help="local: 'all' (default; the CPU on a machine without a GPU) or ids "
                   "such as 0,1,3; each run trains on one through CUDA_VISIBLE_DEVICES")  # fmt: skip
    g.add_argument("--runs-per-gpu", type=positive_int, help=f"local: runs at once on each GPU (default "
                   f"{RUNS_PER_GPU}), or on the CPU of a machine without one (default 1; a thread a run)")  # fmt: skip
    g.add_argument("--partition", help="slurm: the partition (default the grid's [slurm] partition, else Slurm's)")
    g.add_argument("--time-min", type=positive_int, help="slurm: each job's time limit in minutes (default 60)")
    g.add_argument("--gpus-per-run", type=nonneg_int, help="slurm: GPUs a job asks for (default 1; 0 for CPU runs)")
    g.add_argument("--cpus-per-run", type=positive_int, help="slurm: CPUs a job asks for (default Slurm's)")
    g.add_argument("--account", help="slurm: the account jobs are charged to")
    g.add_argument("--sbatch", action="append", help="slurm: another sbatch flag for every job, e.g. "
                   "--sbatch=--qos=high (repeatable)")  # fmt: skip
    return study_main(p.parse_args(argv))


if __name__ == "__main__":
    run_cli(lambda: sys.exit(main()))
