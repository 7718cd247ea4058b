"""Several study runs packed on one GPU against one at a time: the runs of one budget of a finished study (its sizes
and rates from <records>/study.json, the seeds asked for), trained through the study's local pool at each
--runs-per-gpu K in one process, after a warm-up that fills Inductor's compile cache as a study's first runs do.
Prints each K's wall time and summed tokens/s, and checks every run's record bitwise against the first K's: the
training losses and the final val bpb.

    python -m bench.bench_packing docs/studies/mixed.toml --records .gpudata/study --budget 6.3e13 --seeds 0 \\
        --data-dir DATA --runs-per-gpu 1,2,3,4 --out .gpudata/packing
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from ppt.common import ArgumentParser, PPTError, positive_float, run_cli
from ppt.run import RunRecord
from scripts.launchers import LocalPool, chosen_gpus
from scripts.study import WAIT_S, Run, Study, load_grid


def train_all(study: Study, runs: list[Run], pool: LocalPool, extra: tuple[str, ...] = ()) -> float:
    """Train `runs` through `pool`, as many at once as it has slots; the wall time."""
    started, todo, running = time.perf_counter(), list(runs), {}
    while todo or running:
        while todo and pool.capacity:
            run = todo.pop(0)
            study.log(run).parent.mkdir(parents=True, exist_ok=True)
            running[pool.start(run.name, [*study.argv(run), *extra], study.log(run), study.run_env).name] = run
        for job, code in pool.wait(WAIT_S):
            run = running.pop(job.name)
            if code != 0:
                raise PPTError(f"{job.name} ended with exit status {code}; its log: {study.log(run)}")
    return time.perf_counter() - started


def losses(record: RunRecord) -> list:
    return [h.get("loss") for h in record.history] + [record.final_val.val_bpb]


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("grid", type=Path)
    p.add_argument("--records", type=Path, required=True, help="a finished study directory: its study.json decides")
    p.add_argument("--budget", type=positive_float, help="one of the grid's budgets (default its smallest)")
    p.add_argument("--seeds", default="0", help="comma-separated seeds of each size (default 0)")
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("--runs-per-gpu", default="1,2,3,4")
    p.add_argument("--gpu", default="0", help="the GPU they share ('all' on a machine without one: the CPU)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    grid = load_grid(args.grid)
    grid.data_dir = args.data_dir
    args.budget = args.budget or grid.budgets[0]
    decided = json.loads((args.records / "study.json").read_text())
    runs = [Run(arch.name, size, args.budget, decided["rates"][f"{arch.name} {size}"]["lr"], int(seed))
            for arch in grid.archs for size in decided["sizes"][f"{arch.name} {args.budget:.3g}"]
            for seed in args.seeds.split(",")]  # fmt: skip
    gpus = chosen_gpus(args.gpu)
    warm = Study(grid, args.out / "warm-up", deterministic=True)
    warm.measure_sizes()
    first = {run.size: run for run in runs}.values()
    seconds = train_all(warm, list(first), LocalPool(gpus, 4), ("--max-steps", "3"))
    print(f"warm-up: {len(first)} sizes compiled in {seconds:.0f}s", flush=True)
    reference: dict[str, list] = {}
    for k in map(int, args.runs_per_gpu.split(",")):
        study = Study(grid, args.out / f"k{k}", deterministic=True)
        study.params, study.min_tokens = warm.params, warm.min_tokens
        shutil.rmtree(study.out, ignore_errors=True)
        wall = train_all(study, runs, LocalPool(gpus, k))
        records = {run.name: study.record(run) for run in runs}
        tokens = sum(r.tokens for r in records.values())
        same = [name for name, r in records.items() if losses(r) == reference.setdefault(name, losses(r))]
        walls = {name: round(r.wall_time_s, 1) for name, r in records.items()}
        summary = {"runs_per_gpu": k, "runs": len(runs), "wall_s": round(wall, 1), "run_wall_s": walls,
                   "summed_tok_per_s": round(tokens / wall), "bitwise_equal_to_first": len(same)}  # fmt: skip
        print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    run_cli(main)
