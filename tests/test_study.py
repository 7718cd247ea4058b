"""The study runner: a miniature grid (two tiny architectures, one budget, two seeds, a two-rate sweep) end to end on
CPU through real base_train processes, its resume, and its refusals."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from ppt.common import PPTError
from scripts import study

GRID = """
name = "mini"
data_dir = "{data}"
data_seed = 3
model_seeds = [0, 1]
budgets = [4e9]
baseline = "vanilla"
args = ["--seq-len", "32", "--total-batch-tokens", "128", "--device-batch-size", "4", "--eval-every", "0",
        "--eval-tokens", "256", "--save-every", "0", "--compile", "off", "--device", "cpu", "--warmup-tokens", "128"]

[arch.vanilla]
args = ["--config", "tiny"]
lrs = [1e-3, 3e-3]

[arch.screen]
args = ["--config", "multiscreen-tiny"]
lrs = [1e-2]
"""


def write_grid(tmp_path: Path, data: Path, text: str = GRID) -> Path:
    path = tmp_path / "grid.toml"
    path.write_text(textwrap.dedent(text).format(data=data))
    return path


@pytest.fixture(scope="module")
def finished_study(demo_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    tmp = tmp_path_factory.mktemp("study")
    grid, out = write_grid(tmp, demo_data_dir), tmp / "out"
    with pytest.MonkeyPatch.context() as mp:  # the runs' reports: the function-scoped private cache is not set up yet
        mp.setenv("PPT_CACHE", str(tmp / "cache"))
        assert study.main([str(grid), "--out", str(out), "--jobs", "2"]) == 0
    return grid, out, (out / "results.md").read_text()


def test_miniature_study_sweeps_runs_grid_and_compares(finished_study):
    grid, out, results = finished_study
    record = json.loads((out / "study.json").read_text())
    # the swept architecture got the rate with the lower sweep bpb; the single-rate one its only rate
    sweep = record["chosen"]["vanilla"]["sweep_bpb"]
    assert record["chosen"]["vanilla"]["lr"] == float(min(sweep, key=sweep.get))
    assert "screen" not in record["chosen"]
    # 2 sweep runs (vanilla, seed 0) + 2 archs x 2 seeds, one of which is the chosen sweep run: 5 run directories
    assert len(list((out / "runs").iterdir())) == 5
    grid_runs = [r for r in record["runs"].values() if r["phase"] == "grid"]
    assert len(grid_runs) == 4 and all(r["final_bpb"] < 20 for r in grid_runs)
    for run in grid_runs:  # one data order for every run, the model seed varies
        argv = run["argv"]
        assert argv[argv.index("--data-seed") + 1] == "3"
    assert "- vanilla: `--config tiny`, lr " in results and "| multiscreen-tiny | 2 |" in results
    assert (out / "frontier.png").stat().st_size > 1000


def test_rerun_skips_finished_runs(finished_study, capsys):
    grid, out, _ = finished_study
    before = {p: p.stat().st_mtime_ns for p in (out / "runs").rglob("*.pt")}
    assert study.main([str(grid), "--out", str(out)]) == 0
    assert {p: p.stat().st_mtime_ns for p in (out / "runs").rglob("*.pt")} == before
    assert "[1/" not in capsys.readouterr().out  # nothing was launched


def test_changed_grid_is_refused_not_mixed(finished_study, tmp_path):
    grid, out, _ = finished_study
    changed = tmp_path / "changed.toml"
    changed.write_text(grid.read_text().replace('"--eval-tokens", "256"', '"--eval-tokens", "128"'))
    with pytest.raises(PPTError, match="another command"):
        study.main([str(changed), "--out", str(out)])


def test_dry_run_prints_commands_and_runs_nothing(demo_data_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert study.main([str(write_grid(tmp_path, demo_data_dir)), "--out", str(out), "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("sweep vanilla") == 2 and "--target-flops 4000000000.0" in printed
    assert not out.exists()


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda g: g.replace("lrs = [1e-2]", "lrs = []"), "non-empty list"),
        (lambda g: g.replace('baseline = "vanilla"', 'baseline = "gpt2"'), "not an \\[arch"),
        (lambda g: g.replace('"--seq-len", "32"', '"--lr", "1", "--seq-len", "32"'), "--lr"),
        (lambda g: g.replace("budgets = [4e9]", "budgets = [-1]"), "positive"),
        (lambda g: g.replace("model_seeds = [0, 1]", "model_seeds = [0.5]"), "whole numbers"),
        (lambda g: g.replace("model_seeds = [0, 1]", "model_seeds = [0, 0]"), "repeats a value"),
        (lambda g: g.replace("lrs = [1e-3, 3e-3]", "lrs = [1e-3, 1.0001e-3]"), "repeats a value"),
        (lambda g: g.replace("data_seed = 3", "data_seed = [3, 4]"), "takes one number"),
        (lambda g: "learning_rate = 3\n" + g, "unknown keys"),
        (lambda g: g + "\nlearning_rate = 3\n", "takes exactly"),
        (lambda g: g.replace("[arch.screen]", "[arch.screen"), "not valid TOML"),
        # values base_train's parser refuses, found before any run starts, with the grid entry to fix
        (lambda g: g.replace('"--seq-len", "32"', '"--seq-len", "0"'), "--seq-len: '0' is not an integer >= 1.*args"),
        (lambda g: g.replace('["--config", "tiny"]', '["--optimizer", "sgd"]'), "--optimizer.*arch.vanilla\\] args"),
        (lambda g: g.replace("model_seeds = [0, 1]", "model_seeds = [1e30]"), "--model-seed.*fix `model_seeds`"),
    ],
)
def test_bad_grids_are_refused_with_one_message(tmp_path, edit, message):
    with pytest.raises(PPTError, match=message):
        study.load_grid(write_grid(tmp_path, tmp_path, edit(GRID)))


def test_a_run_refused_by_base_train_names_its_error(demo_data_dir, tmp_path, capsys):
    # a value base_train accepts as a flag but refuses once it knows the config: the run's own error line is repeated
    grid = GRID.replace('"--seq-len", "32"', '"--seq-len", "512"').replace("lrs = [1e-3, 3e-3]", "lrs = [1e-3]")
    grid = grid.replace("model_seeds = [0, 1]", "model_seeds = [0]").split("[arch.screen]")[0]
    assert study.main([str(write_grid(tmp_path, demo_data_dir, grid)), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "error: vanilla-f4e+09-lr0.001-s0 failed: --seq-len 512 exceeds the config's max_seq_len 256" in err
