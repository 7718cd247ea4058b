"""Run an architecture study: a grid of base_train runs, each architecture at the learning rate its own sweep picked,
then compare them at equal compute.

    python -m scripts.study docs/studies/offline.toml --out runs/offline --jobs 4
    python -m scripts.study GRID.toml --out DIR --dry-run       # print the plan and the commands, run nothing

The grid file (TOML):

    data_dir = "data/offline-cosmo2"        # prepared shards; every run reads them in the same order
    data_seed = 0                           # one data order for every run (--data-seed)
    model_seeds = [0, 1]                    # initializations of every setting (--model-seed)
    budgets = [7.5e14, 1.5e15]              # comparison FLOPs per run (--target-flops)
    baseline = "vanilla"                    # compared against, budget by budget
    args = ["--seq-len", "1024"]            # flags every run gets

    [sweep]                                 # optional; where each architecture's learning rate is chosen
    budget = 7.5e14                         # default: the smallest budget
    model_seeds = [0]                       # default: the first model seed

    [arch.vanilla]
    args = ["--depth", "6"]
    lrs = [1e-3, 2e-3, 4e-3]                # one rate: no sweep, that rate is used

    [arch.multiscreen]
    args = ["--config", "multiscreen-d16"]
    lrs = [2e-3, 4e-3, 8e-3]

First every architecture trains at each of its rates at the sweep budget; the rate with the lowest mean final val
bits-per-byte is chosen (a diverged run counts as infinitely bad; a choice at either end of the list is flagged).
Then every architecture trains at every budget and model seed at its chosen rate; a sweep run with the same
settings is reused, not repeated. Every run is an ordinary base_train run in <out>/runs/<name>/ with its manifest.

Rerunning the same command resumes the study: a finished run (its manifest says so and holds the same command) is
skipped, a killed one continues from its last checkpoint (--resume auto), the others start. A run whose directory
holds a different command stops the study: change --out or delete that run.

<out>/study.json records the grid, every run's command and result, the sweep and the rate chosen per architecture.
At the end <out>/results.md holds one `scripts.compare` table per budget (each architecture against the baseline at
equal comparison FLOPs, mean ± std over seeds, a 95% interval for the difference) and <out>/frontier.png final val
bpb against comparison FLOPs, one line per architecture with its seed spread.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import subprocess
import sys
import time
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from ppt.common import ArgumentParser, PPTError, atomic_file, positive_int, run_cli
from ppt.run import RunRecord
from scripts import base_train
from scripts.compare import compare

# Flags the runner sets itself for every run; a grid that passes them would make runs that are not what they say.
OWNED_FLAGS = ("--data-dir", "--data-seed", "--model-seed", "--seed", "--lr", "--target-flops", "--target-tokens",
               "--tag", "--out-dir", "--resume", "--from-manifest")  # fmt: skip
# The grid key each owned flag's value comes from, for a value base_train refuses
OWNED_KEYS = {"--data-seed": "`data_seed`", "--model-seed": "`model_seeds` or [sweep] `model_seeds`",
              "--lr": "`lrs`", "--target-flops": "`budgets` or [sweep] `budget`"}  # fmt: skip
GRID_KEYS = ("name", "data_dir", "data_seed", "model_seeds", "budgets", "baseline", "args", "sweep", "arch")
POLL_S = 0.5


@dataclass
class Arch:
    name: str
    args: list[str]
    lrs: list[float]


@dataclass
class Grid:
    name: str
    data_dir: Path
    data_seed: int
    model_seeds: list[int]
    budgets: list[float]
    baseline: str
    args: list[str]
    archs: list[Arch]
    sweep_budget: float
    sweep_seeds: list[int]


@dataclass
class Run:
    arch: str
    budget: float
    lr: float
    seed: int
    phase: str  # "sweep" or "grid"
    argv: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.arch}-f{self.budget:.3g}-lr{self.lr:.3g}-s{self.seed}"


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


def _number(path: Path, table: dict, key: str, kind: type, default: object) -> int | float:
    """One number, not a list (a list would silently stand for its first value)."""
    if isinstance(table.get(key), list):
        raise _fail(path, f"`{key}` takes one number, got {table[key]!r}")
    return _numbers(path, table, key, kind, default)[0]


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
    unknown = set(raw) - set(GRID_KEYS)
    if unknown:
        raise _fail(path, f"unknown keys {sorted(unknown)}; see `python -m scripts.study --help`")
    if "data_dir" not in raw:
        raise _fail(path, "`data_dir` is missing: the prepared shards every run reads")
    archs_raw = raw.get("arch")
    if not isinstance(archs_raw, dict) or not archs_raw:
        raise _fail(path, "no architectures: add [arch.NAME] tables with `args` and `lrs`")
    archs = []
    for name, table in archs_raw.items():
        if not isinstance(table, dict) or set(table) - {"args", "lrs"}:
            raise _fail(path, f"[arch.{name}] takes exactly `args` and `lrs`, got {table!r}")
        archs.append(Arch(name, _flags(path, table.get("args", []), f"[arch.{name}] args"),
                          _numbers(path, table, "lrs", float)))  # fmt: skip
    baseline = raw.get("baseline", archs[0].name)
    if baseline not in archs_raw:
        raise _fail(path, f"baseline {baseline!r} is not an [arch.*] table; use one of {', '.join(archs_raw)}")
    model_seeds = _numbers(path, raw, "model_seeds", int, [0])
    budgets = sorted(_numbers(path, raw, "budgets", float))
    sweep = raw.get("sweep", {})
    if not isinstance(sweep, dict) or set(sweep) - {"budget", "model_seeds"}:
        raise _fail(path, f"[sweep] takes `budget` and `model_seeds`, got {sweep!r}")
    grid = Grid(
        name=str(raw.get("name", Path(path).stem)),
        data_dir=Path(raw["data_dir"]).expanduser(),
        data_seed=_number(path, raw, "data_seed", int, 0),
        model_seeds=model_seeds,
        budgets=budgets,
        baseline=baseline,
        args=_flags(path, raw.get("args", []), "args"),
        archs=archs,
        sweep_budget=_number(path, sweep, "budget", float, budgets[0]),
        sweep_seeds=_numbers(path, sweep, "model_seeds", int, model_seeds[:1]),
    )
    _check_commands(path, grid)
    return grid


class _Refused(Exception):
    pass


def _refuse(message: str) -> NoReturn:
    raise _Refused(message)


def _check_commands(path: Path, grid: Grid) -> None:
    """Parse every command the study may run as base_train will, so a value it refuses stops the study before any
    run starts, not in a run's log."""
    parser = base_train.build_parser()
    parser.error = _refuse  # raise, where base_train's parser prints and exits
    seeds, budgets = sorted({*grid.model_seeds, *grid.sweep_seeds}), sorted({*grid.budgets, grid.sweep_budget})
    for arch in grid.archs:
        for lr, seed, budget in itertools.product(arch.lrs, seeds, budgets):
            run = Run(arch.name, budget, lr, seed, "grid")
            try:
                parser.parse_args(run_argv(grid, arch, run, Path("out")))
            except _Refused as exc:
                key = next((k for flag, k in OWNED_KEYS.items() if f"argument {flag}:" in str(exc)), None)
                fix = key or f"`args` or [arch.{arch.name}] args"
                raise _fail(path, f"base_train refuses run {run.name}: {exc}; fix {fix}") from None


# ---------------------------------------------------------------------------------------------------------------------
# Runs: their commands, where they live, whether they are done


def run_argv(grid: Grid, arch: Arch, run: Run, out: Path) -> list[str]:
    """base_train's flags for one run: the grid's, the architecture's, then what the study owns."""
    return [
        *grid.args, *arch.args,
        "--data-dir", str(grid.data_dir), "--data-seed", str(grid.data_seed), "--model-seed", str(run.seed),
        "--lr", repr(run.lr), "--target-flops", repr(run.budget),
        "--tag", f"{grid.name}-{run.name}", "--out-dir", str(run_dir(out, run)), "--resume", "auto",
    ]  # fmt: skip


def run_dir(out: Path, run: Run) -> Path:
    return out / "runs" / run.name


def manifest_path(out: Path, grid: Grid, run: Run) -> Path:
    return run_dir(out, run) / f"{grid.name}-{run.name}.json"


def read_record(path: Path) -> RunRecord | None:
    """The run's record, None before base_train has written one."""
    return RunRecord.load(path) if path.is_file() else None


def run_state(out: Path, grid: Grid, run: Run) -> str:
    """'finished', 'partial' (started, not finished: resumes) or 'new'. A run dir made by another command raises."""
    record = read_record(manifest_path(out, grid, run))
    if record is None:
        return "partial" if run_dir(out, run).exists() else "new"
    if record.argv != run.argv:
        raise PPTError(
            f"{run_dir(out, run)} holds a run made by another command ({' '.join(record.argv)}); the grid changed "
            "since it ran. Use another --out, or delete that run directory to rerun it"
        )
    return "finished" if record.finished else "partial"


def final_bpb(out: Path, grid: Grid, run: Run) -> float:
    record = read_record(manifest_path(out, grid, run))
    return record.final_val.val_bpb if record and record.final_val else math.inf


# ---------------------------------------------------------------------------------------------------------------------
# Execution: a few base_train processes at a time


@dataclass
class Outcome:
    run: Run
    status: str  # "finished", "skipped" (finished earlier), "diverged", "failed"
    seconds: float = 0.0
    log: Path | None = None
    error: str | None = None  # the run's own `error:` line, when it stopped on bad input (exit 2)


def execute(runs: list[Run], out: Path, grid: Grid, jobs: int) -> list[Outcome]:
    """Run what is not finished, `jobs` at a time; a non-finite loss (exit 2 naming it) is a diverged run, which the
    sweep scores as infinitely bad; any other failure is reported with its log, and with its `error:` line if it
    stopped on bad input."""
    outcomes, pending, running = [], [], {}
    for run in runs:
        if run_state(out, grid, run) == "finished":
            outcomes.append(Outcome(run, "skipped"))
        else:
            pending.append(run)
    total, done = len(pending), 0
    while pending or running:
        while pending and len(running) < jobs:
            run = pending.pop(0)
            log = out / "logs" / f"{run.name}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            with open(log, "ab") as f:
                cmd = [sys.executable, "-m", "scripts.base_train", *run.argv]
                f.write(("$ " + " ".join(cmd) + "\n").encode())
                f.flush()
                process = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=Path(__file__).parents[1])
            running[process] = (run, log, time.perf_counter())
        time.sleep(POLL_S)
        for process in [p for p in running if p.poll() is not None]:
            run, log, started = running.pop(process)
            done += 1
            tail = log.read_text(errors="replace")[-4000:]
            if process.returncode == 0:
                status = "finished"
            elif process.returncode == 2 and "non-finite loss" in tail:
                status = "diverged"
            else:
                status = "failed"
            errors = [line for line in tail.splitlines() if line.startswith("error: ")]
            error = errors[-1].removeprefix("error: ") if process.returncode == 2 and errors else None
            outcome = Outcome(run, status, time.perf_counter() - started, log, error)
            outcomes.append(outcome)
            bpb = final_bpb(out, grid, run)
            result = f"val bpb {bpb:.4f}" if status == "finished" else f"{status} (log: {log})"
            print(f"[{done}/{total}] {run.name}: {result}, {outcome.seconds:.0f} s", flush=True)
    return outcomes


# ---------------------------------------------------------------------------------------------------------------------
# The study


def choose_lrs(grid: Grid, out: Path, sweep_runs: list[Run]) -> dict[str, dict[str, Any]]:
    """Per architecture: the mean final val bpb of each rate over the sweep seeds, and the rate with the lowest."""
    chosen = {}
    for arch in (a for a in grid.archs if len(a.lrs) > 1):
        by_lr = {
            lr: statistics.fmean(final_bpb(out, grid, r) for r in sweep_runs if r.arch == arch.name and r.lr == lr)
            for lr in arch.lrs
        }
        best = min(arch.lrs, key=lambda lr: by_lr[lr])
        if not math.isfinite(by_lr[best]):
            raise PPTError(f"every learning rate of {arch.name} diverged in the sweep ({arch.lrs}); try lower rates")
        at_edge = best in (min(arch.lrs), max(arch.lrs))
        chosen[arch.name] = {"lr": best, "sweep_bpb": {repr(lr): bpb for lr, bpb in by_lr.items()}, "at_edge": at_edge}
        if at_edge:
            print(f"warning: {arch.name}'s best rate {best:g} is at the edge of its sweep {arch.lrs}; extend `lrs`")
    return chosen


def plan(grid: Grid, out: Path, chosen: dict[str, dict[str, Any]] | None) -> tuple[list[Run], list[Run]]:
    """The sweep's runs, and the grid's (empty until the rates are chosen); a grid run equal to a sweep run is it."""
    archs = {a.name: a for a in grid.archs}
    sweep = [
        Run(a.name, grid.sweep_budget, lr, seed, "sweep")
        for a in grid.archs
        if len(a.lrs) > 1
        for lr in a.lrs
        for seed in grid.sweep_seeds
    ]
    main = []
    if chosen is not None or not sweep:  # a single-rate architecture needs no sweep
        rate = lambda a: chosen[a.name]["lr"] if len(a.lrs) > 1 else a.lrs[0]
        main = [
            Run(a.name, budget, rate(a), seed, "grid")
            for a in grid.archs
            for budget in grid.budgets
            for seed in grid.model_seeds
        ]
    for run in sweep + main:
        run.argv = run_argv(grid, archs[run.arch], run, out)
    return sweep, main


def write_record(out: Path, record: dict[str, Any]) -> None:
    with atomic_file(out / "study.json") as f:
        f.write(json.dumps(record, indent=1, default=str).encode())


def plot_frontier(grid: Grid, out: Path, runs: list[Run]) -> Path:
    """Final val bpb against realized comparison FLOPs: per architecture, the seed mean per budget and its spread."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for arch in grid.archs:
        xs, ys, spreads = [], [], []
        for budget in grid.budgets:
            records = [read_record(manifest_path(out, grid, r)) for r in runs
                       if r.arch == arch.name and r.budget == budget]  # fmt: skip
            finals = [r.final_val for r in records if r and r.final_val]
            if not finals:
                continue
            xs.append(statistics.fmean(f.comparison_flops for f in finals))
            ys.append(statistics.fmean(f.val_bpb for f in finals))
            spreads.append(statistics.stdev(f.val_bpb for f in finals) if len(finals) > 1 else 0.0)
        ax.errorbar(xs, ys, yerr=spreads, marker="o", capsize=3, label=arch.name)
    ax.set_xscale("log")
    ax.set_xlabel("comparison FLOPs (log)")
    ax.set_ylabel("final val bits per byte")
    ax.set_title(f"{grid.name}: mean ± std over model seeds {grid.model_seeds}")
    ax.legend()
    fig.tight_layout()
    path = out / "frontier.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def study(grid_path: Path, out: Path, jobs: int, dry_run: bool, data_dir: Path | None = None) -> int:
    grid = load_grid(grid_path)
    grid.data_dir = data_dir or grid.data_dir
    if not dry_run and not (grid.data_dir / "meta.json").is_file():
        raise PPTError(f"data_dir {grid.data_dir} holds no prepared shards (no meta.json); prepare it first")
    sweep, main = plan(grid, out, None)
    record: dict[str, Any] = {"grid_file": str(grid_path), "grid": asdict(grid), "jobs": jobs}
    if dry_run:
        for run in sweep + main:
            print(f"{run.phase} {run.name}: python -m scripts.base_train {' '.join(run.argv)}")
        if not main:
            print(f"grid runs: {len(grid.archs)} archs x {len(grid.budgets)} budgets x {len(grid.model_seeds)} "
                  "seeds, at the rates the sweep chooses")  # fmt: skip
        return 0
    out.mkdir(parents=True, exist_ok=True)
    failures = []
    if sweep:
        print(f"== sweep: {len(sweep)} runs at {grid.sweep_budget:.3g} comparison FLOPs ==", flush=True)
        outcomes = execute(sweep, out, grid, jobs)
        failures += [o for o in outcomes if o.status == "failed"]
        if failures:
            return report_failures(failures)
        record["chosen"] = choose_lrs(grid, out, sweep)
        for name, choice in record["chosen"].items():
            print(f"{name}: lr {choice['lr']:g} (sweep val bpb {choice['sweep_bpb']})")
        sweep, main = plan(grid, out, record["chosen"])
    sweep_names = {r.name for r in sweep}
    print(
        f"== grid: {len(main)} runs ({sum(r.name in sweep_names for r in main)} reused from the sweep) ==", flush=True
    )
    outcomes = execute([r for r in main if r.name not in sweep_names], out, grid, jobs)
    failures += [o for o in outcomes if o.status != "finished" and o.status != "skipped"]
    record["runs"] = {r.name: {"phase": r.phase, "argv": r.argv, "manifest": str(manifest_path(out, grid, r)),
                               "final_bpb": final_bpb(out, grid, r)} for r in sweep + main}  # fmt: skip
    write_record(out, record)
    if failures:
        return report_failures(failures)
    tables = [f"# {grid.name}\n", f"Grid: `{grid_path}`; runs: `{out}/runs/`; {jobs} run(s) at a time.\n"]
    for arch in grid.archs:
        choice = record.get("chosen", {}).get(arch.name)
        how = f"lr {choice['lr']:g}, chosen by the sweep {choice['sweep_bpb']}" if choice else f"lr {arch.lrs[0]:g}"
        tables.append(f"- {arch.name}: `{' '.join(arch.args)}`, {how}")
    tables.append("")
    if jobs > 1:
        tables.append("Runs shared the machine: their wall times and tokens/s are not throughput figures.\n")
    for budget in grid.budgets:
        runs = [r for r in main if r.budget == budget]
        baseline = next(f"{grid.name}-{r.name}" for r in runs if r.arch == grid.baseline)
        table = compare([manifest_path(out, grid, r) for r in runs], baseline=baseline)
        tables.append(f"## {budget:.3g} comparison FLOPs\n\n{table}\n")
    (out / "results.md").write_text("\n".join(tables))
    print("\n".join(tables))
    print(f"study record: {out / 'study.json'}\nresults: {out / 'results.md'}\nplot: {plot_frontier(grid, out, main)}")
    return 0


def report_failures(failures: list[Outcome]) -> int:
    for o in failures:
        because = f": {o.error}" if o.error else ""
        print(f"error: {o.run.name} {o.status}{because}; its log: {o.log}", file=sys.stderr)
    print("error: the study stopped; fix the cause and rerun the same command to resume", file=sys.stderr)
    return 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(
        prog="python -m scripts.study", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("grid", type=Path, help="the grid file (TOML, as above)")
    p.add_argument("--out", type=Path, help="study directory (default runs/<grid name>)")
    p.add_argument("--data-dir", type=Path, help="prepared shards, instead of the grid's data_dir")
    p.add_argument("--jobs", type=positive_int, default=1, help="runs at a time on this machine (default 1)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and every command; run nothing")
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error(f"--jobs must be at least 1, got {args.jobs}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out or Path("runs") / load_grid(args.grid).name
    return study(args.grid, out, args.jobs, args.dry_run, args.data_dir)


if __name__ == "__main__":
    run_cli(lambda: sys.exit(main()))
