"""The study runner: its decisions (sizes around the prior, sweeps that extend at an edge, sizes added past the
best) on a table of losses, then the laptop study of docs/studies/cpu.toml end to end on CPU as the README runs it,
the same runs two at a time (bit for bit), its resume, faults and refusals."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ppt import locks
from ppt.common import PPTError
from ppt.run import RunRecord
from scripts import launchers, study

REPO = Path(__file__).resolve().parents[1]
CPU_GRID = REPO / "docs" / "studies" / "cpu.toml"
GRID = CPU_GRID.read_text()
CPU_RUNS = 2 * 2 * 3 * 2 + 3  # archs x budgets x sizes x seeds, and the rerun floor's three


def write_grid(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "grid.toml"
    path.write_text(text)
    return path


def planned(grid: study.Grid, losses: dict) -> study.Study:
    """A study whose runs 'finish' with loss losses(run), planned until it asks for nothing more."""
    s = study.Study(grid, Path("/nonexistent"), deterministic=True)
    s.params = {size: 10 ** (i + 4) for a in grid.archs for i, size in enumerate(a.sizes)}
    s.min_tokens = {arch.name: 1.0 for arch in grid.archs}
    s.loss = lambda run: losses(run)
    assert s.plan() == []
    return s


def table_grid(lrs: list[float], sizes: int = 6) -> study.Grid:
    archs = [study.Arch(name, [f"{name}{i}" for i in range(sizes)], lrs) for name in ("a", "b")]
    return study.Grid("t", Path("."), [0, 1], [1e12, 1e14], "a", archs, [], sizes_per_budget=3, tokens_per_param=20)


def test_a_best_rate_at_an_edge_extends_the_sweep_until_it_is_inside():
    best = 0.016  # losses fall towards 0.016 from both sides: the sweep [1e-3, 2e-3, 4e-3] must grow upwards
    s = planned(table_grid([1e-3, 2e-3, 4e-3]), lambda run: abs(math.log(run.lr / best)) + run.seed / 100)
    first_sweeps = {key: rate for key, rate in s.decisions["rates"].items() if " at " not in key}
    for rate in first_sweeps.values():
        assert rate["lr"] == pytest.approx(best) and not rate["at_edge"] and rate["swept_at"] in (1e12, 1e14)
        assert [float(lr) for lr in rate["sweep"]] == pytest.approx([1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2, 3.2e-2])
    # each size is swept at the smallest budget that trains it: a3 first enters the sizes at 1e14
    assert s.decisions["sizes"]["a 1e+12"] == ["a0", "a1", "a2"] and "a3" in s.decisions["sizes"]["a 1e+14"]
    assert s.decisions["rates"]["a a0"]["swept_at"] == 1e12 and s.decisions["rates"]["a a3"]["swept_at"] == 1e14
    # a rate still falling after three extensions stays at the edge, and says so
    s = planned(table_grid([1e-3, 2e-3, 4e-3]), lambda run: -run.lr)
    first_sweeps = [rate for key, rate in s.decisions["rates"].items() if " at " not in key]
    assert all(r["at_edge"] and r["lr"] == pytest.approx(4e-3 * 2**3) for r in first_sweeps)


def test_a_rate_is_checked_where_it_is_used_far_from_its_sweep_and_swept_again_if_a_neighbour_wins():
    """At a budget 5x (or more) the FLOPs of its sweep a size's rate is checked by seed 0 at the rate and one
    neighbour each side; here the best rate halves between the budgets, so the lower neighbour wins at 1e14, the
    sweep extends past it (1e-3 loses) and the runs there train at 2e-3."""
    best = {1e12: 4e-3, 1e14: 2e-3}
    s = planned(table_grid([2e-3, 4e-3, 8e-3]), lambda run: abs(math.log(run.lr / best[run.budget])))
    assert s.decisions["rate_at"]["a a0 1e+12"] == {"lr": 4e-3, "swept_at": 1e12}
    assert s.decisions["rate_at"]["a a0 1e+14"] == {"lr": 2e-3, "swept_at": 1e14}
    check = s.decisions["rates"]["a a0 at 1e+14"]
    assert [float(lr) for lr in check["sweep"]] == pytest.approx([1e-3, 2e-3, 4e-3, 8e-3]) and not check["at_edge"]
    assert {run.lr for run in s.grid_runs() if run.budget == 1e14} == {2e-3}
    # budgets closer than 5x are not checked; nor is a grid of one rate (no sweep to take a neighbour's step from)
    grid = replace(table_grid([2e-3, 4e-3, 8e-3]), budgets=[1e12, 4e12])
    assert not [key for key in planned(grid, lambda run: 1.0).decisions["rates"] if " at " in key]
    assert not [key for key in planned(table_grid([3e-3]), lambda run: 1.0).decisions["rates"] if " at " in key]


def test_the_top_budget_waits_until_its_forecast_is_written(tmp_path):
    """From 3 budgets on, the top one is predicted from the others before any of its runs starts: the plan holds it
    back until the lower budgets are done and forecast.json exists."""
    grid = replace(table_grid([1e-3]), budgets=[1e12, 1e13, 1e14])
    s = study.Study(grid, tmp_path, deterministic=True)
    s.params, s.min_tokens = {size: 10 ** (int(size[1:]) + 4) for a in grid.archs for size in a.sizes}, {"a": 1, "b": 1}
    s.loss = lambda run: None if run.budget == 1e13 else 1.0
    assert {run.budget for run in s.plan()} == {1e13} and not s.awaiting_forecast  # 1e13 still training, 1e14 waits
    s.loss = lambda run: None if run.budget == 1e14 else 1.0
    assert s.plan() == [] and s.awaiting_forecast  # the lower budgets done: the forecast is due
    s.forecast_path.write_text("{}")
    assert {run.budget for run in s.plan()} == {1e14} and not s.awaiting_forecast


def test_sizes_start_at_the_prior_and_grow_past_a_best_at_an_edge():
    # sizes have 1e4 .. 1e9 parameters; at 1e12 FLOPs the prior (20 tokens a parameter) is sqrt(1e12 / 120) = 9.1e4
    s = planned(table_grid([1e-3]), lambda run: 1.0)  # flat losses: the first best is the smallest, an edge
    assert s.decisions["sizes"]["a 1e+12"] == ["a0", "a1", "a2"]
    # loss falling with size: the best is always the largest trained, so sizes are added up to the list's end
    s = planned(table_grid([1e-3]), lambda run: -int(run.size[1:]))
    assert s.decisions["sizes"]["a 1e+12"] == ["a0", "a1", "a2", "a3", "a4", "a5"]
    # a minimum at size 3 (1e7 parameters): grown until the best is inside
    s = planned(table_grid([1e-3]), lambda run: (int(run.size[1:]) - 3) ** 2)
    assert s.decisions["sizes"]["a 1e+12"] == ["a0", "a1", "a2", "a3", "a4"]
    assert s.decisions["sizes"]["a 1e+14"] == ["a1", "a2", "a3", "a4"]  # prior 9.1e5: a1-a3, then a4


def fake_record(**fields: object) -> SimpleNamespace:
    """A finished run's record reduced to the fields a test sets, with RunRecord's reading of its history."""
    record = SimpleNamespace(**fields)
    record.median_tok_per_s = lambda: RunRecord.median_tok_per_s(record)
    return record


def test_the_epoch_cap_counts_the_tokens_a_size_really_reads():
    """max_epochs caps the passes over the train split: at C / 6N tokens before a size has run, then at the
    comparison FLOPs per token a finished run of it realized (attention and screening make that more than 6N)."""
    s = planned(table_grid([1e-3]), lambda run: 1.0)
    s.train_tokens, s.grid.max_epochs = 1e6, 4.0
    assert s.tokens_at("a1", 6e11) == pytest.approx(6e11 / (6 * 1e5))  # a1 has 1e5 parameters: 1e6 tokens
    assert "a1" in s.allowed_sizes(s.archs["a"], 2.4e12) and "a1" not in s.allowed_sizes(s.archs["a"], 2.5e12)
    ran = study.Run("a", "a1", 1e12, 1e-3, 0)
    s.finished[ran] = fake_record(tokens=1e6, comparison_flops=1e12, wall_time_s=30.0,
                                  history=[{"tok_per_s": 1e5}, {"tok_per_s": 1e5}])  # fmt: skip
    assert s.tokens_at("a1", 2e12) == pytest.approx(2e6)  # 1e6 FLOPs a token, not 6e5
    assert "a1" in s.allowed_sizes(s.archs["a"], 4e12) and "a1" not in s.allowed_sizes(s.archs["a"], 4.1e12)
    # the run-time estimate: the finished run's 20 s outside training, plus the tokens at its speed
    assert study.seconds_needed(s, replace(ran, budget=3e12)) == pytest.approx(20 + 3e6 / 1e5)
    # a size not run yet: the wall time of its architecture's runs at the budget; another architecture's: none
    assert study.seconds_needed(s, replace(ran, size="a2")) == 30.0
    assert study.seconds_needed(s, replace(ran, arch="b", size="b1")) == 0.0


def test_gpu_seconds_come_from_the_sizes_timed_alone_never_from_the_runs(tmp_path):
    """The equal-time view: a run's tokens over the median of its size's --time speeds; a size not timed has none,
    whatever speed its runs logged beside others."""
    s = planned(table_grid([1e-3]), lambda run: 1.0)
    s.out = tmp_path
    for run in s.grid_runs():
        s.finished[run] = fake_record(history=[{"tok_per_s": 1.0}], tokens=1e6, params=s.params[run.size],
                                      final_val=SimpleNamespace(val_bpb=1.0), comparison_flops=1e12)  # fmt: skip
    s.record = s.finished.get
    (tmp_path / "speeds.json").write_text(json.dumps({"tok_per_s": {"a0": [1e5, 2e5, 4e5]}}))
    seconds = {(r.arch, r.size, r.budget, r.seed): r.seconds for r in study.run_results(s)}
    assert seconds[("a", 1e4, 1e12, 0)] == seconds[("a", 1e4, 1e12, 1)] == pytest.approx(1e6 / 2e5)
    assert all(x is None for (arch, size, _, _), x in seconds.items() if (arch, size) != ("a", 1e4))


def test_a_size_below_one_step_is_not_trained_and_the_dry_run_says_so(tmp_path):
    """A budget that gives a size less than one step (or its warmup) leaves it out, like the epoch cap; too few sizes
    left is refused by the plan, so --dry-run finds it, not run 1 (a grid that passed the dry run used to fail late)."""
    s = planned(table_grid([1e-3]), lambda run: 1.0)
    s.train_tokens, s.min_tokens = 1e12, {"a": 2e5, "b": 2e5}
    # at 1e12 FLOPs a size of 1e6 parameters reads 1.7e5 tokens: out; 1e5 parameters, 1.7e6 tokens: in
    assert s.allowed_sizes(s.archs["a"], 1e12) == ["a0", "a1"]
    assert "166,667 tokens, less than one step and the warmup (200,000)" in s.why_not(s.archs["a"], "a2", 1e12)
    with pytest.raises(
        PPTError,
        match=r"a has 2 sizes it can train at 1e\+12 FLOPs, fewer than sizes_per_budget \(a2 "
        r"would read 166,667 tokens, less than one step",
    ):
        s.plan()


# ---------------------------------------------------------------------------------------------------------------------
# docs/studies/cpu.toml on CPU, as the README runs it


@pytest.fixture(scope="module")
def demo_home(readme_study: Callable[[], tuple[Path, Path]]) -> Path:
    """A home whose ~/.cache/ppt/data/demo holds the demo corpus as scripts/run_cpu.sh prepares it: cpu.toml's data."""
    return readme_study()[0]


@pytest.fixture(scope="module")
def cpu_study(readme_study: Callable[[], tuple[Path, Path]]) -> Path:
    """`python -m scripts.study docs/studies/cpu.toml`, as written (one run at a time), in a scratch directory:
    started with the test session (conftest.py's readme_study)."""
    return readme_study()[1]


TIMES = {"started", "finished", "wall_time_s", "tok_per_s", "step_time", "data_time", "max_rss_gb", "hardware", "git"}


def comparable(path: Path) -> dict:
    """A run record without what differs between two machines or launches of the same run: times, speeds, memory,
    hardware (host and packing), and the checkout's state (its model source stays)."""

    def clean(x: object) -> object:
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items() if k not in TIMES}
        return [clean(v) for v in x] if isinstance(x, list) else x

    return clean(json.loads(path.read_text()))


def assert_same_study(a: Path, b: Path) -> None:
    """The same runs, records equal but for times and hosts, and the same results.md but for its run-time line (both
    studies in runs/cpu of their working directories, as the README's command puts them)."""
    names = sorted(p.relative_to(a) for p in a.glob("runs/*/*.json"))
    assert names == sorted(p.relative_to(b) for p in b.glob("runs/*/*.json")) and len(names) == CPU_RUNS
    for run in names:
        assert comparable(a / run) == comparable(b / run), run

    def results(out: Path) -> list[str]:
        return [line for line in (out / "results.md").read_text().splitlines() if not line.startswith("Run time:")]

    assert results(a) == results(b)


def test_the_readme_study_trains_every_size_and_seed_and_states_a_verdict(cpu_study):
    out = cpu_study
    record = json.loads((out / "study.json").read_text())
    params = record["params"]
    assert record["deterministic"] and params["d1"] < params["d2"] < params["d3"]
    assert set(record["sizes"]) == {f"{a} {b}" for a in ("vanilla", "multiscreen") for b in ("5e+09", "1.5e+10")}
    assert all(len(sizes) >= 3 for sizes in record["sizes"].values()) and len(record["rates"]) >= 6
    runs = sorted(p.name for p in (out / "runs").iterdir())
    assert len(runs) == CPU_RUNS
    results = (out / "results.md").read_text()
    assert f"Run time: {len(runs)} finished runs in {Path('runs/cpu/runs')}" in results
    for name in runs:  # seed i is --seed i for every run: one data order and one initialization seed per i
        argv = json.loads(next((out / "runs" / name).glob("*.json")).read_text())["argv"]
        assert argv[argv.index("--seed") + 1] == name.split("-s")[-1][0]
        assert ("--deterministic" in argv) == ("nondet" not in name)
    assert "## 5e+09 comparison FLOPs" in results and "## 1.5e+10 comparison FLOPs" in results
    for key, sizes in record["sizes"].items():  # each budget's table: a row a size with both seeds, its rate, epochs
        arch, budget = key.split()
        table = results.split(f"## {budget} comparison FLOPs")[1]
        bpb = {size: float(re.search(rf"^\| {size} \(lr [0-9.e-]+, [0-9.e+-]+ epochs\) \| 2 \|(?:[^|]*\|){{3}} "
                                     r"([0-9.]+) ", table, re.M)[1]) for size in sizes}  # fmt: skip
        best = min(bpb, key=bpb.get)  # a best size at an end of those trained gets a note saying why none past it ran
        assert (f"- {arch} at {budget}: its best size {best} is the" in results) == (best in (sizes[0], sizes[-1]))
    assert "bitwise equal" in results and "two runs without --deterministic" in results
    assert "bigram (train-split counts)" in results and "multiplier" in results.lower()
    assert (out / "frontier.png").stat().st_size > 1000
    assert list((out / "reports").glob("*.json")), "the runs register in the study's directory, not the user's cache"


def test_rerun_trains_nothing_and_a_changed_grid_is_refused(cpu_study, demo_home, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(demo_home))
    out = cpu_study
    before = {p: p.stat().st_mtime_ns for p in (out / "runs").rglob("*.json")}
    assert study.main([str(CPU_GRID), "--out", str(out)]) == 0
    assert {p: p.stat().st_mtime_ns for p in (out / "runs").rglob("*.json")} == before
    assert "start " not in capsys.readouterr().out  # nothing was trained
    launch = tmp_path / "launch.toml"  # how kernels launch is not the run's: its finished runs stand
    launch.write_text(GRID.replace('args = ["--seq-len"', 'args = ["--compile-mode", "default", "--seq-len"'))
    assert study.main([str(launch), "--out", str(out), "--dry-run"]) == 0
    assert ": python -m" not in capsys.readouterr().out
    moved = tmp_path / "moved"  # nor where its files are: a study directory and its data may move
    shutil.copytree(out, moved)
    data = demo_home / ".cache/ppt/data/demo"
    shutil.copytree(data, tmp_path / "data")
    assert study.main([str(CPU_GRID), "--out", str(moved), "--data-dir", str(tmp_path / "data"), "--dry-run"]) == 0
    assert ": python -m" not in capsys.readouterr().out
    changed = tmp_path / "changed.toml"
    changed.write_text(GRID.replace('"--eval-tokens", "1024"', '"--eval-tokens", "512"'))
    with pytest.raises(PPTError, match="another command"):
        study.main([str(changed), "--out", str(out)])


def test_runs_on_other_tokens_are_refused(cpu_study, demo_home, monkeypatch):
    """A study's runs only pair up on the same tokens: a record made on other data (another tokenizer, other
    documents) stops the study instead of joining its fits."""
    monkeypatch.setenv("HOME", str(demo_home))
    path = next((cpu_study / "runs").rglob("*.json"))
    text = path.read_text()
    record = json.loads(text)
    record["data"]["fingerprint"] = "0" * 64
    path.write_text(json.dumps(record))
    try:
        with pytest.raises(PPTError, match=r"other tokens \(data fingerprint 000000000000\) .*prepare the data it"):
            study.main([str(CPU_GRID), "--out", str(cpu_study), "--dry-run"])
    finally:
        path.write_text(text)


def test_dry_run_prints_the_first_runs_and_trains_nothing(demo_home, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(demo_home))
    out = tmp_path / "out"
    assert study.main([str(CPU_GRID), "--out", str(out), "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "d1-f5e+09-lr0.003-s0: python -m scripts.base_train" in printed and "--deterministic" in printed
    planned_runs = printed.count(": python -m scripts.base_train")
    assert f"{planned_runs} runs called for now" in printed and f"{planned_runs} with no estimate" in printed
    assert not out.exists()


def test_a_bad_out_is_refused_with_one_message_before_any_run(demo_home, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(demo_home))
    (tmp_path / "a_file").write_text("mine")
    with pytest.raises(PPTError, match=r"cannot write into .*a_file/study \(Not a directory\); .*pass another --out"):
        study.main([str(CPU_GRID), "--out", str(tmp_path / "a_file" / "study")])
    assert (tmp_path / "a_file").read_text() == "mine"


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda g: g.replace("lrs = [1e-2]", "lrs = []"), "non-empty list"),
        (lambda g: g.replace('baseline = "vanilla"', 'baseline = "gpt2"'), "not an \\[arch"),
        (lambda g: g.replace('"--seq-len", "32"', '"--lr", "1", "--seq-len", "32"'), "--lr"),
        (lambda g: g.replace('"d1", "d2", "d3", "d4"', '"d1", "d2"'), "at least 3 config names"),
        (lambda g: g.replace("budgets = [5e9, 1.5e10]", "budgets = [-1]"), "positive"),
        (lambda g: g.replace("seeds = [0, 1]", "seeds = [0.5]"), "whole numbers"),
        (lambda g: g.replace("seeds = [0, 1]", "seeds = [0, 0]"), "repeats a value"),
        (lambda g: "sizes_per_budget = 2\n" + g, "at least 3"),
        (lambda g: "learning_rate = 3\n" + g, "unknown keys"),
        (lambda g: g + "\nlearning_rate = 3\n", "takes `sizes`, `lrs` and `args`"),
        (lambda g: g.replace("[arch.multiscreen]", "[arch.multiscreen"), "not valid TOML"),
        (lambda g: g.split("[arch.multiscreen]")[0], "at least two architectures"),
        (lambda g: g + '\n[slurm]\nqueue = "a"\n', "\\[slurm\\] takes partition"),
        (lambda g: g + "\n[slurm]\ntime_min = -1\n", "\\[slurm\\] time_min must be a non-negative integer"),
        # values base_train's parser refuses, found before any run starts
        (lambda g: g.replace('"--seq-len", "32"', '"--seq-len", "0"'), "--seq-len: '0' is not an integer >= 1"),
        # problems a dry run used to pass and the runs refused, or that failed with a traceback or the wrong blame
        (lambda g: g.replace("budgets = [5e9, 1.5e10]", "budgets = [5e9]"), "`budgets` has 1: a frontier joins"),
        (lambda g: g.replace('"multiscreen-d6"', '"d3"'), r"tables share sizes \['d3'\]: each size belongs to one"),
        (lambda g: g.replace('"d1", "d2"', '"d1", "d1"'), "names a size twice"),
        (lambda g: g.replace('data_dir = "~/.cache/ppt/data/demo"', "data_dir = 5"), "`data_dir` must be the path"),
        (lambda g: g.replace('name = "cpu"', 'name = "a/b"'), "`name` 'a/b' cannot start run names"),
        (lambda g: "tokens_per_param = [20, 30]\n" + g, "`tokens_per_param` takes one number"),
    ],
)
def test_bad_grids_are_refused_with_one_message(tmp_path, edit, message):
    assert edit(GRID) != GRID  # the edit applies to today's cpu.toml
    with pytest.raises(PPTError, match=message):
        study.load_grid(write_grid(tmp_path, edit(GRID)))


def test_what_the_runs_would_refuse_is_refused_by_the_dry_run(demo_home, tmp_path, monkeypatch):
    """Sizes out of order, rows longer than a size takes, a device this machine lacks, a budget too small for one
    step: refused before any run, by --dry-run too, each in one line."""
    monkeypatch.setenv("HOME", str(demo_home))
    edits = {('"d1", "d2", "d3", "d4"', '"d2", "d1", "d3", "d4"'): r"sizes must go smallest first",
             ('"--seq-len", "32"', '"--seq-len", "100000"'): r"d1 takes rows of at most \d+ tokens, .*--seq-len 100000",
             ('"--device", "cpu"', '"--device", "cuda"'): r"--device cuda: this machine has no cuda device",
             ("budgets = [5e9, 1.5e10]", "budgets = [1e3, 1.5e10]"): r"less than one step and the warmup"}  # fmt: skip
    for (old, new), message in edits.items():
        if "cuda" in new and torch.cuda.is_available():
            continue
        with pytest.raises(PPTError, match=message):
            study.main([str(write_grid(tmp_path, GRID.replace(old, new))), "--out", str(tmp_path / "o"), "--dry-run"])
    assert not (tmp_path / "o").exists()


def test_a_second_study_on_the_same_out_is_refused(demo_home, tmp_path, monkeypatch):
    """The study holds its --out: a second one (or a rerun while a killed one's runs would still train) stops."""
    monkeypatch.setenv("HOME", str(demo_home))
    out = tmp_path / "out"
    out.mkdir()
    owner = {"pid": os.getpid(), "host": socket.gethostname(), "started": "now", "argv": ["study"],
             "process_start": locks._process_start(os.getpid())}  # fmt: skip
    (out / locks.LOCK_NAME).write_text(json.dumps(owner))  # a live study: this process
    with pytest.raises(PPTError, match=r"in use by another run: pid \d+.*pass another --out"):
        study.main([str(CPU_GRID), "--out", str(out)])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_deterministic_run_is_bitwise_the_same_packed_or_alone_on_the_gpu(demo_home, tmp_path, monkeypatch):
    """Runs sharing a GPU (--runs-per-gpu 2) train the bits they train alone: compiled, CUDA graphs, deterministic."""
    monkeypatch.setenv("HOME", str(demo_home))
    on_gpu = GRID.replace('"--device", "cpu", "--compile", "off"', '"--log-every", "1"')  # compiled, CUDA graphs
    grid = study.load_grid(write_grid(tmp_path, on_gpu))
    runs = [study.Run("vanilla", "d1", 5e9, 3e-3, 0), study.Run("multiscreen", "multiscreen-d6", 5e9, 1e-2, 0)]
    losses = {}
    for k in (1, 2):
        s = study.Study(grid, tmp_path / f"k{k}", deterministic=True)
        pool = launchers.LocalPool(launchers.chosen_gpus("0"), k)
        for run in runs:  # alone: one after the other; packed: both at once
            s.log(run).parent.mkdir(parents=True, exist_ok=True)
            pool.start(run.name, s.argv(run), s.log(run), s.run_env)
            while k == 1 and pool.capacity == 0:
                assert all(code == 0 for _, code in pool.wait(study.WAIT_S))
        while pool.capacity < pool.slots:
            assert all(code == 0 for _, code in pool.wait(study.WAIT_S))
        for run in runs:
            record = RunRecord.load(s.run_dir(run) / f"cpu-{run.name}.json")
            assert record.hardware["runs_per_gpu"] == k
            losses.setdefault(run.name, []).append([h.get("loss") for h in record.history] + [record.final_val.val_bpb])
    assert all(alone == packed for alone, packed in losses.values())


# ---------------------------------------------------------------------------------------------------------------------
# Faults: a run that dies, a study stopped by a signal or killed, and their reruns


ONE_SEED = GRID.replace("seeds = [0, 1]", "seeds = [0]")  # the laptop study at one seed (its Slurm test)
ONE_SEED_RUNS = 2 * 2 * 3 + 3


def lock_pids(out: Path) -> dict[str, int]:
    """The runs in flight under a study directory: run name -> the live pid holding its lock (a killed run's stays)."""
    pids = {}
    for lock in out.glob(f"runs/*/{locks.LOCK_NAME}"):
        try:
            pids[lock.parent.name] = json.loads(lock.read_text())["pid"]
        except (OSError, ValueError):
            pass  # released meanwhile
    return {name: pid for name, pid in pids.items() if alive(pid)}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return locks._proc_stat(pid) is not None and locks._proc_stat(pid)[0] != "Z"


def wait_for(condition: object, timeout: float = 120.0) -> object:
    deadline = time.time() + timeout
    while not (value := condition()):
        assert time.time() < deadline, "timed out"
        time.sleep(0.1)
    return value


def kill_twice(out: Path, victim: str) -> None:
    """SIGKILL the process of run `victim` of the study in `out`, and again once it was started anew."""
    killed = None
    for _ in range(2):
        killed = wait_for(lambda: (pid := lock_pids(out).get(victim)) != killed and pid)  # noqa: B023
        os.kill(killed, signal.SIGKILL)


VICTIM = "d1-f5e+09-lr0.003-s1"  # a run the interrupted study kills twice


@pytest.fixture(scope="module")
def interrupted_study(demo_home: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict], str]:
    """The README's study two runs at a time, as a user's might go: a run dies twice, then the study is stopped by
    SIGTERM; started again, it is killed with kill -9 of its process group; started again, it runs to the end. Its
    directory, the runs in flight at each stop, and what the first start printed."""
    work = tmp_path_factory.mktemp("interrupted")
    out = work / "runs" / "cpu"
    env = {**os.environ, "HOME": str(demo_home), "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "scripts.study", str(CPU_GRID), "--runs-per-gpu", "2"]
    stopped, printed = [], ""
    for how in ("SIGTERM", "kill -9", None):
        if how is None:  # what a run killed between its last write and its exit leaves, in a finished run's folders
            record = next(p for p in out.glob("runs/*/*.json") if json.loads(p.read_text()).get("finished"))
            finished, tag = record.parent, json.loads(record.read_text())["run"]  # the run's folder, its --tag
            dead = 2**22 + 1  # above Linux's largest pid: no such process
            for leftover in (finished / locks.LOCK_NAME, out / "reports" / f".{tag}.lock"):
                leftover.write_text(json.dumps({"pid": dead, "host": socket.gethostname()}))
            (finished / f".{tag}_loss.png.{dead}.tmp").touch()
            (out / "reports" / f".{tag}.json.{dead}.tmp").touch()
        process = subprocess.Popen(command, cwd=work, env=env, start_new_session=True, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)  # fmt: skip
        if how is None:
            assert process.wait(timeout=600) == 0, process.stdout.read()[-3000:]
            break
        if how == "SIGTERM":
            kill_twice(out, VICTIM)
        stopped.append(wait_for(lambda: len(pids := lock_pids(out)) == 2 and pids))
        if how == "SIGTERM":
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=120) == 128 + signal.SIGINT
            printed = process.stdout.read()
        else:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return out, stopped, printed


def test_two_at_a_time_stopped_killed_and_failing_the_study_trains_the_runs_of_one_at_a_time_bit_for_bit(
    cpu_study, interrupted_study
):
    """Concurrency changes no decision: the plan is recomputed whenever a run ends and decides as one run at a time.
    SIGTERM stops the runs (each saves a checkpoint); kill -9 of the study's group stops them too (they die with the
    pool's server); a run that dies is retried once, resumed, and a second death is reported with its log's last
    error line while the others go on; each start resumes. The end: the same runs as one at a time, records equal but
    for times and hosts, the same results.md."""
    out, stopped, printed = interrupted_study
    assert [len(runs) for runs in stopped] == [2, 2] and not any(alive(pid) for r in stopped for pid in r.values())
    assert "end   d1 at 5e+09 FLOPs, seed 1, lr 0.003 on CPU: failed (killed)" in printed
    assert "trying it once more, resumed" in printed and f"; its log: runs/cpu/logs/{VICTIM}.log" in printed
    assert "stopped: " in printed
    assert not [*out.glob("runs/*/.*"), *out.glob("reports/.*")]  # no lock or temp file of a dead run is left
    assert_same_study(cpu_study, out)


# ---------------------------------------------------------------------------------------------------------------------
# Slurm: a real one (.ci/slurm.sh starts a one-node Slurm on the CI machine)


def slurm_up() -> bool:
    if shutil.which("sinfo") is None or shutil.which("sbatch") is None:
        return False
    nodes = subprocess.run(["sinfo", "--noheader", "--format=%T"], capture_output=True, text=True)
    return nodes.returncode == 0 and "idle" in nodes.stdout.split()


needs_slurm = pytest.mark.skipif(not slurm_up(), reason="needs a Slurm with an idle node (.ci/slurm.sh starts one)")
SLURM = ["--launcher", "slurm", "--partition", "debug", "--gpus-per-run", "0", "--cpus-per-run", "1"]


@needs_slurm
def test_the_cpu_study_through_slurm_adopts_its_jobs_resumes_a_requeued_one_and_matches_the_local_pool(
    cpu_study, demo_home, tmp_path, monkeypatch, capsys
):
    """One Slurm job a run, through submitit. A study killed (kill -9) while its jobs are queued and running is
    started again and follows those jobs instead of submitting them twice; meanwhile the local launcher is refused;
    a job requeued mid-run (as a preemption does) resumes from its checkpoint; the records and results.md equal the
    local pool's."""
    monkeypatch.setenv("HOME", str(demo_home))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(launchers, "SLURM_POLL_S", 1.0)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    grid = write_grid(tmp_path, ONE_SEED)
    first = subprocess.Popen([sys.executable, "-m", "scripts.study", str(grid), *SLURM], env=env,
                             start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    jobs_file = tmp_path / "runs" / "cpu" / "slurm" / "jobs.json"
    wait_for(lambda: jobs_file.is_file() and len(json.loads(jobs_file.read_text())) >= 4)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    in_flight = wait_for(lambda: launchers.jobs_in_flight(jobs_file.parent))
    with pytest.raises(PPTError, match=r"Slurm jobs still queued or running .*rerun with --launcher slurm .*scancel"):
        study.main([str(grid), "--launcher", "local"])
    out = tmp_path / "runs" / "cpu"  # a preemption of a job whose run trains: Slurm stops it (SIGTERM: the run saves)
    requeued_run = wait_for(lambda: next((name for name in lock_pids(out) if name in in_flight), None))  # and requeues
    requeued = in_flight[requeued_run]
    subprocess.run(["scontrol", "requeue", requeued], check=True)
    state = ["squeue", "--noheader", "--format=%T", f"--jobs={requeued}"]
    wait_for(lambda: subprocess.run(state, capture_output=True, text=True).stdout.strip() == "PENDING")
    subprocess.run(["scontrol", "update", f"JobId={requeued}", "StartTime=now"], check=True)  # no 2-minute hold
    assert study.main([str(grid), *SLURM]) == 0
    assert re.search(r"following [1-9]\d* runs an earlier study left in flight", capsys.readouterr().out)
    logs = {log.stem: log.read_text().count("$ python -m") for log in tmp_path.glob("runs/cpu/logs/*")}
    assert logs.pop(requeued_run) == 2 and set(logs.values()) == {1}  # none submitted twice
    compared = 0
    for record in out.glob("runs/*/*.json"):  # the bits of the local pool's run of that name (seed 0 of cpu.toml)
        if (reference := cpu_study / record.relative_to(out)).is_file():
            assert comparable(record) == comparable(reference), record.name
            compared += 1
    assert compared >= 10 and len(list(out.glob("runs/*/*.json"))) == ONE_SEED_RUNS


@needs_slurm
def test_a_partition_slurm_does_not_know_is_refused_with_its_message(demo_home, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(demo_home))
    flags = [*SLURM[:2], "--partition", "nosuch", *SLURM[4:]]
    with pytest.raises(PPTError, match=r"sbatch refused run d1-f5e\+09-lr0\.003-s0: .*invalid partition.*--partition"):
        study.main([str(CPU_GRID), "--out", str(tmp_path / "out"), *flags])


def test_bad_launch_flags_are_refused_in_one_line(demo_home, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(demo_home))
    run = [str(CPU_GRID), "--out", str(tmp_path / "out")]
    with pytest.raises(PPTError, match=r"--gpus 0: GPU 0 is not one of the GPUs this machine shows \(none\)"):
        study.main([*run, "--gpus", "0"]) if not torch.cuda.is_available() else pytest.skip("a GPU is visible")
    with pytest.raises(PPTError, match=r"--gpus 'x' is not 'all' or a list of GPU ids"):
        study.main([*run, "--gpus", "x"])
    with pytest.raises(PPTError, match=r"--runs-per-gpu 17 is out of range; pass 1 to 16"):
        study.main([*run, "--runs-per-gpu", "17"])
    with pytest.raises(SystemExit):  # argparse: "--runs-per-gpu: '0' is not an integer >= 1"
        study.main([*run, "--runs-per-gpu", "0"])
    monkeypatch.setitem(sys.modules, "submitit", None)  # not installed
    with pytest.raises(PPTError, match=r"--launcher slurm needs submitit: uv sync --extra slurm"):
        study.main([*run, "--launcher", "slurm"])
    monkeypatch.delitem(sys.modules, "submitit")
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch
    with pytest.raises(PPTError, match=r"--launcher slurm needs Slurm's sbatch and squeue on PATH"):
        study.main([*run, "--launcher", "slurm"])
    assert not (tmp_path / "out").exists()
