"""The command lines users type (README, issues, scripts/*.sh) are an interface: renaming a flag breaks them."""

import argparse
import importlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ppt.common import ArgumentParser, Number

ROOT = Path(__file__).resolve().parent.parent

FROZEN = {
    "scripts.base_train": [
        "--config",
        "--depth",
        "--data-dir",
        "--seq-len",
        "--total-batch-tokens",
        "--device-batch-size",
        "--target-tokens",
        "--optimizer",
        "--lr",
        "--schedule",
        "--eval-every",
        "--save-every",
        "--keep",
        "--resume",
        "--run",
        "--seed",
        "--compile",
        "--max-steps",
        "--skip-nonfinite",
        "--benchmark",
        "--tag",
        "--out-dir",
        "--data-seed",
        "--model-seed",
        "--target-flops",
        "--from-manifest",
        "--recipe",
        "--no-doc-masks",
    ],
    "scripts.compare": ["--baseline", "--plot", "--allow-mismatch"],
    "scripts.prepare_fineweb": ["--source", "--out", "--shards", "--shard-tokens", "--val-tokens", "--workers"],
    "scripts.base_eval": [
        "--model-tag",
        "--checkpoint",
        "--hf-dir",
        "--protocol",
        "--tasks",
        "--limit",
        "--include-path",
        "--no-wandb",
    ],
    "scripts.export_hf": ["--model-tag", "--out"],
    "scripts.flops": ["--config", "--batch-size", "--seq-len", "--device"],
    # measurement tools: an outside baseline is a path given on the command line
    "bench.bench_screening": ["--ref", "--baseline", "--profile"],
    "bench.bench_optimizer": ["--baseline-optim"],
    "bench.bench_cross_entropy": ["--tokens", "--sweep"],
    "bench.bench_train": ["--config", "--steps", "--compile", "--nproc", "--profile"],
    "bench.count_launches": ["--config"],
    "bench.check_hf_import": ["--hf-dir", "--max-bpb"],
}


# Run as `python -m MODULE --help` would run it (as __main__, in a fresh process), but all in one process: each
# start that imports torch costs seconds.
HELP_ALL = """
import contextlib, io, json, runpy, sys
texts = {}
for module in sys.argv[1:]:
    sys.argv, out, code = [module, "--help"], io.StringIO(), None
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as exc:
            code = exc.code
    texts[module] = {"code": code, "stdout": out.getvalue()}
print(json.dumps(texts))
"""


@pytest.fixture(scope="module")
def help_places(tmp_path_factory) -> dict[str, Path]:
    """Empty cache, home and temp directories for the --help process: what it writes there shows."""
    return {name: tmp_path_factory.mktemp(f"help_{name}") for name in ("PPT_CACHE", "HOME", "TMPDIR")}


@pytest.fixture(scope="module")
def help_texts(help_places) -> dict[str, dict]:
    env = {**os.environ, **{name: str(place) for name, place in help_places.items()}}
    # torch.compile in this process sets TORCHINDUCTOR_CACHE_DIR, which would hide a cache made under TMPDIR
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    out = subprocess.run([sys.executable, "-c", HELP_ALL, *FROZEN], capture_output=True, text=True, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_help_in_a_fresh_process_writes_nothing(help_texts, help_places):
    """tests/test_reliability.py checks each --help in a process that has imported every module already; here they run
    from a fresh start, so that what an import or a main does on the way to --help shows (torch._inductor, imported
    on the way, makes its cache directory under the temp dir)."""
    written = {name: sorted(str(p.relative_to(place)) for p in place.rglob("*")) for name, place in help_places.items()}
    assert written == {name: [] for name in help_places}


@pytest.mark.parametrize("module", FROZEN)
def test_help_lists_the_frozen_flags(module, help_texts):
    shown = help_texts[module]
    assert shown["code"] == 0, f"{module} --help exited with {shown['code']}"
    missing = [flag for flag in FROZEN[module] if flag not in shown["stdout"]]
    assert not missing, f"{module} --help no longer offers {missing}"


def test_shell_scripts_use_only_existing_flags(help_texts):
    """Every --flag the shell entry points pass to base_train appears in its --help."""
    help_text = help_texts["scripts.base_train"]["stdout"]
    for script in ("train.sh", "run_cpu.sh"):
        lines = (ROOT / "scripts" / script).read_text().splitlines()
        start = next(i for i, line in enumerate(lines) if "-m scripts.base_train" in line and not line.startswith("#"))
        command = []
        for line in lines[start:]:
            command += line.split()
            if not line.rstrip().endswith("\\"):
                break
        command = command[command.index("scripts.base_train") :]
        flags = [word.split("=")[0] for word in command if word.startswith("--")]
        unknown = [flag for flag in flags if flag not in help_text]
        assert flags and not unknown, f"scripts/{script} passes {unknown}, which base_train does not accept"


def test_run_cpu_names_a_run_on_ones_own_corpus_apart_from_the_demo_run(tmp_path):
    """Without --tag, a corpus of one's own trains as cpu-<config>-<its folder>, not as the demo run (whose checkpoint
    the default name would otherwise try to resume, on another vocabulary)."""
    (tmp_path / "uv").write_text('#!/bin/sh\n[ "$1" = run ] && echo "$@" >> "$(dirname "$0")/commands"\nexit 0\n')
    (tmp_path / "uv").chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "PPT_CACHE": str(tmp_path / "cache")}
    for extra in ([], ["--data-dir", str(tmp_path / "books")], ["--config", "multiscreen-tiny", "--data-dir", "b/"]):
        subprocess.run(["bash", str(ROOT / "scripts" / "run_cpu.sh"), *extra], env=env, check=True, capture_output=True)
    trains = [line.split() for line in (tmp_path / "commands").read_text().splitlines() if "scripts.base_train" in line]
    tags = [words[words.index("--tag") + 1] for words in trains]
    assert tags == ["cpu-tiny", "cpu-tiny-books", "cpu-multiscreen-tiny-b"]


# ---- every numeric flag of every entry point refuses bad values ------------------------------------------------------

ENTRY_POINTS = [  # what users start and the measurement tools, found so that a new one is covered without a test edit
    f"{folder}.{p.stem}"
    for folder in ("scripts", "bench")
    for p in sorted((ROOT / folder).glob("*.py"))
    if 'if __name__ == "__main__":' in p.read_text()
]
NOT_OURS = {"scripts.lm_eval"}  # lm-eval's own command line, flags and checks
BAD_VALUES = {
    "zero": "0",
    "negative": "-1",
    "nan": "nan",
    "inf": "inf",
    "absurdly large": "1" + "0" * 30,
    "word": "ten",
}


class Captured(BaseException):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def parser_of(module_name: str) -> argparse.ArgumentParser:
    """The parser an entry point builds, caught as it starts parsing (so nothing else of main runs)."""
    module = importlib.import_module(module_name)

    def capture(self, args=None, namespace=None):
        raise Captured(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(argparse.ArgumentParser, "parse_known_args", capture)
        mp.setattr(sys, "argv", [module_name])
        with pytest.raises(Captured) as captured:
            module.main()
    return captured.value.parser


def numeric_flags(parser: argparse.ArgumentParser) -> dict[str, Number]:
    return {a.option_strings[-1]: a.type for a in parser._actions if isinstance(a.type, Number)}


def accepts(check: Number, kind: str) -> bool:
    """Which kinds of value a flag's declared range takes: 0 when its minimum allows it, any finite number of any
    size when it is an unbounded float; never a negative (no flag goes below 0), NaN, inf or a word."""
    if kind == "zero":
        return check.minimum < 0 or (check.minimum == 0 and not check.above)
    return kind == "absurdly large" and check.kind is float and check.maximum == math.inf


@pytest.mark.parametrize("module", [m for m in ENTRY_POINTS if m not in NOT_OURS])
def test_every_numeric_flag_declares_its_range(module):
    """A flag typed plain int or float (or with a numeric default and no type) takes 0, negatives, NaN and inf."""
    parser = parser_of(module)
    unchecked = [
        a.option_strings[-1]
        for a in parser._actions
        if a.type in (int, float)
        or (a.type is None and a.nargs != 0 and type(a.default) in (int, float) and a.option_strings)
    ]
    assert not unchecked, f"{module}: give {unchecked} a ppt.common.Number type (positive_int, nonneg_float, ...)"
    assert isinstance(parser, ArgumentParser), f"{module}: build the parser with ppt.common.ArgumentParser"


@pytest.mark.parametrize("kind", BAD_VALUES)
@pytest.mark.parametrize("module", [m for m in ENTRY_POINTS if m not in NOT_OURS])
def test_bad_numbers_stop_with_one_line_naming_the_flag_the_value_and_what_it_takes(module, kind, capsys):
    parser = parser_of(module)
    value = BAD_VALUES[kind]
    # required arguments get a placeholder, so that an accepted value parses
    required = [x for a in parser._actions if a.required for x in ([a.option_strings[-1]] if a.option_strings else [])]
    placeholders = [x for flag in required for x in (flag, "x")]
    placeholders += ["x" for a in parser._actions if a.required and not a.option_strings]
    wrong = []
    for flag, check in numeric_flags(parser).items():
        if accepts(check, kind):
            parsed = vars(parser.parse_args([*placeholders, f"{flag}={value}"]))[
                parser._option_string_actions[flag].dest
            ]
            if parsed != check.kind(float(value)):
                wrong.append(f"{flag}={value} parsed as {parsed!r}")
            continue
        with pytest.raises(SystemExit) as stopped:
            parser.parse_args([f"{flag}={value}"])
        err = capsys.readouterr().err
        if (
            stopped.value.code != 2
            or err != f"error: argument {flag}: {value!r} is not {check.accepted} (see --help)\n"
        ):
            wrong.append(f"{flag}={value}: exit {stopped.value.code}, {err!r}")
    assert not wrong, wrong


def test_the_sweep_covers_the_flags_the_issue_named():
    train = numeric_flags(parser_of("scripts.base_train"))
    assert {"--device-batch-size", "--seq-len", "--total-batch-tokens", "--target-tokens", "--lr"} <= set(train)
    assert not accepts(train["--lr"], "zero") and not accepts(train["--total-batch-tokens"], "zero")
    prepare = numeric_flags(parser_of("scripts.prepare_fineweb"))
    assert {"--shards", "--shard-tokens", "--val-tokens", "--workers", "--vocab-size", "--shuffle-seed"} <= set(prepare)
    assert {"--batch-size", "--eval-tokens", "--limit"} <= set(numeric_flags(parser_of("scripts.base_eval")))
