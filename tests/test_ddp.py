"""Multi-process training on CPU (gloo): 2 ranks under torchrun match 1 rank with gradient accumulation, see disjoint
data, leave exactly one set of outputs written by rank 0, and resume exactly.

Starting a Python process that imports torch and the model costs ~10 s on a small CPU box, so the file launches
torchrun once: each of its 2 workers runs this file as a script (`worker_main` below), which calls
`scripts.base_train.main(argv)` for several runs in a row, recording every file the rank writes and every wandb
call it makes. The 1-process reference runs inside pytest while torchrun starts up.
"""

from __future__ import annotations

import builtins
import dataclasses
import io
import json
import os
import signal
import socket
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent

STEPS, STOP_AT = 6, 3  # the whole run, and where the interrupted run stops before it is resumed
SEQ_LEN, TOTAL_BATCH_TOKENS = 32, 256  # 8 rows per optimizer step
COMMON_ARGS = [
    "--config", "tiny", "--device", "cpu", "--seq-len", str(SEQ_LEN),
    "--total-batch-tokens", str(TOTAL_BATCH_TOKENS), "--target-tokens", str(STEPS * TOTAL_BATCH_TOKENS),
    "--warmup-tokens", str(2 * TOTAL_BATCH_TOKENS), "--eval-every", "0", "--eval-tokens", "1024", "--keep", "0",
]  # fmt: skip
# 1 rank: device batch 4 x accumulation 2; 2 ranks: device batch 2 x accumulation 2 (exercises DDP's no_sync too)
ONE_RANK_BATCH, TWO_RANK_BATCH = 4, 2
LOSS_RTOL = 1e-5  # 1 vs 2 ranks: same rows, reductions in another order (measured max relative difference ~1e-7)


# ---- the torchrun worker -------------------------------------------------------------------------------------------


def worker_main(spec_path: str) -> None:
    """One rank: run each argv of the spec through base_train.main, then dump what this rank wrote and logged."""
    from scripts import base_train

    spec = json.loads(Path(spec_path).read_text())
    rank = int(os.environ["RANK"])
    opened: list[str] = []  # files opened for writing
    renamed: list[str] = []  # os.replace destinations: how checkpoints and manifests appear
    wandb_calls: list[str] = []

    def recording_open(file, mode="r", *args, **kwargs):
        if any(flag in mode for flag in "wax+"):
            opened.append(str(file))
        return real_open(file, mode, *args, **kwargs)

    def recording_replace(src, dst, *args, **kwargs):
        renamed.append(str(dst))
        return real_replace(src, dst, *args, **kwargs)

    real_open, real_replace = builtins.open, os.replace
    builtins.open = io.open = recording_open  # pathlib writes go through io.open
    os.replace = recording_replace
    fake_wandb = types.ModuleType("wandb")  # stands in for wandb (no network): records who would log
    fake_wandb.init = lambda **kwargs: (
        wandb_calls.append("init")
        or types.SimpleNamespace(
            log=lambda *args, **kwargs: wandb_calls.append("log"), finish=lambda: wandb_calls.append("finish")
        )
    )
    sys.modules["wandb"] = fake_wandb
    try:
        for argv in spec["runs"]:
            base_train.main(argv)  # each run starts and shuts down its own process group, like a fresh launch
    finally:
        builtins.open = io.open = real_open
        os.replace = real_replace
    with open(Path(spec["log_dir"]) / f"rank{rank}.json", "w") as f:
        json.dump({"opened": opened, "renamed": renamed, "wandb": wandb_calls}, f)


# ---- the runs, once per module -------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def manifest(path: Path) -> dict:
    return json.loads(path.read_text())


def losses(history: list[dict]) -> list[float]:
    return [h["loss"] for h in history if "loss" in h]


@pytest.fixture(scope="module")
def runs(demo_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three 2-rank runs in one torchrun launch (whole, stopped at STOP_AT, resumed to the end) and the 1-rank run."""
    root = tmp_path_factory.mktemp("ddp")
    dirs = {name: root / name for name in ("cache1", "cache2", "whole", "parts", "logs", "one")}
    for d in dirs.values():
        d.mkdir()
    two = [*COMMON_ARGS, "--data-dir", str(demo_data_dir), "--device-batch-size", str(TWO_RANK_BATCH)]
    whole = [*two, "--tag", "whole", "--out-dir", str(dirs["whole"]), "--save-every", "2", "--run", "whole-run"]
    parts = [*two, "--tag", "parts", "--out-dir", str(dirs["parts"]), "--save-every", "0"]
    spec = {
        "log_dir": str(dirs["logs"]),
        "runs": [whole, [*parts, "--max-steps", str(STOP_AT)], [*parts, "--resume", "auto"]],
    }
    (root / "spec.json").write_text(json.dumps(spec))

    env = {**os.environ, "PPT_CACHE": str(dirs["cache2"]), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1"]
    command = [*torchrun, f"--master_port={free_port()}", __file__, str(root / "spec.json")]
    launch = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    from scripts import base_train

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}  # base_train installs its own
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("PPT_CACHE", str(dirs["cache1"]))
            one = [*COMMON_ARGS, "--data-dir", str(demo_data_dir), "--device-batch-size", str(ONE_RANK_BATCH)]
            base_train.main([*one, "--tag", "one", "--out-dir", str(dirs["one"]), "--save-every", "0"])
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        output, _ = launch.communicate(timeout=300)
    assert launch.returncode == 0, f"torchrun failed ({launch.returncode}):\n{output[-4000:]}"
    return dirs


# ---- the tests -----------------------------------------------------------------------------------------------------


def test_two_ranks_match_one_rank_with_gradient_accumulation(runs):
    one, two = manifest(runs["one"] / "one.json"), manifest(runs["whole"] / "whole.json")
    assert (one["train"]["world_size"], one["train"]["grad_accum"]) == (1, 2)
    assert (two["train"]["world_size"], two["train"]["grad_accum"]) == (2, 2)
    one_losses, two_losses = losses(one["history"]), losses(two["history"])
    assert len(one_losses) == len(two_losses) == STEPS
    assert two_losses[-1] < two_losses[0] - 0.5, "the model learns, so later steps test the optimizer update too"
    assert two_losses == pytest.approx(one_losses, rel=LOSS_RTOL)
    assert [h["lr"] for h in two["history"] if "loss" in h] == [h["lr"] for h in one["history"] if "loss" in h]
    assert two["final_val"]["tokens"] == one["final_val"]["tokens"]  # validation splits its rows across ranks too
    assert two["final_val"]["bpb"] == pytest.approx(one["final_val"]["bpb"], rel=LOSS_RTOL)


def test_ranks_train_on_disjoint_rows_whose_union_is_the_one_rank_batch(runs, demo_data_dir):
    """The first step's logged loss is the mean of the losses of rank 0's and rank 1's rows, and those differ."""
    from ppt.data import DataLoader, load_data_tokenizer
    from ppt.model import build_model, get_config

    def first_step_rows(batch_size: int, rank: int, world: int) -> tuple[torch.Tensor, ...]:
        loader = DataLoader(demo_data_dir, "train", batch_size, SEQ_LEN, rank, world, seed=0)
        micro = [next(loader) for _ in range(TOTAL_BATCH_TOKENS // (batch_size * SEQ_LEN * world))]
        return tuple(torch.cat(parts) for parts in zip(*micro))

    ranks = [first_step_rows(TWO_RANK_BATCH, rank, 2) for rank in (0, 1)]
    single = first_step_rows(ONE_RANK_BATCH, 0, 1)
    as_rows = lambda inputs: {tuple(row) for row in inputs.tolist()}
    assert len(as_rows(ranks[0][0])) == len(as_rows(ranks[1][0])) == 4
    assert not as_rows(ranks[0][0]) & as_rows(ranks[1][0])
    assert as_rows(ranks[0][0]) | as_rows(ranks[1][0]) == as_rows(single[0])

    config = dataclasses.replace(get_config("tiny"), vocab_size=load_data_tokenizer(demo_data_dir).vocab_size)
    torch.manual_seed(0)  # built the way base_train builds it, so the weights are those of its step 1
    with torch.device("meta"):
        model = build_model(config)
    model.to_empty(device="cpu")
    model.init_weights()
    with torch.no_grad():
        rank_losses = [model(*batch).item() for batch in ranks]
    assert abs(rank_losses[0] - rank_losses[1]) > 1e-3, "the ranks saw different data"
    logged = losses(manifest(runs["whole"] / "whole.json")["history"])[0]
    assert logged == pytest.approx(sum(rank_losses) / 2, rel=LOSS_RTOL)


def test_only_rank_zero_writes_checkpoints_reports_and_wandb(runs):
    logs = [manifest(runs["logs"] / f"rank{rank}.json") for rank in (0, 1)]
    assert logs[1] == {"opened": [], "renamed": [], "wandb": []}
    assert logs[0]["wandb"] == ["init", *["log"] * STEPS, "finish"]
    saved = [Path(p).name for p in logs[0]["renamed"] if Path(p).parent == runs["whole"] and ".pt" in p]
    assert saved == ["step_00000002.pt", "step_00000004.pt", "step_00000006.pt"]  # each once, nothing per rank
    assert sorted(p.name for p in runs["whole"].iterdir()) == [*saved, "whole.json", "whole_loss.png"]
    reports = sorted(p.relative_to(runs["cache2"]).as_posix() for p in runs["cache2"].rglob("*") if p.is_file())
    assert reports == ["reports/parts.json", "reports/whole.json"]
    assert sorted(p.name for p in runs["parts"].iterdir()) == [
        "parts.json", "parts_loss.png", f"step_{STOP_AT:08d}.pt", f"step_{STEPS:08d}.pt",
    ]  # fmt: skip


def test_two_rank_resume_continues_exactly(runs):
    whole = manifest(runs["whole"] / "whole.json")
    parts = manifest(runs["parts"] / "parts.json")
    assert parts["steps_done"] == STEPS and [h["step"] for h in parts["history"] if "loss" in h] == list(
        range(1, STEPS + 1)
    )
    assert losses(parts["history"]) == losses(whole["history"])  # same ranks, same reduction order: bit for bit
    assert parts["final_val"] == whole["final_val"]


def test_help_shows_the_torchrun_launch(capsys):
    from scripts import base_train

    with pytest.raises(SystemExit) as exit_info:
        base_train.parse_args(["--help"])
    assert exit_info.value.code == 0
    assert "torchrun --nproc_per_node=8 -m scripts.base_train" in capsys.readouterr().out


if __name__ == "__main__":
    worker_main(sys.argv[1])
