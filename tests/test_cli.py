"""The command lines users type (README, issues, scripts/*.sh) are an interface: renaming a flag breaks them."""

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
        "--protocol",
        "--tasks",
        "--limit",
        "--include-path",
        "--no-wandb",
    ],
    "scripts.export_hf": ["--model-tag", "--out"],
    "ppt.flops": ["--config", "--batch-size", "--seq-len", "--device"],
}


@pytest.mark.parametrize("module", FROZEN)
def test_help_lists_the_frozen_flags(module):
    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    missing = [flag for flag in FROZEN[module] if flag not in out.stdout]
    assert not missing, f"{module} --help no longer offers {missing}"


def test_shell_scripts_use_only_existing_flags():
    """Every --flag the shell entry points pass to base_train appears in its --help."""
    help_text = subprocess.run(
        [sys.executable, "-m", "scripts.base_train", "--help"], capture_output=True, text=True, cwd=ROOT
    ).stdout
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
