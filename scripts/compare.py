"""Put training runs side by side: a markdown table, and val bits-per-byte against tokens and comparison FLOPs.

    python -m scripts.compare smollm-360m multiscreen-d16            # run tags: <cache>/reports/<tag>.json
    python -m scripts.compare 'sweep-*' --baseline sweep-lr3e-3      # a glob of tags (or of paths)
    python -m scripts.compare 'runs/*.json' --baseline smollm-360m --plot bpb.png
    python -m scripts.compare a.json b.json --allow-mismatch         # on other data: the table shows what differs

Runs that differ only in their seeds (and in tag, output directory, world size, device batch, compilation and other
launch details) are one setting. The table gives each setting's parameters, tokens and comparison FLOPs (SPEC.md,
Measurement; marked * where the model could not be traced, so they count 6N alone), its final val bpb as mean ±
sample std (n seeds), the difference of means to the baseline setting with a 95% Welch interval ("n/a (one seed)"
when either side has one run), the paired difference where runs of both settings share seeds (seed i gives every
architecture the same data order and initialization seed, so the pairs share the data-order noise), wall time,
training tokens/s (the median step's) and the lm-eval scores base_eval recorded. The plot draws each setting's mean
val bpb at every evaluation, against tokens and against comparison FLOPs (log x), with the range over its seeds as
a band. Settings trained at different budgets, or runs of one budget whose realized comparison FLOPs differ by more
than 2%, get a note under the table: a difference across budgets is not a comparison at equal cost.

Runs on a different tokenizer, data, sequence length or evaluation token count are not comparable: compare refuses
them with one error unless --allow-mismatch, which adds a column per difference to the table. Runs on CPU.
"""

from __future__ import annotations

import argparse
import glob
import io
import json
import math
import os
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ppt.common import ArgumentParser, PPTError, atomic_file, cache_dir, print0, run_cli
from ppt.comparison_flops import ComparisonFlops
from ppt.formatting import duration, si
from ppt.frontier import paired_difference, t_quantile
from ppt.run import RunRecord, TrainSettings

# What must be equal for numbers to be comparable: (column name, how to read it from a record)
MUST_MATCH: dict[str, Callable[[RunRecord], Any]] = {
    "tokenizer": lambda r: r.tokenizer["fingerprint"],
    "data": lambda r: r.data["fingerprint"],
    "seq len": lambda r: r.train.seq_len,
    "eval tokens": lambda r: r.final_val.eval_tokens,
}
# The training settings that are launch details or seeds: they do not make a setting of their own
NOT_SETTING = {"device_batch_size", "grad_accum", "world_size", "ddp_find_unused_parameters", "compile", "compile_mode",
               "loader_prefetch", "skip_nonfinite", "eval_every", "seed", "data_seed", "model_seed", "deterministic",
               "recipe", "budget", "target_tokens", "warmup_tokens", "seq_len", "eval_tokens"}  # fmt: skip
OPTIMIZER_KEYS = ("role", "algorithm", "initial_lr", "betas", "eps", "momentum", "nesterov", "weight_decay")
FLOPS_TOLERANCE = 0.02  # runs of one budget whose realized comparison FLOPs differ by more are flagged


@dataclass
class Setting:
    label: str
    fields: dict[str, Any]
    runs: list[RunRecord]

    def final(self, key: str) -> list[float]:
        return [getattr(run.final_val, key) for run in self.runs]

    def by_seeds(self) -> dict[tuple[int, int], float]:
        return {run.seeds: run.final_val.val_bpb for run in self.runs}


def find_manifests(specs: list[str]) -> list[Path]:
    """Record paths from run tags (looked up in <cache>/reports), paths and globs, each once."""
    found: list[Path] = []
    reports = cache_dir() / "reports"
    for spec in specs:
        path, tagged = Path(spec).expanduser(), reports / f"{spec}.json"
        if glob.has_magic(spec):  # a glob of paths, else of run tags
            matches = sorted(Path(p) for p in glob.glob(str(path))) or sorted(Path(p) for p in glob.glob(str(tagged)))
            if not matches:
                raise PPTError(f"{spec!r} matches no manifest, nor any run tag in {reports}")
        elif path.is_file():
            matches = [path]
        elif tagged.is_file():
            matches = [tagged]
        else:
            raise PPTError(f"no run {spec!r}: not a file, and no {tagged}; pass a run tag, a manifest path or a glob")
        found += [m.resolve() for m in matches if m.resolve() not in found]
    return found


def load_finished(path: Path) -> RunRecord:
    record = RunRecord.load(path)
    if record.final_val is None:
        state = f"stopped at step {record.stopped_at}" if record.stopped_at else "has no final evaluation"
        raise PPTError(f"run {record.run} ({path}) {state}: finish it (base_train --resume auto) or leave it out")
    return record


def setting_fields(record: RunRecord) -> dict[str, Any]:
    """What defines a run's setting: all but the seeds, names, launch details, and the step counts a FLOPs budget
    sets (they vary with the documents of the first batch)."""
    train = record.train
    groups = [{k: g[k] for k in OPTIMIZER_KEYS if k in g} for g in train.optimizer_groups]
    derived = {"steps", "last_step", "warmup_steps"} if train.target_flops else set()
    settings = {f.name: getattr(train, f.name) for f in fields(TrainSettings) if f.name not in NOT_SETTING | derived}
    return (
        {"config": record.config_name, **{f"config.{k}": v for k, v in record.config.items()}}
        | settings
        | {"optimizer_groups": groups, "target_flops": train.target_flops}
        | {"model source": record.model_source.get("sha256", "")[:12] or None}
        | {name: read(record) for name, read in MUST_MATCH.items()}
    )


def _key(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def group_settings(runs: list[RunRecord]) -> list[Setting]:
    """Runs grouped by setting, in the order they were given, each labelled by what its runs were named (the tags'
    common stem: "books-s0" and "books-s1" are "books"), or where that names no setting alone, by its config name and
    whatever sets it apart from other settings of that config."""
    groups: dict[str, tuple[dict, list[RunRecord]]] = {}
    for run in runs:
        fields_ = setting_fields(run)
        groups.setdefault(_key(fields_), (fields_, []))[1].append(run)
    settings = []
    for fields_, members in groups.values():
        seen: dict[tuple, str] = {}
        for run in members:
            if run.seeds in seen:
                raise PPTError(
                    f"runs {seen[run.seeds]} and {run.run} have the same setting and seeds {run.seeds} (data, model): "
                    "one run twice; leave one out"
                )
            seen[run.seeds] = run.run
        same_config = [f for f, _ in groups.values() if f["config"] == fields_["config"]]
        # optimizer groups are too long for a label: settings told apart only by them are numbered below
        shown = [k for k in fields_ if k not in ("config", "optimizer_groups", *MUST_MATCH)]
        varying = [k for k in shown if len({_key(f.get(k)) for f in same_config}) > 1]
        details = ", ".join(f"{k}={_short(fields_[k])}" for k in varying)
        settings.append(Setting(str(fields_["config"]) + (f" ({details})" if details else ""), fields_, members))
    stems = [tag_stem([run.run for run in s.runs]) for s in settings]
    for setting, stem in zip(settings, stems, strict=True):
        if stem and stems.count(stem) == 1:
            setting.label = stem
    labels = [s.label for s in settings]  # before numbering: the last of a shared label must be numbered too
    for i, setting in enumerate(settings):  # settings told apart only by a MUST_MATCH difference or optimizer groups
        if labels.count(setting.label) > 1:
            setting.label += f" #{i + 1}"
    return settings


def tag_stem(tags: list[str]) -> str:
    """The name runs share: one run's tag, or several runs' common prefix less a trailing seed part ("-s", "_seed")."""
    return re.sub(r"[-_.]+(s|seed)?$", "", os.path.commonprefix(tags)) if len(tags) > 1 else tags[0]


def _short(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def check_comparable(runs: list[RunRecord], allow_mismatch: bool) -> list[str]:
    """The MUST_MATCH fields on which the runs differ; an error naming them unless allow_mismatch."""
    differing = [name for name, read in MUST_MATCH.items() if len({_key(read(r)) for r in runs}) > 1]
    if differing and not allow_mismatch:
        details = "; ".join(
            f"{name}: " + ", ".join(f"{r.run}={_cell(name, MUST_MATCH[name](r))}" for r in runs) for name in differing
        )
        raise PPTError(
            f"these runs are not comparable, they differ in {', '.join(differing)} ({details}); compare runs on the "
            "same tokenizer, data, sequence length and eval token count, or pass --allow-mismatch to show them side "
            "by side anyway"
        )
    return differing


def _cell(name: str, value: Any) -> str:
    return value[:12] if name in ("tokenizer", "data") else str(value)


# ---- statistics ---------------------------------------------------------------------------------------------------


def welch_interval(a: list[float], b: list[float]) -> tuple[float, float, float] | None:
    """(mean(a) - mean(b), low, high) with Welch's 95% t interval; None when either side has fewer than 2 values."""
    if len(a) < 2 or len(b) < 2:
        return None
    difference = statistics.fmean(a) - statistics.fmean(b)
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    if va + vb == 0:
        return difference, difference, difference
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = t_quantile(0.975, df) * math.sqrt(va + vb)
    return difference, difference - half, difference + half


def paired_interval(a: dict[Any, float], b: dict[Any, float]) -> tuple[float, float, float, int] | None:
    """ppt.frontier.paired_difference over the seeds both settings ran, and how many; None with fewer than 2."""
    shared = set(a) & set(b)
    found = paired_difference({k: a[k] for k in shared}, {k: b[k] for k in shared})
    return None if found is None else (*found, len(shared))


# ---- the table ----------------------------------------------------------------------------------------------------


def _bpb(values: list[float], regimes: dict[str, float]) -> str:
    mean, n = statistics.fmean(values), len(values)
    text = f"{mean:.4f} ± {statistics.stdev(values):.4f} (n={n})" if n > 1 else f"{mean:.4f} (n=1)"
    bigram = regimes.get("bigram")
    return text + (" (not below the bigram)" if bigram is not None and mean >= bigram else "")


def _differences(setting: Setting, baseline: Setting) -> list[str]:
    """The cells Δ bpb (Welch's interval) and paired Δ (over the seeds both ran) against the baseline."""
    if setting is baseline:
        return ["baseline", "baseline"]
    values, reference = setting.final("val_bpb"), baseline.final("val_bpb")
    interval = welch_interval(values, reference)
    if interval is None:
        welch = f"{statistics.fmean(values) - statistics.fmean(reference):+.4f}, n/a (one seed)"
    else:
        welch = "{:+.4f} [{:+.4f}, {:+.4f}]".format(*interval)
    pairs = paired_interval(setting.by_seeds(), baseline.by_seeds())
    return [welch, "-" if pairs is None else "{:+.4f} [{:+.4f}, {:+.4f}] ({} pairs)".format(*pairs)]


def pick_baseline(settings: list[Setting], baseline: str | None) -> Setting:
    """The setting named by label, config name (when one setting has it) or run tag; by default the first."""
    if baseline is None:
        return settings[0]
    for matches in (
        [s for s in settings if s.label == baseline],
        [s for s in settings if s.fields["config"] == baseline],
        [s for s in settings if any(r.run == baseline for r in s.runs)],
    ):
        if len(matches) == 1:
            return matches[0]
    raise PPTError(
        f"--baseline {baseline!r} names no single setting; use one of: " + "; ".join(s.label for s in settings)
    )


def budget_notes(settings: list[Setting]) -> list[str]:
    """Why a difference may not be at equal cost: settings of different budgets, or runs of one budget whose realized
    comparison FLOPs are more than FLOPS_TOLERANCE apart."""
    notes = []
    budgets = {s.label: s.fields["target_flops"] or f"{s.runs[0].train.target_tokens:,} tokens" for s in settings}
    if len({_key(b) for b in budgets.values()}) > 1:
        listed = "; ".join(f"{label}: {_short(b)}" for label, b in budgets.items())
        notes.append(f"note: these settings trained at different budgets ({listed}): Δ compares across budgets")
    by_budget: dict[float, list[RunRecord]] = {}
    for run in (r for s in settings for r in s.runs if r.train.target_flops):
        by_budget.setdefault(run.train.target_flops, []).append(run)
    for budget, runs in by_budget.items():
        realized = [r.comparison_flops for r in runs]
        if max(realized) > (1 + FLOPS_TOLERANCE) * min(realized):
            notes.append(
                f"warning: runs of budget {budget:.4g} realized {min(realized):.4g} to {max(realized):.4g} comparison "
                f"FLOPs ({100 * (max(realized) / min(realized) - 1):.1f}% apart, over {100 * FLOPS_TOLERANCE:g}%)"
            )
    return notes


def table(
    settings: list[Setting], baseline: Setting, differing: list[str], regimes: dict[str, float], times: bool = True
) -> str:
    """The markdown table, one row per setting; `regimes` (count-model bpb of the val tokens) add rows; `times`: the
    runs' wall time and tokens/s (a study leaves them out: they depend on what trained beside each run)."""
    benchmarks = list(dict.fromkeys(label for s in settings for r in s.runs for label in r.benchmark_scores()))
    header = ["setting", "seeds", "params", "tokens", "comparison FLOPs", "val bpb",
              f"Δ bpb vs {baseline.label} (95% CI)", "paired Δ (95% CI)", *["wall time", "tok/s"] * times,
              *differing, *benchmarks]  # fmt: skip
    lines = [_row(header), "|" + "---|" * len(header)]
    flagged = []  # settings whose rule could not count every mixer by its pairs: why
    for setting in settings:
        reasons = {ComparisonFlops.from_state_dict(r.comparison_flops_rule).warning() for r in setting.runs} - {None}
        flagged += [f"{setting.label}: {sorted(reasons)[0]}"] if reasons else []
        speeds = [s for s in (r.median_tok_per_s() for r in setting.runs) if s is not None]
        cells = [
            setting.label,
            str(len(setting.runs)),
            si(statistics.fmean(r.params for r in setting.runs)),
            si(statistics.fmean(setting.final("tokens"))),
            f"{statistics.fmean(setting.final('comparison_flops')):.4g}" + " *" * bool(reasons),
            _bpb(setting.final("val_bpb"), regimes),
            *_differences(setting, baseline),
            *[duration(statistics.fmean(setting.final("wall_time_s"))), si(statistics.fmean(speeds)) if speeds else "-"]
            * times,
        ]
        cells += [", ".join(sorted({_cell(name, MUST_MATCH[name](r)) for r in setting.runs})) for name in differing]
        for label in benchmarks:
            scores = [r.benchmark_scores()[label] for r in setting.runs if label in r.benchmark_scores()]
            cells.append(f"{statistics.fmean(scores):.1f}" if scores else "-")
        lines.append(_row(cells))
    for name, bpb in regimes.items():  # count-based models of the train split: what a run must beat to have learned
        cells = [f"{name} (train-split counts)", "-", "-", "-", "-", f"{bpb:.4f}"]
        lines.append(_row(cells + ["-"] * (len(header) - len(cells))))
    if flagged:
        lines.append("\n* not every token mixer counted by the pairs it needs (" + "; ".join(flagged) + ")")
    notes = budget_notes(settings)
    return "\n".join(lines + ([""] + notes if notes else []))


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


# ---- the plot -----------------------------------------------------------------------------------------------------


def plot(settings: list[Setting], path: Path) -> None:
    """Val bpb against tokens and against comparison FLOPs (log x): each setting's mean over its seeds at the
    evaluations they share, and the range over the seeds as a band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for setting in settings:
        by_step = [{e.step: e for e in run.evals} for run in setting.runs]
        steps = sorted(set.intersection(*(set(evals) for evals in by_step)))
        if not steps:
            continue
        bpb = [[evals[s].val_bpb for evals in by_step] for s in steps]
        y = [statistics.fmean(values) for values in bpb]
        for ax, x_key in zip(axes, ("tokens", "comparison_flops"), strict=True):
            x = [statistics.fmean(getattr(evals[s], x_key) for evals in by_step) for s in steps]
            (line,) = ax.plot(x, y, "o-", ms=3, lw=1.2, label=f"{setting.label} (n={len(setting.runs)})")
            if len(setting.runs) > 1:
                ax.fill_between(x, [min(v) for v in bpb], [max(v) for v in bpb], color=line.get_color(), alpha=0.2)
    for ax, label in zip(axes, ("tokens", "comparison FLOPs"), strict=True):
        ax.set(xscale="log", xlabel=label)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("val bits per byte")
    fig.suptitle("val bpb: mean over seeds, band from the lowest to the highest seed", fontsize=10)
    axes[1].legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, format=path.suffix[1:], dpi=120)
    plt.close(fig)
    try:
        with atomic_file(path) as f:
            f.write(image.getvalue())
    except OSError as exc:
        raise PPTError(f"could not write the plot {path} ({exc.strerror or exc}); pass another --plot") from exc


def plot_file(path: Path) -> Path:
    """The file --plot writes: `path`, with .png added when it has no extension (matplotlib would add one silently);
    a folder, or an extension matplotlib cannot write, is refused."""
    from matplotlib.backend_bases import FigureCanvasBase

    if path.is_dir():
        raise PPTError(f"--plot {path} is a folder; name the file to write, e.g. --plot {path / 'compare.png'}")
    if not path.suffix:
        return path.with_name(path.name + ".png")
    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    if path.suffix[1:].lower() not in formats:
        raise PPTError(
            f"--plot {path}: matplotlib writes no {path.suffix} files; end the name in .png (or {', '.join(formats)})"
        )
    return path


# ---- entry points -------------------------------------------------------------------------------------------------


def compare(
    runs: list[str | Path],
    baseline: str | None = None,
    allow_mismatch: bool = False,
    regimes: dict[str, float] | None = None,
) -> str:
    """The comparison table (markdown) of runs given as tags, manifest paths or globs."""
    settings, differing = load_settings(runs, allow_mismatch)
    return table(settings, pick_baseline(settings, baseline), differing, regimes or {})


def load_settings(runs: list[str | Path], allow_mismatch: bool) -> tuple[list[Setting], list[str]]:
    """The runs given as tags, manifest paths or globs, grouped into settings, and what differs between them."""
    loaded = [load_finished(path) for path in find_manifests([str(r) for r in runs])]
    if not loaded:
        raise PPTError("no runs to compare; pass run tags, manifest paths or globs")
    differing = check_comparable(loaded, allow_mismatch)
    return group_settings(loaded), differing


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run tags (<cache>/reports/<tag>.json), manifest paths, or globs")
    p.add_argument("--baseline", help="the setting compared to: its label, config or a run's tag (default: the first)")
    p.add_argument("--plot", type=Path, help="the plot file, .png if no suffix (default <cache>/reports/compare.png)")
    p.add_argument("--allow-mismatch", action="store_true", help="compare across tokenizer, data, seq len, eval tokens")
    args = p.parse_args(argv)
    plot_path = plot_file(args.plot or cache_dir() / "reports" / "compare.png")
    settings, differing = load_settings(args.runs, args.allow_mismatch)
    print0(table(settings, pick_baseline(settings, args.baseline), differing, {}))
    plot(settings, plot_path)  # after the table: a plot that cannot be written loses none of its numbers
    print0(f"\nplot: {plot_path}")


if __name__ == "__main__":
    run_cli(main)
