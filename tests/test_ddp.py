"""Multi-process training on CPU (gloo): 2 ranks under torchrun match 1 rank with gradient accumulation, see disjoint
data, leave exactly one set of outputs written by rank 0, resume exactly, and stop together when only one rank is
signalled.

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
SIGNAL_IN_STEP = 2  # a run where only rank 1 gets SIGTERM, in this step
SEQ_LEN, TOTAL_BATCH_TOKENS = 32, 256  # 8 rows per optimizer step
COMMON_ARGS = [
    "--config", "tiny", "--device", "cpu", "--seq-len", str(SEQ_LEN),
    "--total-batch-tokens", str(TOTAL_BATCH_TOKENS), "--target-tokens", str(STEPS * TOTAL_BATCH_TOKENS),
    "--warmup-tokens", str(2 * TOTAL_BATCH_TOKENS), "--eval-every", "0", "--eval-tokens", "1024", "--keep", "0",
]  # fmt: skip
# 1 rank: device batch 4 x accumulation 2; 2 ranks: device batch 2 x accumulation 2 (exercises DDP's no_sync too)
ONE_RANK_BATCH, TWO_RANK_BATCH = 4, 2
BLOCKS_BATCH_TOKENS = 2 * TWO_RANK_BATCH * SEQ_LEN  # 2 ranks x 1 micro-batch, or 1 rank x 2 accumulated
LOSS_RTOL = 1e-6  # 1 vs 2 ranks: same rows, reductions in another order (measured: ~1e-7 on losses, ~1e-10 on bpb)


# ---- the torchrun worker -------------------------------------------------------------------------------------------


def worker_main(spec_path: str) -> None:
    """One rank: run each run of the spec through base_train.main, then dump what this rank wrote, logged and exited
    with. A run may name a step in which rank 1 alone gets SIGTERM, as when a preemption notice reaches the ranks at
    slightly different times. A run that stops with an error records its message."""
    import third_arch

    import ppt.model

    third_arch.register(ppt.model)  # as conftest.py does in pytest's process
    from ppt.common import PPTError
    from scripts import base_train

    spec = json.loads(Path(spec_path).read_text())
    rank = int(os.environ["RANK"])
    (Path(spec["log_dir"]) / f"rank{rank}.pid").write_text(str(os.getpid()))  # so a hung test can end this process
    opened: list[str] = []  # files opened for writing
    renamed: list[str] = []  # os.replace destinations: how checkpoints and manifests appear
    wandb_calls: list[str] = []
    exit_codes: list[int] = []
    errors: list[str] = []
    signal_in_step: list[int | None] = [None]
    steps_started = [0]

    def recording_open(file, mode="r", *args, **kwargs):
        if any(flag in mode for flag in "wax+"):
            opened.append(str(file))
        return real_open(file, mode, *args, **kwargs)

    def recording_replace(src, dst, *args, **kwargs):
        renamed.append(str(dst))
        return real_replace(src, dst, *args, **kwargs)

    def set_lr_then_maybe_signal(optimizer, multiplier):  # base_train calls set_lr once at the start of every step
        steps_started[0] += 1
        if rank == 1 and steps_started[0] == signal_in_step[0]:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_set_lr(optimizer, multiplier)

    real_open, real_replace, real_set_lr = builtins.open, os.replace, base_train.set_lr
    builtins.open = io.open = recording_open  # pathlib writes go through io.open
    os.replace = recording_replace
    base_train.set_lr = set_lr_then_maybe_signal
    fake_wandb = types.ModuleType("wandb")  # stands in for wandb (no network): records who would log
    fake_wandb.init = lambda **kwargs: (
        wandb_calls.append("init")
        or types.SimpleNamespace(
            id="fake-id",
            starting_step=0,
            log=lambda *args, **kwargs: wandb_calls.append("log"),
            finish=lambda: wandb_calls.append("finish"),
        )
    )
    sys.modules["wandb"] = fake_wandb
    # Each run starts and shuts down its own process group, like a fresh launch. A new group on the store of the last
    # one would read that group's stale addresses and hang, so each run gets its own store, served by rank 0.
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"
    try:
        for run, port in zip(spec["runs"], spec["ports"]):
            os.environ["MASTER_PORT"] = str(port)
            signal_in_step[0], steps_started[0] = run.get("signal_rank1_in_step"), 0
            try:
                base_train.main(run["argv"])
                exit_codes.append(0)
            except SystemExit as exc:  # how base_train ends a run stopped by a signal
                exit_codes.append(exc.code)
            except PPTError as exc:  # what run_cli prints as one line, exiting 2
                exit_codes.append(2)
                errors.append(str(exc))
    finally:
        builtins.open = io.open = real_open
        os.replace, base_train.set_lr = real_replace, real_set_lr
    with open(Path(spec["log_dir"]) / f"rank{rank}.json", "w") as f:
        json.dump(
            {"opened": opened, "renamed": renamed, "wandb": wandb_calls, "exit_codes": exit_codes, "errors": errors}, f
        )


# ---- the runs, once per module -------------------------------------------------------------------------------------


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]  # all bound at once, so the ports differ
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def manifest(path: Path) -> dict:
    return json.loads(path.read_text())


def losses(history: list[dict]) -> list[float]:
    return [h["loss"] for h in history if "loss" in h]


@pytest.fixture(scope="module")
def runs(demo_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The 2-rank runs in one torchrun launch (whole; stopped, then resumed; signalled; blocks) and the 1-rank runs
    (one; blocks_one)."""
    root = tmp_path_factory.mktemp("ddp")
    names = ("cache1", "cache2", "whole", "parts", "signalled", "logs", "one", "blocks", "blocks_one", "spare", "late")
    dirs = {name: root / name for name in names}
    for d in dirs.values():
        d.mkdir()
    two = [*COMMON_ARGS, "--data-dir", str(demo_data_dir), "--device-batch-size", str(TWO_RANK_BATCH)]
    whole = [*two, "--tag", "whole", "--out-dir", str(dirs["whole"]), "--save-every", "2", "--run", "whole-run"]
    parts = [*two, "--tag", "parts", "--out-dir", str(dirs["parts"]), "--save-every", "0"]
    signalled = [*two, "--tag", "signalled", "--out-dir", str(dirs["signalled"]), "--save-every", "0"]
    # one micro-batch per rank, against one process with the same micro-batches accumulated (BLOCKS_BATCH_TOKENS)
    blocks = ["--total-batch-tokens", str(BLOCKS_BATCH_TOKENS), "--target-tokens", str(STEPS * BLOCKS_BATCH_TOKENS)]
    blocks += ["--save-every", "0", "--tag", "blocks"]
    # tests/third_arch.py with a layer no forward uses, or only the first forward on data (the check before DDP)
    spare = [*two, "--max-steps", "2", "--save-every", "0", "--tag", "spare", "--out-dir", str(dirs["spare"])]
    late = [*two, "--max-steps", "3", "--save-every", "0", "--tag", "late", "--out-dir", str(dirs["late"])]
    spec = {
        "log_dir": str(dirs["logs"]),
        "runs": [
            {"argv": whole},
            {"argv": [*parts, "--max-steps", str(STOP_AT)]},
            {"argv": [*parts, "--resume", "auto"]},
            {"argv": signalled, "signal_rank1_in_step": SIGNAL_IN_STEP},
            {"argv": [*two, *blocks, "--out-dir", str(dirs["blocks"])]},
            {"argv": [*spare, "--config", "gpt2-spare"]},
            {"argv": [*late, "--config", "gpt2-spare-late"]},  # last: it stops with an error
        ],
        "ports": free_ports(7),
    }
    (root / "spec.json").write_text(json.dumps(spec))

    env = {**os.environ, "PPT_CACHE": str(dirs["cache2"]), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1"]
    command = [*torchrun, f"--master_port={free_ports(1)[0]}", __file__, str(root / "spec.json")]
    log = root / "torchrun.log"
    with open(log, "w") as out:
        launch = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)

    from scripts import base_train

    threads = torch.get_num_threads()
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("PPT_CACHE", str(dirs["cache1"]))
            torch.set_num_threads(1)  # as each torchrun worker runs (OMP_NUM_THREADS=1): the same matmul blocking
            one = [*COMMON_ARGS, "--data-dir", str(demo_data_dir), "--device-batch-size", str(ONE_RANK_BATCH)]
            base_train.main([*one, "--tag", "one", "--out-dir", str(dirs["one"]), "--save-every", "0"])
            base_train.main([*two, *blocks, "--out-dir", str(dirs["blocks_one"])])
    finally:
        torch.set_num_threads(threads)
        try:
            launch.wait(timeout=180)
        except subprocess.TimeoutExpired:
            # a hang must not outlive the test: end the launcher and the workers it started (each its own session)
            for pid_file in dirs["logs"].glob("rank*.pid"):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            launch.kill()
            launch.wait()
            pytest.fail(f"torchrun did not finish in 180 s:\n{log.read_text()[-4000:]}")
    assert launch.returncode == 0, f"torchrun failed ({launch.returncode}):\n{log.read_text()[-4000:]}"
    return dirs


# ---- the tests -----------------------------------------------------------------------------------------------------


def test_two_ranks_match_one_rank_with_gradient_accumulation(runs):
    one, two = manifest(runs["one"] / "one.json"), manifest(runs["whole"] / "whole.json")
    assert (one["train"]["world_size"], one["train"]["grad_accum"]) == (1, 2)
    assert (two["train"]["world_size"], two["train"]["grad_accum"]) == (2, 2)
    assert one["train"]["eval_tokens"] == two["train"]["eval_tokens"] == 1024  # the budget base_eval then uses
    one_losses, two_losses = losses(one["history"]), losses(two["history"])
    assert len(one_losses) == len(two_losses) == STEPS
    assert two_losses[-1] < two_losses[0] - 0.5, "the model learns, so later steps test the optimizer update too"
    assert two_losses == pytest.approx(one_losses, rel=LOSS_RTOL)
    assert [h["lr"] for h in two["history"] if "loss" in h] == [h["lr"] for h in one["history"] if "loss" in h]
    assert two["final_val"]["eval_tokens"] == one["final_val"]["eval_tokens"]  # validation splits rows across ranks
    assert two["final_val"]["val_bpb"] == pytest.approx(one["final_val"]["val_bpb"], rel=LOSS_RTOL)
    # the ranks' document positions are summed with the loss: the comparison FLOPs count every rank's tokens
    assert [h["comparison_flops"] for h in two["history"] if "loss" in h] == [
        h["comparison_flops"] for h in one["history"] if "loss" in h
    ]


def test_one_micro_batch_per_rank_equals_one_process_accumulating_the_same_micro_batches_bitwise(runs):
    """Rank r's batch is micro-batch r of the one process (the loader deals rows out in blocks of a batch), and
    DDP's mean of two gradients rounds as accumulating two halves does: the losses are equal, not just close."""
    two, one = manifest(runs["blocks"] / "blocks.json"), manifest(runs["blocks_one"] / "blocks.json")
    assert (two["train"]["world_size"], two["train"]["grad_accum"]) == (2, 1)
    assert (one["train"]["world_size"], one["train"]["grad_accum"]) == (1, 2)
    assert len(losses(two["history"])) == STEPS
    assert losses(two["history"]) == losses(one["history"])
    # and the weights: grouped otherwise (rows round-robin), they differ in their last bits, which the losses hide
    from ppt import checkpoint as ckpt

    two_weights, one_weights = (
        ckpt.load_checkpoint(ckpt.latest_checkpoint(runs[name]))["model"] for name in ("blocks", "blocks_one")
    )
    assert all(torch.equal(two_weights[k], one_weights[k]) for k in one_weights)


def test_ranks_train_on_disjoint_rows_whose_union_is_the_one_rank_batch(runs, demo_data_dir):
    """The first step's logged loss is the mean of the losses of rank 0's and rank 1's rows, and those differ."""
    from ppt.data import DataLoader
    from ppt.model import build_model, get_config
    from ppt.shards import load_data_tokenizer

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
    assert {key: logs[1][key] for key in ("opened", "renamed", "wandb")} == {"opened": [], "renamed": [], "wandb": []}
    assert logs[0]["wandb"] == ["init", *["log"] * (STEPS + 1), "finish"]  # every step, then the final evaluation
    saved = [Path(p).name for p in logs[0]["renamed"] if Path(p).parent == runs["whole"] and ".pt" in p]
    assert saved == ["step_00000002.pt", "step_00000004.pt", "step_00000006.pt"]  # each once, nothing per rank
    assert sorted(p.name for p in runs["whole"].iterdir()) == [*saved, "whole.json", "whole_loss.png"]
    reports = sorted(p.relative_to(runs["cache2"]).as_posix() for p in runs["cache2"].rglob("*") if p.is_file())
    assert reports == [f"reports/{name}.json" for name in ("blocks", "parts", "signalled", "spare", "whole")]
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
    assert [h["lr"] for h in parts["history"] if "lr" in h] == [h["lr"] for h in whole["history"] if "lr" in h]
    without_time = lambda entry: {k: v for k, v in entry.items() if k != "wall_time_s"}  # noqa: E731
    assert without_time(parts["final_val"]) == without_time(whole["final_val"])


def test_a_signal_on_one_rank_stops_every_rank_after_the_same_step(runs):
    """Otherwise rank 0 starts another step whose gradient all-reduce rank 1 never joins, and the job hangs."""
    logs = [manifest(runs["logs"] / f"rank{rank}.json") for rank in (0, 1)]
    assert [log["exit_codes"][:5] for log in logs] == [[0, 0, 0, 128 + signal.SIGTERM, 0]] * 2  # then the blocks run
    stopped = manifest(runs["signalled"] / "signalled.json")
    assert stopped["stopped_at"] == SIGNAL_IN_STEP and stopped["final_val"] is None
    assert losses(stopped["history"]) == losses(manifest(runs["whole"] / "whole.json")["history"])[:SIGNAL_IN_STEP]
    assert sorted(p.name for p in runs["signalled"].iterdir()) == ["signalled.json", f"step_{SIGNAL_IN_STEP:08d}.pt"]


def test_parameters_without_a_gradient_are_found_before_ddp_is_built_and_named(runs):
    """A layer no forward uses: DDP is built with find_unused_parameters, says so, and trains; one that only the
    check's forward used stops the next step with one error that says what to change, instead of DDP's own."""
    spare = manifest(runs["spare"] / "spare.json")
    assert spare["train"]["ddp_find_unused_parameters"] is True and spare["steps_done"] == 2
    assert manifest(runs["whole"] / "whole.json")["train"]["ddp_find_unused_parameters"] is False
    log = (runs["logs"].parent / "torchrun.log").read_text()
    note = "note: 2 parameters got no gradient in a first forward and backward (spare.bias, spare.weight); DDP runs "
    assert note + "with find_unused_parameters=True" in log
    logs = [manifest(runs["logs"] / f"rank{rank}.json") for rank in (0, 1)]
    assert [log["exit_codes"][5:] for log in logs] == [[0, 2]] * 2
    for rank_log in logs:
        (error,) = rank_log["errors"]
        assert error.startswith("under DDP, some parameters got no gradient in step 1 though all had one in a first")
        assert "make every parameter take part in every step's loss in ppt/model.py" in error


def test_workers_exit_without_nanobind_leak_reports(runs):
    """base_train freezes the garbage collector; unfrozen at exit, libtriton's objects are freed before nanobind
    checks for leaks (frozen, each worker printed ~80 lines of "nanobind: leaked ...")."""
    assert "nanobind" not in (runs["logs"].parent / "torchrun.log").read_text()


def test_help_shows_the_torchrun_launch(capsys):
    from scripts import base_train

    with pytest.raises(SystemExit) as exit_info:
        base_train.parse_args(["--help"])
    assert exit_info.value.code == 0
    shown = capsys.readouterr().out
    assert "torchrun --nproc_per_node=" in shown and "-m scripts.base_train" in shown


if __name__ == "__main__":
    worker_main(sys.argv[1])
