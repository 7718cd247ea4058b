import json

import numpy as np
import pytest
from architectures import of_model_py

from ppt.common import PPTError, cache_dir
from ppt.model import get_config
from scripts.base_train import main


def benchmark_argv(data_dir, out_dir, max_steps: int) -> list[str]:
    sizes = "--config gpt2-tiny --seq-len 32 --device-batch-size 2 --total-batch-tokens 64 --benchmark".split()
    return [*sizes, "--data-dir", str(data_dir), "--max-steps", str(max_steps), "--out-dir", str(out_dir)]


def test_benchmark_mode_measures_without_touching_run_outputs(demo_data_dir, tmp_path, capsys):
    reports = cache_dir() / "reports"
    reports.mkdir(parents=True)
    real_report = reports / "gpt2-tiny.json"
    real_report.write_text('{"run": "gpt2-tiny", "from": "a real run"}')
    main(benchmark_argv(demo_data_dir, tmp_path / "out", max_steps=7))
    summary = json.loads(capsys.readouterr().out.split("benchmark ", 1)[1])
    assert summary["steps_measured"] == 2 and summary["tok_per_s"] > 0
    assert 0 <= summary["data_share"] < 1 and 0 < summary["optimizer_share"] < 1
    # the comparison rule's FLOPs (6N and the mixer's pairs) at the measured speed: what architectures compare by
    per_token = summary["comparison_flops_per_token"]
    assert per_token > summary["flops_per_token_6n"]
    assert summary["comparison_tflops"] == pytest.approx(per_token * summary["tok_per_s"] / 1e12)
    assert json.loads(real_report.read_text())["from"] == "a real run"  # the benchmark wrote no manifest
    assert not list((tmp_path / "out").glob("step_*.pt"))  # and no checkpoint


def test_objects_alive_after_the_first_step_leave_the_garbage_collectors_scans(demo_data_dir, tmp_path):
    import gc

    gc.unfreeze()
    try:
        main(benchmark_argv(demo_data_dir, tmp_path / "out", max_steps=6))
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_benchmark_needs_steps_after_warmup_and_says_so_before_training(demo_data_dir, tmp_path, capsys):
    with pytest.raises(PPTError, match="more than 5 steps"):
        main(benchmark_argv(demo_data_dir, tmp_path / "out", max_steps=3))
    assert "step " not in capsys.readouterr().out  # refused before the first step, not after the last


def test_profile_prints_where_the_recorded_steps_spent_their_time(demo_data_dir, tmp_path, capsys):
    main([*benchmark_argv(demo_data_dir, tmp_path / "out", max_steps=12), "--profile", "--log-every", "1"])
    out = capsys.readouterr().out
    assert "aten::mm" in out.split("wall time per iteration")[0]  # the op table comes first
    assert "over 3 recorded" in out and "step      9/12 (75.0%)" in out  # counted to --max-steps, not the schedule
    # the report prints at the start of step 9, after the recorded steps 6-8
    assert (
        out.index("wall time per iteration") < out.index("step      9/") and "step      8/" in out.split("aten::mm")[0]
    )
    # steps 6-9 (recording, then the report) stay out of the figures: steps 10-12 remain
    summary = json.loads(out.split("benchmark ", 1)[1])
    assert summary["steps_measured"] == 3 and summary["steps_profiled_left_out"] == 4


def test_benchmark_with_profile_needs_steps_after_the_profiled_ones(demo_data_dir, tmp_path):
    with pytest.raises(PPTError, match="more than 9 with --profile"):
        main([*benchmark_argv(demo_data_dir, tmp_path / "out", max_steps=9), "--profile"])


def test_deterministic_runs_repeat_their_losses_and_leave_the_setting_as_it_was(demo_data_dir, tmp_path, capsys):
    import torch

    def losses() -> list[str]:
        main([*benchmark_argv(demo_data_dir, tmp_path / "out", max_steps=6), "--deterministic", "--log-every", "1"])
        lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
        return [column.strip() for line in lines for column in line.split("|") if column.strip().startswith("loss")]

    first, second = losses(), losses()
    assert len(first) == 6 and first == second
    assert not torch.are_deterministic_algorithms_enabled()


def test_synthetic_phrases_repeat_a_small_phrase_book_and_uniform_tokens_do_not(tmp_path):
    from ppt.shards import read_shard, shard_path
    from ppt.synthetic import write_synthetic_data

    def distinct_successions(phrases: int) -> int:
        directory = tmp_path / f"phrases{phrases}"
        write_synthetic_data(directory, 4096, 20_000, 64, seed=0, phrases=phrases)
        tokens = np.asarray(read_shard(shard_path(directory, "train", 0))[1])
        return len(set(zip(tokens[:-1].tolist(), tokens[1:].tolist(), strict=True)))

    # 3 phrases of 8 tokens: 7 pairs inside each, 3 x 3 across, each of the 24 tokens before and after an EOT, and
    # EOT, EOT; uniform noise: nearly all pairs distinct
    assert distinct_successions(3) <= 3 * 7 + 3 * 3 + 2 * 24 + 1
    assert distinct_successions(0) > 15_000


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--optimizer", "foo", "argument --optimizer: invalid choice: 'foo'"),
        ("--compile", "on,maybe", "argument --compile: 'maybe' (in the list 'on,maybe') is not one of auto, on, off"),
        ("--doc-masks", "maybe", "argument --doc-masks: 'maybe' is not one of on, off"),
        ("--steps", "5", "argument --steps: '5' is not an integer >= 6"),  # base_train measures after the first 5
        ("--config", "d2,nope", "argument --config: unknown config 'nope'"),
    ],
)
def test_bench_train_refuses_a_bad_variant_before_running_any(run_tool, flag, value, message):
    code, out, err = run_tool("bench.bench_train", flag, value)
    assert code == 2 and err.startswith(f"error: {message}") and len(err.splitlines()) == 1
    assert "$" not in out  # no base_train was launched


@pytest.mark.parametrize("flag, value", [("--optimizer", "foo"), ("--compile", "maybe")])
def test_check_ddp_refuses_what_base_train_would_not_run(run_tool, flag, value):
    code, _, err = run_tool("bench.check_ddp", flag, value)
    assert code == 2 and err.startswith(f"error: argument {flag}: invalid choice: '{value}'")


def test_bench_train_fails_when_a_variant_fails(run_tool):
    # rows twice the config's max_seq_len: base_train refuses the run; the table still prints, then the tool exits 2
    name = of_model_py()  # base_train runs in a child process
    argv = f"--config {name} --seq-len {2 * get_config(name).max_seq_len} --device-batch-size 1 --steps 6".split()
    code, out, err = run_tool("bench.bench_train", *argv, *"--vocab-size 512 --compile off".split())
    assert code == 2 and f"| {name} | off | on | exit 2 |" in out.split("| config |")[-1]
    assert err.splitlines()[-1] == (
        f"error: 1 of 1 variants failed (--config {name} --compile off --doc-masks on); their output is above"
    )


def test_bench_train_measures_architectures_side_by_side(run_tool, tmp_path):
    import third_arch
    from architectures import smallest_config_per_class

    names = [name for name in smallest_config_per_class() if name not in third_arch.CONFIGS]  # child processes
    argv = f"--config {','.join(names)} --seq-len 32 --device-batch-size 2 --steps 6 --vocab-size 512 --compile off"
    # --device is base_train's: it passes through whole, not read as an abbreviation of --device-batch-size
    code, out, err = run_tool(
        "bench.bench_train", *argv.split(), "--device", "cpu", "--out", str(tmp_path / "rows.json")
    )
    assert code == 0, err
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [r["config"] for r in rows] == names and all(r["base_train_flags"] == "--device cpu" for r in rows)
    table = out.split("| config |")[-1]
    for r in rows:
        assert r["comparison_tflops"] > 0 and f"| {r['config']} | off | on | {r['tok_per_s']:,.0f} |" in table
        (other,) = [o for o in rows if o is not r]  # one config a class: the other architecture's is the nearest
        share = r["comparison_tflops"] / other["comparison_tflops"]
        assert r["share_at_equal_parameters"] == {"config": other["config"], "share": share}
        assert f" {100 * share:.0f}% of {other['config']} |" in table.split(f"| {r['config']} |")[1].splitlines()[0]


def test_bench_train_sets_each_row_against_the_other_architecture_at_its_parameter_count():
    from bench.bench_train import add_shares_at_equal_parameters

    def row(config, params, tflops, compile="on"):
        return {"config": config, "params": params, "comparison_tflops": tflops, "compile": compile, "doc_masks": "on"}

    rows = [
        row("d4", 8e6, 100.0),
        row("d8", 32e6, 200.0),
        row("multiscreen-d11", 4e6, 50.0),
        row("multiscreen-d19", 16e6, 150.0),
        row("multiscreen-d21", 40e6, 10.0, compile="off"),  # no vanilla row compiled off: none to set it against
        {"config": "d6", "compile": "on", "doc_masks": "on", "error": "exit 2"},  # failed: neither side
    ]
    add_shares_at_equal_parameters(rows)
    shares = {r["config"]: r.get("share_at_equal_parameters") for r in rows}
    # bracketed: the other side's rate halfway in log(parameters) between its two rows; else its nearest row's
    assert shares == {
        "d4": {"config": "multiscreen-d11-multiscreen-d19 at 8.0M parameters", "share": pytest.approx(1.0)},
        "d8": {"config": "multiscreen-d19", "share": 200 / 150},
        "multiscreen-d11": {"config": "d4", "share": 0.5},
        "multiscreen-d19": {"config": "d4-d8 at 16.0M parameters", "share": pytest.approx(1.0)},
        "multiscreen-d21": None,
        "d6": None,
    }
