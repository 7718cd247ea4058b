"""The study runner: its decisions (sizes around the prior, sweeps that extend at an edge, sizes added past the
best) on a table of losses, then a miniature study end to end on CPU (two variants of the tests' architecture,
three sizes each, two budgets, two seeds), its resume and its refusals."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
import statistics
import textwrap
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from third_arch import GPT2Config

import ppt.model
from ppt import locks
from ppt.common import PPTError
from ppt.run import RunRecord
from scripts import study

SIZES = {  # added to model.py's CONFIGS while this module runs; FLOPs per token near those of model.py's d1-d3
    **{f"gpt2-{L}x{d}": GPT2Config(n_layer=L, d_model=d) for L, d in ((1, 64), (2, 128), (3, 192))},
    **{
        f"gqa-{L}x{d}": GPT2Config(n_layer=L, n_head=4, n_kv_head=2, d_model=d) for L, d in ((2, 64), (3, 96), (3, 128))
    },
}

GRID = """
name = "mini"
data_dir = "{data}"
seeds = [0, 1]
budgets = [3e9, 1e10]
baseline = "vanilla"
args = ["--seq-len", "32", "--total-batch-tokens", "128", "--device-batch-size", "4", "--eval-every", "0",
        "--eval-tokens", "256", "--save-every", "0", "--compile", "off", "--device", "cpu", "--warmup-tokens", "128",
        "--log-every", "100"]

[arch.vanilla]
sizes = ["gpt2-1x64", "gpt2-2x128", "gpt2-3x192"]
lrs = [3e-3]

[arch.gqa]
sizes = ["gqa-2x64", "gqa-3x96", "gqa-3x128"]
lrs = [1e-2]
"""


@pytest.fixture(scope="module", autouse=True)
def sizes() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        for name, config in SIZES.items():
            mp.setitem(ppt.model.CONFIGS, name, config)
        yield


def write_grid(tmp_path: Path, data: Path, text: str = GRID) -> Path:
    path = tmp_path / "grid.toml"
    path.write_text(textwrap.dedent(text).format(data=data))
    return path


def planned(grid: study.Grid, losses: dict) -> study.Study:
    """A study whose runs 'finish' with loss losses(run), planned until it asks for nothing more."""
    s = study.Study(grid, Path("/nonexistent"), deterministic=True)
    s.params = {size: 10 ** (i + 4) for a in grid.archs for i, size in enumerate(a.sizes)}
    s.loss = lambda run: losses(run)
    assert s.plan() == []
    return s


def table_grid(lrs: list[float], sizes: int = 6) -> study.Grid:
    archs = [study.Arch(name, [f"{name}{i}" for i in range(sizes)], lrs) for name in ("a", "b")]
    return study.Grid("t", Path("."), [0, 1], [1e12, 1e14], "a", archs, [], sizes_per_budget=3, tokens_per_param=20)


def test_a_best_rate_at_an_edge_extends_the_sweep_until_it_is_inside():
    best = 0.016  # losses fall towards 0.016 from both sides: the sweep [1e-3, 2e-3, 4e-3] must grow upwards
    s = planned(table_grid([1e-3, 2e-3, 4e-3]), lambda run: abs(math.log(run.lr / best)) + run.seed / 100)
    for rate in s.decisions["rates"].values():
        assert rate["lr"] == pytest.approx(best) and not rate["at_edge"] and rate["swept_at"] in (1e12, 1e14)
        assert [float(lr) for lr in rate["sweep"]] == pytest.approx([1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2, 3.2e-2])
    # each size is swept at the smallest budget that trains it: a3 first enters the sizes at 1e14
    assert s.decisions["sizes"]["a 1e+12"] == ["a0", "a1", "a2"] and "a3" in s.decisions["sizes"]["a 1e+14"]
    assert s.decisions["rates"]["a a0"]["swept_at"] == 1e12 and s.decisions["rates"]["a a3"]["swept_at"] == 1e14
    # a rate still falling after three extensions stays at the edge, and says so
    s = planned(table_grid([1e-3, 2e-3, 4e-3]), lambda run: -run.lr)
    assert all(r["at_edge"] and r["lr"] == pytest.approx(4e-3 * 2**3) for r in s.decisions["rates"].values())


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


def test_gpu_seconds_time_every_size_at_its_speed_in_the_grid_s_compile_mode():
    """The equal-time view: a run's tokens over its size's median training speed among runs made in the grid's
    --compile-mode; a size timed only in another mode has no GPU-seconds rather than a slower mode's."""
    s = planned(table_grid([1e-3]), lambda run: 1.0)
    s.grid.args = ["--compile-mode", "reduce-overhead"]
    for run in s.grid_runs():  # seed i runs at (i + 1) 1e5 tokens/s; b0 was only ever run in the default mode
        mode, speed = ("default", 1.0) if run.size == "b0" else ("reduce-overhead", 1e5 * (1 + run.seed))
        s.finished[run] = fake_record(
            argv=["--compile-mode", mode], history=[{"tok_per_s": speed}, {"val_bpb": 1.0}], tokens=1e6,
            params=s.params[run.size], final_val=SimpleNamespace(val_bpb=1.0), comparison_flops=1e12,
        )  # fmt: skip
    s.record = s.finished.get
    seconds = {(r.arch, r.size, r.budget, r.seed): r.seconds for r in study.run_results(s)}
    timed = 1e6 / statistics.median([1e5, 2e5])  # the size's seeds 0 and 1
    assert seconds[("a", 1e4, 1e12, 0)] == seconds[("a", 1e4, 1e12, 1)] == pytest.approx(timed)
    untimed = [x for (arch, size, _, _), x in seconds.items() if (arch, size) == ("b", 1e4)]
    assert untimed and all(x is None for x in untimed)


@pytest.fixture(scope="module")
def finished_study(demo_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    tmp = tmp_path_factory.mktemp("study")
    grid, out = write_grid(tmp, demo_data_dir), tmp / "out"
    with pytest.MonkeyPatch.context() as mp:  # the runs' reports: the function-scoped private cache is not set up yet
        mp.setenv("PPT_CACHE", str(tmp / "cache"))
        assert study.main([str(grid), "--out", str(out)]) == 0
    return grid, out, (out / "results.md").read_text()


def test_miniature_study_trains_every_size_and_seed_and_states_a_verdict(finished_study):
    grid, out, results = finished_study
    record = json.loads((out / "study.json").read_text())
    params = record["params"]
    assert record["deterministic"] and params["gpt2-1x64"] < params["gpt2-2x128"] < params["gpt2-3x192"]
    trained = {"vanilla": ["gpt2-1x64", "gpt2-2x128", "gpt2-3x192"], "gqa": ["gqa-2x64", "gqa-3x96", "gqa-3x128"]}
    assert record["sizes"] == {f"{a} {b}": sizes for a, sizes in trained.items() for b in ("3e+09", "1e+10")}
    assert len(record["rates"]) == 6  # one rate a size: given, not swept
    runs = sorted(p.name for p in (out / "runs").iterdir())
    assert len(runs) == 2 * 2 * 3 * 2 + 3  # archs x budgets x sizes x seeds, and the rerun floor's three
    assert f"Run time: {len(runs)} finished runs in {out / 'runs'}" in results
    for name in runs:  # seed i is --seed i for every run: one data order and one initialization seed per i
        argv = json.loads(next((out / "runs" / name).glob("*.json")).read_text())["argv"]
        assert argv[argv.index("--seed") + 1] == name.split("-s")[-1][0]
        assert ("--deterministic" in argv) == ("nondet" not in name)
    assert "## 3e+09 comparison FLOPs" in results and "## 1e+10 comparison FLOPs" in results
    for arch, sizes in trained.items():  # each budget's table: a row a size with both seeds, its rate and epochs
        for budget in ("3e+09", "1e+10"):
            table = results.split(f"## {budget} comparison FLOPs")[1]
            bpb = {size: float(re.search(rf"^\| {size} \(lr [0-9.e-]+, [0-9.e+-]+ epochs\) \| 2 \|(?:[^|]*\|){{3}} "
                                         r"([0-9.]+) ", table, re.M)[1]) for size in sizes}  # fmt: skip
            # a best size at an end of those trained gets a note saying why none past it ran (the grid lists none)
            best = min(bpb, key=bpb.get)
            note = f"- {arch} at {budget}: its best size {best} is the"
            assert (note in results) == (best != sizes[1]) and results.count(f"- {arch} at {budget}:") <= 1
    assert "bitwise equal" in results and "two runs without --deterministic" in results
    assert "bigram (train-split counts)" in results and "multiplier" in results.lower()
    assert (out / "frontier.png").stat().st_size > 1000


def test_rerun_trains_nothing_and_a_changed_grid_is_refused(finished_study, demo_data_dir, tmp_path, capsys):
    grid, out, _ = finished_study
    before = {p: p.stat().st_mtime_ns for p in (out / "runs").rglob("*.json")}
    assert study.main([str(grid), "--out", str(out)]) == 0
    assert {p: p.stat().st_mtime_ns for p in (out / "runs").rglob("*.json")} == before
    assert "[1]" not in capsys.readouterr().out  # nothing was trained
    launch = tmp_path / "launch.toml"  # how kernels launch is not the run's: its finished runs stand
    launch.write_text(
        grid.read_text().replace('args = ["--seq-len"', 'args = ["--compile-mode", "max-autotune", "--seq-len"')
    )
    assert study.main([str(launch), "--out", str(out), "--dry-run"]) == 0
    assert ": python -m" not in capsys.readouterr().out
    moved = tmp_path / "moved"  # nor where its files are: a study directory and its data may move
    shutil.copytree(out, moved)
    shutil.copytree(demo_data_dir, tmp_path / "data")
    assert study.main([str(grid), "--out", str(moved), "--data-dir", str(tmp_path / "data"), "--dry-run"]) == 0
    assert ": python -m" not in capsys.readouterr().out
    changed = tmp_path / "changed.toml"
    changed.write_text(grid.read_text().replace('"--eval-tokens", "256"', '"--eval-tokens", "128"'))
    with pytest.raises(PPTError, match="another command"):
        study.main([str(changed), "--out", str(out)])


def test_runs_on_other_tokens_are_refused(finished_study):
    """A study's runs only pair up on the same tokens: a record made on other data (another tokenizer, other
    documents) stops the study instead of joining its fits."""
    grid, out, _ = finished_study
    path = next((out / "runs").rglob("*.json"))
    text = path.read_text()
    record = json.loads(text)
    record["data"]["fingerprint"] = "0" * 64
    path.write_text(json.dumps(record))
    try:
        with pytest.raises(PPTError, match=r"other tokens \(data fingerprint 000000000000\) .*prepare the data it"):
            study.main([str(grid), "--out", str(out), "--dry-run"])
    finally:
        path.write_text(text)


def test_dry_run_prints_the_first_runs_and_trains_nothing(demo_data_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert study.main([str(write_grid(tmp_path, demo_data_dir)), "--out", str(out), "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "gpt2-1x64-f3e+09-lr0.003-s0: python -m scripts.base_train" in printed and "--deterministic" in printed
    planned_runs = printed.count(": python -m scripts.base_train")
    assert f"{planned_runs} runs called for now" in printed and f"{planned_runs} with no estimate" in printed
    assert not out.exists()


def test_a_bad_out_is_refused_with_one_message_before_any_run(demo_data_dir, tmp_path):
    (tmp_path / "a_file").write_text("mine")
    with pytest.raises(PPTError, match=r"cannot write into .*a_file/study \(Not a directory\); .*pass another --out"):
        study.main([str(write_grid(tmp_path, demo_data_dir)), "--out", str(tmp_path / "a_file" / "study")])
    assert (tmp_path / "a_file").read_text() == "mine"


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda g: g.replace("lrs = [1e-2]", "lrs = []"), "non-empty list"),
        (lambda g: g.replace('baseline = "vanilla"', 'baseline = "gpt2"'), "not an \\[arch"),
        (lambda g: g.replace('"--seq-len", "32"', '"--lr", "1", "--seq-len", "32"'), "--lr"),
        (lambda g: g.replace('"gpt2-1x64", "gpt2-2x128", ', '"gpt2-2x128", '), "at least 3 config names"),
        (lambda g: g.replace("budgets = [3e9, 1e10]", "budgets = [-1]"), "positive"),
        (lambda g: g.replace("seeds = [0, 1]", "seeds = [0.5]"), "whole numbers"),
        (lambda g: g.replace("seeds = [0, 1]", "seeds = [0, 0]"), "repeats a value"),
        (lambda g: "sizes_per_budget = 2\n" + g, "at least 3"),
        (lambda g: "learning_rate = 3\n" + g, "unknown keys"),
        (lambda g: g + "\nlearning_rate = 3\n", "takes `sizes`, `lrs` and `args`"),
        (lambda g: g.replace("[arch.gqa]", "[arch.gqa"), "not valid TOML"),
        (lambda g: g.split("[arch.gqa]")[0], "at least two architectures"),
        # values base_train's parser refuses, found before any run starts
        (lambda g: g.replace('"--seq-len", "32"', '"--seq-len", "0"'), "--seq-len: '0' is not an integer >= 1"),
    ],
)
def test_bad_grids_are_refused_with_one_message(tmp_path, edit, message):
    with pytest.raises(PPTError, match=message):
        study.load_grid(write_grid(tmp_path, tmp_path, edit(GRID)))


def test_a_second_study_on_the_same_out_is_refused(demo_data_dir, tmp_path):
    """The study holds its --out: a second one (or a rerun while a killed one's runs would still train) stops."""
    out = tmp_path / "out"
    out.mkdir()
    owner = {"pid": os.getpid(), "host": socket.gethostname(), "started": "now", "argv": ["study"],
             "process_start": locks._process_start(os.getpid())}  # fmt: skip
    (out / locks.LOCK_NAME).write_text(json.dumps(owner))  # a live study: this process
    with pytest.raises(PPTError, match=r"in use by another run: pid \d+.*pass another --out"):
        study.main([str(write_grid(tmp_path, demo_data_dir)), "--out", str(out)])
