"""The command lines users type (README, issues, scripts/*.sh) are an interface: renaming a flag breaks them."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

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
    ],
    "scripts.prepare_fineweb": ["--source", "--out", "--shards", "--shard-tokens", "--val-tokens", "--workers"],
    "scripts.base_eval": [
        "--model-tag",
        "--checkpoint",
        "--hf-dir",
        "--protocol",
        "--tasks",
        "--limit",
        "--include-path",
    ],
    "scripts.export_hf": ["--model-tag", "--out"],
    "ppt.flops": ["--config", "--batch-size", "--seq-len", "--device"],
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
def help_texts() -> dict[str, dict]:
    out = subprocess.run([sys.executable, "-c", HELP_ALL, *FROZEN], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


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
