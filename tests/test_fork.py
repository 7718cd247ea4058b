"""The fork the template is for, acted out: ppt/ copied with a model.py that is tests/third_arch.py's decoder alone,
under other names (no Llama, no Multiscreen, no OP_FORMULAS, no hf_mapping), and tests of fixed code run against it
in a child process. They pass because they take their models from tests/third_arch.py or from discovery, and import
of model.py only what SPEC.md promises."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FORKED_ENTRY_POINTS = """

from ppt.contract import build

DEFAULT_CONFIG = "forked-tiny"
MODELS = {ForkedConfig: Forked}


def get_config(name: str | None = None, depth: int | None = None) -> ForkedConfig:
    if depth is not None or (name or DEFAULT_CONFIG) not in CONFIGS:
        raise PPTError(f"unknown config {name!r}; valid names: {', '.join(CONFIGS)}")
    return replace(CONFIGS[name or DEFAULT_CONFIG])


def build_model(config: ForkedConfig) -> nn.Module:
    return build(MODELS, config)
"""


def test_tests_of_fixed_code_pass_on_a_model_py_without_the_shipped_architectures(tmp_path):
    for part in ("ppt", "scripts", "bench", "tests"):
        shutil.copytree(REPO / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    decoder = (REPO / "tests" / "third_arch.py").read_text().split("\ndef build(")[0].replace("GPT2", "Forked")
    decoder = decoder.replace("gpt2-", "forked-").replace("import dataclass\n", "import dataclass, replace\n")
    (tmp_path / "ppt" / "model.py").write_text(decoder.rstrip() + FORKED_ENTRY_POINTS)
    files = ["tests/test_optim.py", "tests/test_flops.py"]  # the optimizer on each architecture found, scripts.flops
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-x", "-q", "-rA", "-p", "no:cacheprovider", *files],
        cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert child.returncode == 0, child.stdout[-4000:] + child.stderr[-2000:]
    assert "PASSED tests/test_optim.py::test_batched_step_equals_the_per_matrix_step[muon-forked-tiny]" in child.stdout
