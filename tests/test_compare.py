"""scripts.compare on hand-made manifests: seeds grouped into settings, the table's numbers, Welch's interval against
known t quantiles, the plot, and a refusal for each kind of incomparable run."""

from __future__ import annotations

import json
import math
import statistics
import tarfile
from pathlib import Path

import pytest
from records import write_manifest

from ppt.common import PPTError
from scripts.compare import compare, main, paired_interval, welch_interval


def rows(text: str) -> dict[str, list[str]]:
    lines = text.splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    body = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    return {row[0]: dict(zip(header, row, strict=True)) for row in body}


def test_welch_interval_by_hand():
    # a = [1, 3], b = [0, 2]: means 2 and 1, variances 2 each; se = sqrt(2/2 + 2/2), df = (1 + 1)^2 / (1 + 1) = 2
    difference, low, high = welch_interval([1.0, 3.0], [0.0, 2.0])
    assert difference == 1.0 and high - difference == pytest.approx(4.30265273 * math.sqrt(2), abs=1e-6)
    assert difference - low == pytest.approx(high - difference)
    assert welch_interval([1.0], [0.0, 2.0]) is None and welch_interval([1.0, 1.0], [0.5, 0.5]) == (0.5, 0.5, 0.5)


def test_table_groups_seeds_and_reports_means_intervals_and_benchmarks(tmp_path):
    vanilla = [1.10, 1.12, 1.14]
    screening = [1.05, 1.06]
    paths = [write_manifest(tmp_path, f"v{i}", bpb, data_seed=i, model_seed=i) for i, bpb in enumerate(vanilla)]
    paths += [
        write_manifest(tmp_path, f"s{i}", bpb, data_seed=i, config="screening", flops_per_token=4e6)
        for i, bpb in enumerate(screening)
    ]
    paths.append(write_manifest(tmp_path, "v-lr", 1.2, lr=1e-2))  # another setting of the same config
    eval_result = {"benchmarks": {"rows": {"HellaSwag": 30.0, "PIQA": 60.0}}}
    manifest = json.loads(paths[0].read_text())
    paths[0].write_text(json.dumps({**manifest, "eval": eval_result}))

    text = compare([str(tmp_path / "v*.json"), *map(str, paths[3:5])], baseline="v")
    table = rows(text)
    assert list(table) == ["v-lr", "v", "s"]  # as given (a glob sorted), each named by its runs' tags
    base = table["v"]
    assert base["seeds"] == "3" and base["params"] == "1.5M" and base["tokens"] == "20K"
    assert base["comparison FLOPs"] == f"{6e6 * 20_000:.4g}"
    assert base["val bpb"] == f"{statistics.fmean(vanilla):.4f} ± {statistics.stdev(vanilla):.4f} (n=3)"
    assert base["Δ bpb vs v (95% CI)"] == "baseline"
    assert base["wall time"] == "1m00s" and base["tok/s"] == "2K"  # the median step's, mean over the seeds
    assert (base["HellaSwag"], base["PIQA"]) == ("30.0", "60.0")  # the one seed that has them
    difference, low, high = welch_interval(screening, vanilla)
    assert table["s"]["Δ bpb vs v (95% CI)"] == f"{difference:+.4f} [{low:+.4f}, {high:+.4f}]"
    assert high < 0  # screening's bpb is lower at these numbers, beyond the seeds' spread
    assert table["s"]["HellaSwag"] == "-" and table["s"]["comparison FLOPs"] == f"{4e6 * 20_000:.4g}"
    assert table["v-lr"]["val bpb"] == "1.2000 (n=1)"
    assert table["v-lr"]["Δ bpb vs v (95% CI)"] == "+0.0800, n/a (one seed)"


def test_a_setting_whose_mixer_counted_densely_or_not_at_all_is_marked(tmp_path):
    """The rule each manifest records says what it could not count by pairs; compare marks those settings."""
    rule = {"seq_len": 256, "params_matmul": 1000}
    dense = {**rule, "mixers": [{"op": "bmm", "part": "blocks.attn", "calls": 2, "dense_flops_per_row": 8192}]}
    paths = [
        write_manifest(
            tmp_path, "v", 1.1, comparison_flops_rule={**rule, "mixers": [{"op": "sdpa", "heads": [[64, 256, 4]]}]}
        ),
        write_manifest(tmp_path, "d", 1.0, config="dense", comparison_flops_rule=dense),
        write_manifest(tmp_path, "n", 1.0, config="unseen", comparison_flops_rule={**rule, "mixers": []}),
    ]
    text = compare(list(map(str, paths)), baseline="vanilla")
    table = rows(text.split("\n\n")[0])
    assert not table["v"]["comparison FLOPs"].endswith("*")
    assert table["d"]["comparison FLOPs"].endswith(" *") and table["n"]["comparison FLOPs"].endswith(" *")
    assert "d: comparison FLOPs count a token mixer at its dense traced cost" in text
    assert "bmm in blocks.attn: ppt.flops.declare_token_mixer([(2 * (d_qk + d_v), reach)] * n_heads)" in text
    assert "n: comparison FLOPs found no token mixer" in text


def test_the_plot_and_the_command_line(tmp_path, capsys):
    paths = [write_manifest(tmp_path, f"v{i}", 1.1 + i / 100, data_seed=i) for i in range(2)]
    paths.append(write_manifest(tmp_path, "s0", 1.0, config="screening"))
    main([*map(str, paths), "--plot", str(tmp_path / "out" / "bpb.png"), "--baseline", "s0"])
    out = capsys.readouterr().out
    assert "| v | 2 |" in out and "Δ bpb vs s0 (95% CI)" in out and "n/a (one seed)" in out
    assert (tmp_path / "out" / "bpb.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot: {tmp_path / 'out' / 'bpb.png'}" in out
    # a name without an extension gets .png, as matplotlib writes it, and the path printed is that file
    main([*map(str, paths), "--plot", str(tmp_path / "out" / "curves")])
    assert f"plot: {tmp_path / 'out' / 'curves.png'}" in capsys.readouterr().out
    assert (tmp_path / "out" / "curves.png").is_file() and not (tmp_path / "out" / "curves").exists()
    with pytest.raises(PPTError, match="out is a folder; name the file to write, e.g. --plot .*out/compare.png"):
        main([*map(str, paths), "--plot", str(tmp_path / "out")])
    with pytest.raises(PPTError, match="matplotlib writes no .v2 files; end the name in .png"):
        main([*map(str, paths), "--plot", str(tmp_path / "out" / "bpb.v2")])
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["bpb.png", "curves.png"]
    # a plot that cannot be written: the table first, whole, then one error for the plot
    (tmp_path / "a_file").write_text("mine")
    with pytest.raises(PPTError, match=r"could not write the plot .*a_file/bpb\.png \(File exists\); pass another"):
        main([*map(str, paths), "--plot", str(tmp_path / "a_file" / "bpb.png")])
    assert "| v | 2 |" in capsys.readouterr().out


def test_run_tags_are_looked_up_in_the_reports_dir(offline_private_cache):
    reports = offline_private_cache / "reports"
    reports.mkdir()
    write_manifest(reports, "tagged", 1.3)
    assert "| tagged | 1 |" in compare(["tagged"])
    with pytest.raises(PPTError, match="no run 'absent'"):
        compare(["absent"])


@pytest.mark.parametrize(
    "field, value, named",
    [
        ("tokenizer.fingerprint", "ef" * 32, "tokenizer"),
        ("data.fingerprint", "01" * 32, "data"),
        ("train.seq_len", 512, "seq len"),
        ("final_val.eval_tokens", 8192, "eval tokens"),
    ],
)
def test_incomparable_runs_are_refused_unless_allowed_and_then_shown(tmp_path, field, value, named):
    paths = [
        write_manifest(tmp_path, "a", 1.1),
        write_manifest(tmp_path, "b", 1.0, config="screening", **{field: value}),
    ]
    with pytest.raises(PPTError, match=rf"not comparable, they differ in {named} \(.*--allow-mismatch"):
        compare(paths)
    table = rows(compare(paths, allow_mismatch=True))
    shown = str(value)[:12]
    assert table["b"][named] == shown and table["a"][named] != shown


def test_unfinished_and_duplicate_runs_and_unknown_baselines_are_refused(tmp_path):
    finished = write_manifest(tmp_path, "done", 1.1)
    stopped = write_manifest(tmp_path, "stopped", 1.1, data_seed=1)
    manifest = json.loads(stopped.read_text())
    stopped.write_text(json.dumps({**manifest, "finished": None, "stopped_at": 12}))
    with pytest.raises(PPTError, match="run stopped .* stopped at step 12: finish it"):
        compare([finished, stopped])
    twin = write_manifest(tmp_path, "twin", 1.2)
    with pytest.raises(PPTError, match="runs done and twin have the same setting and seeds"):
        compare([finished, twin])
    with pytest.raises(PPTError, match="--baseline 'nope' names no single setting; use one of: done"):
        compare([finished], baseline="nope")


def test_an_edited_model_of_the_same_config_name_is_its_own_setting(tmp_path):
    """The fork workflow: model.py edited, config name unchanged. Its runs must not pool with the original's."""
    paths = [
        write_manifest(
            tmp_path, f"{source}-s{seed}", bpb + 0.01 * seed, model_seed=seed, model_source={"sha256": source * 32}
        )  # fmt: skip
        for source, bpb in (("aa", 1.0), ("bb", 1.2))
        for seed in (0, 1)
    ]
    table = rows(compare(paths, baseline="aa-s0"))
    assert set(table) == {"aa", "bb"}  # seeds 0 and 1 of each
    assert all(row["seeds"] == "2" for row in table.values())


def test_model_source_hashes_model_py_and_the_kernels():
    from ppt.run import REPO_ROOT, model_source

    source = model_source()
    assert source["files"][0] == "ppt/model.py" and "ppt/kernels/screening.py" in source["files"]
    assert len(source["sha256"]) == 64 and source == model_source()
    assert all((REPO_ROOT / f).is_file() for f in source["files"])


def test_runs_that_share_seeds_are_compared_pair_by_pair(tmp_path):
    vanilla, screening = [1.10, 1.12, 1.14], [1.05, 1.08, 1.09]
    paths = [write_manifest(tmp_path, f"v{i}", bpb, data_seed=i, model_seed=i) for i, bpb in enumerate(vanilla)]
    paths += [
        write_manifest(tmp_path, f"s{i}", bpb, data_seed=i, model_seed=i, config="screening")
        for i, bpb in enumerate(screening)
    ]
    differences = [s - v for s, v in zip(screening, vanilla)]
    mean, sd = statistics.fmean(differences), statistics.stdev(differences)
    half = 4.30265273 * sd / math.sqrt(3)  # t(0.975, 2 df)
    assert paired_interval(dict(enumerate(screening)), dict(enumerate(vanilla))) == pytest.approx(
        (mean, mean - half, mean + half, 3)
    )
    table = rows(compare(paths, baseline="vanilla"))
    assert table["s"]["paired Δ (95% CI)"] == f"{mean:+.4f} [{mean - half:+.4f}, {mean + half:+.4f}] (3 pairs)"
    assert table["v"]["paired Δ (95% CI)"] == "baseline"
    assert paired_interval({0: 1.0}, {0: 2.0, 1: 3.0}) is None  # one pair: no interval


def test_differences_across_budgets_and_unequal_realized_flops_are_called_out(tmp_path):
    budget = {"target_flops": 1.2e11, "target_tokens": 20_000}
    same = [
        write_manifest(tmp_path, "v", 1.1, **{"train.budget": budget}),
        write_manifest(tmp_path, "s", 1.0, config="screening", flops_per_token=6.2e6, **{"train.budget": budget}),
    ]
    text = compare(same, baseline="vanilla")
    assert "across budgets" not in text and "warning: runs of budget 1.2e+11 realized 1.2e+11 to 1.24e+11" in text
    other = write_manifest(tmp_path, "o", 1.0, config="screening", **{"train.budget": {**budget, "target_flops": 2e11}})
    assert "note: these settings trained at different budgets" in compare([same[0], other], baseline="vanilla")


def test_seeds_of_one_flops_budget_are_one_setting_whatever_steps_it_became(tmp_path):
    """A FLOPs budget becomes steps at the first batch's documents, which each data order draws differently: the
    step counts it sets do not split a setting's seeds (a step count given by hand does)."""
    budget = {"target_flops": 1.2e11, "target_tokens": 20_000}
    paths = [
        write_manifest(tmp_path, f"v{seed}", 1.1, data_seed=seed, model_seed=seed, **{"train.budget": budget},
                       **{"train.steps": 20 + seed, "train.last_step": 20 + seed, "train.warmup_steps": 1 + seed})
        for seed in range(2)
    ]  # fmt: skip
    assert rows(compare(paths))["v"]["seeds"] == "2"
    by_hand = [
        write_manifest(tmp_path, f"h{steps}", 1.1, data_seed=steps, **{"train.steps": steps}) for steps in (20, 30)
    ]
    assert len(rows(compare(by_hand))) == 2


def test_count_baselines_are_rows_and_runs_not_below_the_bigram_are_marked(tmp_path):
    paths = [write_manifest(tmp_path, "v", 1.2), write_manifest(tmp_path, "s", 1.0, config="screening")]
    table = rows(compare(paths, regimes={"unigram": 2.5, "bigram": 1.1}))
    assert table["v"]["val bpb"] == "1.2000 (n=1) (not below the bigram)"
    assert table["s"]["val bpb"] == "1.0000 (n=1)"
    assert table["bigram (train-split counts)"]["val bpb"] == "1.1000"


def test_the_published_archive_compares_at_its_content_fingerprint(tmp_path):
    """docs/results/offline-h200.tar.gz, converted to format 2: its records carry the data fingerprint that shards
    prepared again from the same documents get (regenerated and checked when the archive was converted), so a rerun
    on them compares with it."""
    with tarfile.open(Path(__file__).parents[1] / "docs" / "results" / "offline-h200.tar.gz") as archive:
        archive.extractall(tmp_path, filter="data")
    paths = sorted(tmp_path.glob("offline-h200/study/runs/*-f3e+15-*/*.json"))
    table = rows(compare(paths, baseline="d6"))
    pair = ["offline-vanilla-f3e+15-lr0.001", "offline-multiscreen-f3e+15-lr0.064"]  # the tags' stems
    assert set(table) == set(pair) and table[pair[1]]["paired Δ (95% CI)"].endswith("(3 pairs)")
    record = json.loads(paths[0].read_text())
    assert record["format"] == 2 and record["data"]["fingerprint"].startswith("4453ef846c73")


def test_settings_whose_tags_share_a_stem_are_labelled_by_config_and_numbered_if_only_groups_differ(tmp_path):
    paths = [
        write_manifest(tmp_path, f"g-s{2 * i + seed}", 1.0 + i / 10, data_seed=seed,
                       **{"train.optimizer_groups": [{"lr": i}] * i})
        for i in range(3)
        for seed in (0, 1)
    ]  # fmt: skip
    assert set(rows(compare(paths))) == {"vanilla #1", "vanilla #2", "vanilla #3"}  # every setting's stem is "g"
