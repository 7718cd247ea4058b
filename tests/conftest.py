"""Shared fixtures. Every test runs offline with a private cache dir, so nothing reads or writes ~/.cache/ppt."""

from __future__ import annotations

import json
import os
import runpy
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import third_arch
import torch

import ppt.model
from ppt.shards import write_shard

# A third architecture joins ppt/model.py for the whole test run, before any test module imports it: every test that
# discovers the architectures runs on it as on the shipped two (tests/third_arch.py).
third_arch.register(ppt.model)

# Set before any test module imports huggingface_hub, which reads these once at import.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO_VOCAB = 512  # small enough that training and tokenizing the demo corpus take well under a second


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One torch thread for a module's tests (`pytestmark = pytest.mark.usefixtures("one_thread")`): tiny steps gain
    nothing from threads, and on a shared 2-core machine spinning threads slow everyone down."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def offline_private_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # again, in case a test changed it
    cache = tmp_path_factory.mktemp("ppt_cache")
    monkeypatch.setenv("PPT_CACHE", str(cache))
    return cache


@pytest.fixture(scope="session")
def demo_data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The offline demo corpus prepared into small shards (vocab 512, 8k-token train shards, 4k val); read-only."""
    from scripts.prepare_fineweb import main

    out = tmp_path_factory.mktemp("demo_data")
    argv = ["--source", "demo", "--out", str(out), "--vocab-size", str(DEMO_VOCAB), "--workers", "1"]
    assert main([*argv, "--shard-tokens", "8000", "--val-tokens", "4000"]) == 0
    return out


@pytest.fixture(scope="session")
def short_docs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Synthetic shards of short documents (about 12 tokens, vocab 512), so 32-token rows hold several; read-only."""
    from ppt.synthetic import write_synthetic_data

    directory = tmp_path_factory.mktemp("short_docs")
    write_synthetic_data(directory, 512, 20_000, 12, seed=0, val_tokens=2048, phrases=50)
    return directory


@pytest.fixture
def make_token_dir(tmp_path: Path) -> Callable[..., Path]:
    """Returns write(splits, vocab_size, eot_id=0): hand-made streams {"train": [stream, ...], "val": [...]} as a
    data directory under tmp_path (fingerprint "ab" * 32, tokenizer name "test-tokenizer")."""

    def write(splits: dict[str, list[np.ndarray]], vocab_size: int, eot_id: int = 0) -> Path:
        for split, streams in splits.items():
            for index, stream in enumerate(streams):
                write_shard(
                    tmp_path / "data" / f"{split}_{index:05d}.bin",
                    stream,
                    vocab_size=vocab_size,
                    eot_id=eot_id,
                    fingerprint="ab" * 32,
                    demo=False,
                    tokenizer_name="test-tokenizer",
                )
        return tmp_path / "data"

    return write


@pytest.fixture
def run_tool(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> Callable[..., tuple[int, str, str]]:
    """Returns run(module, *args): a measurement tool run as its command runs it (`python -m bench.NAME ARGS`, as
    __main__), in this process, so tests use bench/ through its command line only; gives (exit status, stdout,
    stderr)."""

    def run(module: str, *args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        monkeypatch.setattr(sys, "argv", [module, *args])
        # as a fresh `python -m` sees it: runpy warns when a test imported the module before
        monkeypatch.delitem(sys.modules, module, raising=False)
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture
def check_in_interpreter() -> Callable[[str, int], None]:
    """check(script, n): run script under Triton's CPU interpreter (TRITON_INTERPRET must be set before triton is
    imported, so in a subprocess); its last line is JSON {name: relative error against float64}, n entries, each of
    which must be below 1e-5."""
    pytest.importorskip("triton")

    def check(script: str, expected: int) -> None:
        env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
        result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=180)
        assert result.returncode == 0, result.stderr[-3000:]
        errors = json.loads(result.stdout.strip().splitlines()[-1])
        assert len(errors) == expected, errors
        bad = {name: err for name, err in errors.items() if not err < 1e-5}
        assert not bad, f"relative errors above 1e-5: {bad}"

    return check


@pytest.fixture(autouse=True)
def restore_tf32() -> Iterator[None]:
    """A test that trains in-process turns TF32 on (ppt.common.init_runtime, as a run does); the fp32 references of
    the tests after it must not inherit it."""
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags


@pytest.fixture(scope="session", autouse=True)
def readme_study(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[], tuple[Path, Path]]]:
    """The README's laptop study (`python -m scripts.study docs/studies/cpu.toml`, one run at a time, a thread each),
    which tests/test_study.py reads: started with the session when that module is selected, so that it trains on one
    core while the other tests run. Gives a function that waits for it and returns (a home whose ~/.cache/ppt/data/demo
    holds the demo corpus scripts/run_cpu.sh prepares, the study's directory)."""
    if not any(item.path.name == "test_study.py" for item in request.session.items):
        yield lambda: pytest.fail("tests/test_study.py was not selected")
        return
    home, work = tmp_path_factory.mktemp("home"), tmp_path_factory.mktemp("readme")
    demo = home / ".cache" / "ppt" / "data" / "demo"
    python = shlex.quote(sys.executable)
    script = (f"{python} -m scripts.prepare_fineweb --source demo --out {shlex.quote(str(demo))} --workers 1 && "
              f"{python} -m scripts.study {shlex.quote(str(REPO_ROOT / 'docs' / 'studies' / 'cpu.toml'))}")  # fmt: skip
    env = {**os.environ, "HOME": str(home), "PYTHONPATH": str(REPO_ROOT)}
    with open(work / "study.log", "w") as log:
        process = subprocess.Popen(["bash", "-c", script], cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT)

    def finished() -> tuple[Path, Path]:
        assert process.wait(timeout=900) == 0, (work / "study.log").read_text()[-3000:]
        return home, work / "runs" / "cpu"

    yield finished
    process.kill()
    process.wait()
