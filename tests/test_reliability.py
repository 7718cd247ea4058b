"""Nothing is lost under kills, faults and bad input.

Training runs here use the `tiny` config on the demo shards: 12 steps of 2 x 2 rows of 32 tokens, a checkpoint every
4 steps. A run interrupted any way we know (SIGKILL, SIGTERM, SIGINT, --max-steps) and resumed with `--resume auto`
must reproduce the uninterrupted run's losses and final weights bit for bit. Divergence, a full disk and bad
command-line input stop with a message naming the problem and the fix (exit status 2 from the scripts); checkpoints
and shards never execute code; importing ppt touches no network; wandb stays off unless asked for.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from records import write_manifest

from ppt import checkpoint as ckpt
from ppt import locks
from ppt.common import PPTError
from ppt.model import build_model, get_config
from ppt.shards import load_data_tokenizer, read_meta, read_shard, write_meta, write_shard
from scripts import base_train

REPO_ROOT = Path(__file__).resolve().parent.parent
STEPS, SAVE_EVERY, BATCH_TOKENS = 12, 4, 128


# One thread (conftest.py); the SIGKILL test's child runs single-threaded too (OMP_NUM_THREADS), so it computes bit
# for bit the same.
pytestmark = pytest.mark.usefixtures("one_thread")


def train_argv(data_dir: Path, out_dir: Path, tag: str, *extra: str) -> list[str]:
    return [
        "--config", "tiny", "--data-dir", str(data_dir), "--out-dir", str(out_dir), "--tag", tag,
        "--seq-len", "32", "--total-batch-tokens", str(BATCH_TOKENS), "--device-batch-size", "2",
        "--target-tokens", str(STEPS * BATCH_TOKENS), "--warmup-tokens", str(2 * BATCH_TOKENS),
        "--eval-every", "0", "--eval-tokens", "128", "--save-every", str(SAVE_EVERY), "--keep", "2",
        "--compile", "off", "--device", "cpu", *extra,
    ]  # fmt: skip


def manifest(out_dir: Path, tag: str) -> dict:
    return json.loads((out_dir / f"{tag}.json").read_text())


def trajectory(history: list[dict]) -> list[tuple]:
    """What must not change when a run is interrupted: per-step loss, LR, tokens and comparison FLOPs, and the val
    results."""
    train_rows = [(h["step"], h["tokens"], h["comparison_flops"], h["loss"], h["lr"]) for h in history if "loss" in h]
    val_rows = [(h["step"], h["val_nll"], h["val_bpb"]) for h in history if "val_nll" in h]
    return train_rows + val_rows


def assert_same_weights(checkpoint_a: Path, checkpoint_b: Path) -> None:
    a, b = ckpt.load_checkpoint(checkpoint_a)["model"], ckpt.load_checkpoint(checkpoint_b)["model"]
    assert a.keys() == b.keys()
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, f"weights differ from the uninterrupted run: {different}"


@dataclasses.dataclass
class Reference:
    trajectory: list[tuple]
    final_checkpoint: Path
    wandb_imported: bool


@pytest.fixture(scope="module")
def reference(demo_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """The uninterrupted run every interrupted one must reproduce (in-process, without --run)."""
    cache = tmp_path_factory.mktemp("reference_cache")
    out = cache / "checkpoints"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PPT_CACHE", str(cache))
        mp.delitem(sys.modules, "wandb", raising=False)  # so an import by this run would show
        base_train.main(train_argv(demo_data_dir, out, "reference"))
        wandb_imported = "wandb" in sys.modules
    return Reference(
        trajectory(manifest(out, "reference")["history"]), ckpt.checkpoint_path(out, STEPS), wandb_imported
    )


def assert_matches_reference(reference: Reference, out_dir: Path, tag: str) -> None:
    data = manifest(out_dir, tag)
    assert data["steps_done"] == STEPS
    assert trajectory(data["history"]) == reference.trajectory
    assert_same_weights(ckpt.checkpoint_path(out_dir, STEPS), reference.final_checkpoint)


# ---- 1 and 2: kills, signals and early stops, then --resume auto ------------------------------------------------


def test_sigkill_at_a_random_step_then_resume_reproduces_the_uninterrupted_run(
    reference, demo_data_dir, tmp_path, capsys
):
    kill_after = random.randint(SAVE_EVERY + 1, STEPS - 3)  # past the first checkpoint, before the end
    out = tmp_path / "checkpoints"
    proc = subprocess.Popen(
        [sys.executable, "-m", "scripts.base_train", *train_argv(demo_data_dir, out, "killed")],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    watchdog = threading.Timer(120, proc.kill)  # a hung child fails the test instead of hanging it
    watchdog.start()
    log = []
    for line in proc.stdout:
        log.append(line)
        if line.startswith(f"step {kill_after:6d}/"):
            proc.send_signal(signal.SIGKILL)
            break
    log.append(proc.stdout.read())
    proc.wait()
    watchdog.cancel()
    assert proc.returncode == -signal.SIGKILL, f"not killed after step {kill_after}:\n{''.join(log)}"

    # a later kill in the middle of a write leaves a temp file and possibly a truncated step file: both are skipped
    last_complete = ckpt.latest_checkpoint(out)
    assert last_complete is not None and ckpt.load_checkpoint(last_complete)["step"] >= SAVE_EVERY
    step = ckpt.load_checkpoint(last_complete)["step"]
    ckpt.checkpoint_path(out, step + 1).write_bytes(last_complete.read_bytes()[:2000])
    (out / f".step_{step + 2:08d}.pt.4242.tmp").write_bytes(b"half a checkpoint")

    base_train.main(train_argv(demo_data_dir, out, "killed", "--resume", "auto"))
    printed = capsys.readouterr().out
    print(f"killed after step {kill_after}")  # shown if what follows fails
    assert f"resumed from {last_complete} at step {step}" in printed
    assert_matches_reference(reference, out, "killed")
    assert not list(out.glob("*.tmp*"))  # the first save after the restart removed the killed write's leftovers


def test_a_second_run_on_the_same_directory_stops_naming_the_first_and_sigterm_releases_it(demo_data_dir, tmp_path):
    """Two runs at once with one output directory: the second stops before it reads or writes anything there, naming
    the first run's pid; the first, stopped by SIGTERM, saves and removes its lock on the way out."""
    out = tmp_path / "checkpoints"
    argv = train_argv(demo_data_dir, out, "first", "--target-tokens", str(10**6 * BATCH_TOKENS), "--save-every", "0")
    proc = subprocess.Popen(
        [sys.executable, "-m", "scripts.base_train", *argv],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    watchdog = threading.Timer(120, proc.kill)
    watchdog.start()
    log = []
    for line in proc.stdout:  # the first run is training
        log.append(line)
        if line.startswith("step "):
            break
    assert (out / locks.LOCK_NAME).is_file(), "".join(log)
    with pytest.raises(PPTError) as second:
        base_train.main(train_argv(demo_data_dir, out, "second"))
    assert re.search(
        rf"checkpoints is in use by another run: pid {proc.pid} on \S+, started .*scripts/base_train", str(second.value)
    )
    proc.send_signal(signal.SIGTERM)
    log.append(proc.stdout.read())
    proc.wait()
    watchdog.cancel()
    assert proc.returncode == 128 + signal.SIGTERM, "".join(log)
    assert not (out / locks.LOCK_NAME).exists() and ckpt.latest_checkpoint(out) is not None
    assert not list(out.glob("second*")) and manifest(out, "first")["stopped_at"] >= 1


@pytest.mark.parametrize("stop", ["SIGTERM", "SIGINT", "max-steps", "SIGTERM, steps read late"])
def test_signals_and_max_steps_save_then_resume_reproduces_the_uninterrupted_run(
    stop, reference, demo_data_dir, tmp_path, capsys, monkeypatch
):
    stop_at = SAVE_EVERY + 2  # not a save boundary: the stop itself must save
    signalled_at = stop_at
    if stop.endswith("late"):  # as on a GPU: the step after the signalled one is already queued, and finishes
        monkeypatch.setattr(base_train, "LATE_READ_DEVICES", ("cuda", "cpu"))
        stop, signalled_at = "SIGTERM", stop_at - 1
    out = tmp_path / "checkpoints"
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    if stop == "max-steps":
        base_train.main(train_argv(demo_data_dir, out, "stopped", "--max-steps", str(stop_at)))
        assert manifest(out, "stopped")["train"]["steps"] == STEPS  # the schedule is the full run's
    else:
        sig = getattr(signal, stop)
        log_step = base_train.Trainer.log_step

        def signal_after_step(self: base_train.Trainer, *args: float) -> None:
            log_step(self, *args)
            if self.step == signalled_at:
                os.kill(os.getpid(), sig)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(base_train.Trainer, "log_step", signal_after_step)
            with pytest.raises(SystemExit) as stopped:
                base_train.main(train_argv(demo_data_dir, out, "stopped"))
        assert stopped.value.code == 128 + sig
        assert f"stopped by signal {int(sig)} at step {stop_at}; resume with --resume auto" in capsys.readouterr().out
        assert manifest(out, "stopped")["stopped_at"] == stop_at
    assert ckpt.latest_checkpoint(out) == ckpt.checkpoint_path(out, stop_at)

    base_train.main(train_argv(demo_data_dir, out, "stopped", "--resume", "auto"))
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers  # main put its handlers back, also on a stop
    assert_matches_reference(reference, out, "stopped")
    assert [s for s, _ in ckpt.list_checkpoints(out)] == [8, 12]  # --keep 2


# ---- 4: NaN/inf ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("skip_budget", [0, 2])
def test_divergence_stops_naming_the_step_and_the_last_good_checkpoint(skip_budget, demo_data_dir, tmp_path, capsys):
    """--lr 1e6 blows the weights up in one AdamW step; the next gradient overflows."""
    out = tmp_path / "checkpoints"
    argv = train_argv(demo_data_dir, out, "diverged", "--lr", "1e6", "--save-every", "1")
    with pytest.raises(PPTError) as diverged:
        base_train.main([*argv, "--skip-nonfinite", str(skip_budget)])
    found = re.fullmatch(
        r"non-finite loss/gradient at step (\d+) \(loss .*\); the last good checkpoint is (\S+)\. "
        r"Lower --lr, or pass --skip-nonfinite N to skip such steps",
        str(diverged.value),
    )
    assert found, str(diverged.value)
    bad_step, good = int(found.group(1)), Path(found.group(2))
    captured = capsys.readouterr()
    assert captured.err.count("non-finite loss/gradient, step skipped") == skip_budget
    state = ckpt.load_checkpoint(good)
    assert good == ckpt.latest_checkpoint(out) and state["step"] == bad_step - 1 - skip_budget
    assert all(torch.isfinite(w).all() for w in state["model"].values())


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        "cpu, steps read late",
        pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
    ],
)
def test_skip_nonfinite_skips_a_bad_step_and_counts_it_across_a_resume(
    device, demo_data_dir, tmp_path, monkeypatch, capsys
):
    """Read late (CUDA), fused AdamW skips the step on the device (found_inf) and the loop learns of it a step later."""
    if device.endswith("late"):
        monkeypatch.setattr(base_train, "LATE_READ_DEVICES", ("cuda", "cpu"))
        device = "cpu"
    out = tmp_path / "checkpoints"
    clip = torch.nn.utils.clip_grad_norm_
    calls = []

    def overflow_on_the_third_step(parameters, max_norm, *args, **kwargs):
        """NaN gradients: had the update not been skipped, the weights and every later loss would be NaN."""
        calls.append(1)
        parameters = list(parameters)
        norm = clip(parameters, max_norm, *args, **kwargs)
        if len(calls) != 3:
            return norm
        for p in parameters:
            p.grad.fill_(float("nan"))
        return torch.full_like(norm, float("inf"))

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", overflow_on_the_third_step)
    argv = train_argv(demo_data_dir, out, "skipping", "--skip-nonfinite", "1", "--device", device)
    base_train.main([*argv, "--max-steps", "6"])
    assert "step 3: non-finite loss/gradient, step skipped (1/1)" in capsys.readouterr().err
    assert manifest(out, "skipping")["skipped_nonfinite_steps"] == 1

    base_train.main([*argv, "--resume", "auto"])
    data = manifest(out, "skipping")
    assert data["skipped_nonfinite_steps"] == 1 and data["steps_done"] == STEPS
    assert [h["step"] for h in data["history"] if "loss" in h] == [s for s in range(1, STEPS + 1) if s != 3]
    assert data["tokens"] == (STEPS - 1) * BATCH_TOKENS  # the skipped step's batch was not learned from


def test_steps_read_late_train_and_record_what_steps_read_at_once_do(reference, demo_data_dir, tmp_path, monkeypatch):
    """The loop as it runs on a GPU (each step read after the next is queued, the update skipped on the device if not
    finite), here on CPU: the same losses, learning rates, tokens, comparison FLOPs, evaluations and weights."""
    monkeypatch.setattr(base_train, "LATE_READ_DEVICES", ("cuda", "cpu"))
    out = tmp_path / "checkpoints"
    base_train.main(train_argv(demo_data_dir, out, "late"))
    assert_matches_reference(reference, out, "late")


def test_a_checkpoint_of_an_unfused_adamw_resumes(demo_data_dir, tmp_path):
    """A checkpoint saved while AdamW ran unfused on CPU (fused None in its groups, which a resume restores): the loop
    reads each step at once, since only fused AdamW takes the flag that skips a step on the device."""
    out = tmp_path / "checkpoints"
    base_train.main(train_argv(demo_data_dir, out, "unfused", "--max-steps", str(SAVE_EVERY)))
    state = ckpt.load_checkpoint(ckpt.checkpoint_path(out, SAVE_EVERY))
    for group in state["optimizer"]["param_groups"]:
        group["fused"] = None
    ckpt.save_checkpoint(out, SAVE_EVERY, state)
    base_train.main(train_argv(demo_data_dir, out, "unfused", "--resume", "auto"))
    data = manifest(out, "unfused")
    assert data["steps_done"] == STEPS and all(math.isfinite(h["loss"]) for h in data["history"] if "loss" in h)


# ---- 5: disk full, unwritable output ------------------------------------------------------------------------------


class FillsUp:
    """A file that takes `budget` bytes, then fails the way a full disk does (OSError ENOSPC)."""

    def __init__(self, f, budget: int) -> None:
        self.f, self.budget = f, budget

    def write(self, data: bytes) -> int:
        if len(data) > self.budget:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.budget -= len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def test_a_checkpoint_write_that_fills_the_disk_keeps_the_previous_checkpoint(demo_data_dir, tmp_path, monkeypatch):
    """The real torch.save meets a full disk part way through the second checkpoint: its zip writer then raises a
    RuntimeError ("unexpected pos"), as on a full tmpfs. One error line; the first checkpoint stays, unpruned."""
    out = tmp_path / "checkpoints"
    save = torch.save
    calls = []

    def disk_full_on_the_second_save(obj, f, *args, **kwargs):
        calls.append(1)
        save(obj, FillsUp(f, 4096) if len(calls) == 2 else f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", disk_full_on_the_second_save)
    with pytest.raises(PPTError, match=r"could not write checkpoint .*step_00000008\.pt \(No space left on device\); "):
        base_train.main(train_argv(demo_data_dir, out, "diskfull", "--keep", "1"))
    assert sorted(p.name for p in out.glob("step_*")) == ["step_00000004.pt"]  # not pruned, no temp file left
    assert ckpt.load_checkpoint(ckpt.latest_checkpoint(out))["step"] == SAVE_EVERY
    assert not list(out.glob(".*.tmp"))


def test_a_refused_run_leaves_no_directory_it_made(demo_data_dir, tmp_path):
    """The checkpoint directory is made and locked before the budget is checked; refused, the run takes it away
    again, and leaves one that existed before (with what it held) as it was."""
    fresh, existing = tmp_path / "fresh", tmp_path / "existing"
    existing.mkdir()
    (existing / "notes.txt").write_text("mine")
    for out_dir in (fresh, existing):
        with pytest.raises(PPTError, match="less than one step"):
            base_train.main(train_argv(demo_data_dir, out_dir, out_dir.name, "--target-tokens", "10"))
    assert not fresh.exists() and sorted(p.name for p in existing.iterdir()) == ["notes.txt"]


def test_data_whose_prepare_stopped_early_trains_with_a_warning(demo_data_dir, tmp_path, capsys):
    """prepare marks meta.json complete when it finishes; a directory it left unfinished trains, and says so."""
    assert read_meta(demo_data_dir)["progress"]["complete"] is True
    data = tmp_path / "data"
    shutil.copytree(demo_data_dir, data)
    meta = read_meta(data)
    meta["progress"]["complete"] = False
    write_meta(data, meta)
    base_train.main(train_argv(data, tmp_path / "out", "unfinished", "--max-steps", "1"))
    warnings = [line for line in capsys.readouterr().err.splitlines() if "stopped before it finished" in line]
    assert warnings == [
        f"warning: the prepare of {data} stopped before it finished ({meta['train']['shards']} train shards); "
        "training on what is there. Rerun the same prepare command to finish it"
    ]


def test_too_little_free_space_fails_before_training(demo_data_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "checkpoints"
    almost_full = types.SimpleNamespace(total=10**9, used=10**9 - 10**6, free=10**6)
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: almost_full)
    message = r"only 1\.0 MB free under .*; a checkpoint takes about 10\.\d MB, and two \(2\d\.\d MB\) must fit"
    with pytest.raises(PPTError, match=message):
        base_train.main(train_argv(demo_data_dir, out, "nospace"))
    assert "step " not in capsys.readouterr().out and not out.exists()  # refused before any folder is made


def test_a_budget_refused_after_the_locks_leaves_no_folder_in_the_cache(demo_data_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PPT_CACHE", str(tmp_path / "cache"))
    argv = train_argv(demo_data_dir, tmp_path / "unused", "huge", "--target-flops", "1e30")
    flags = {flag: value for flag, value in zip(argv[::2], argv[1::2]) if flag not in ("--out-dir", "--target-tokens")}
    with pytest.raises(PPTError, match="more than the 1e\\+15 any run can count"):
        base_train.main([word for pair in flags.items() for word in pair])  # out-dir: <cache>/checkpoints/huge
    assert not list(tmp_path.iterdir())  # neither the checkpoint folder nor the reports folder, nor the cache


# ---- 6: security --------------------------------------------------------------------------------------------------


class MakesDirectoryWhenUnpickled:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return os.mkdir, (str(self.path),)


def test_pickled_code_in_a_checkpoint_or_shard_is_refused_and_never_run(tmp_path):
    marker = tmp_path / "code_ran"
    evil = ckpt.checkpoint_path(tmp_path / "run", 1)
    evil.parent.mkdir()
    torch.save(
        {"model": {}, "config": {"class": "LlamaConfig"}, "step": 1, "x": MakesDirectoryWhenUnpickled(marker)}, evil
    )
    with pytest.raises(PPTError, match="holds Python objects other than tensors.*refused, because loading them could"):
        ckpt.load_checkpoint(evil)
    assert ckpt.latest_checkpoint(evil.parent) is None  # --resume auto skips it too
    shard = tmp_path / "data" / "train_00000.bin"
    shard.parent.mkdir()
    shard.write_bytes(evil.read_bytes())
    with pytest.raises(PPTError, match="bad magic number"):
        read_shard(shard)
    assert not marker.exists()


def test_wandb_stays_off_without_run(reference):
    assert not reference.wandb_imported


# ---- 3 and 6: bad input at the command line, and no network at import ---------------------------------------------

# Runs in a subprocess with the network blocked: imports every ppt and scripts module (recording any import error or
# network attempt), then runs each bad-input case in a forked child exactly as `python -m <module> <args>` runs it
# (its `__main__` block, via runpy), recording the exit status and stderr. Forking from one warm interpreter keeps
# a case at a fraction of a second instead of a fresh torch import each.
DRIVER = r"""
import importlib, json, os, pkgutil, runpy, socket, sys, tempfile, traceback

network_attempts = []

def blocked(*args, **kwargs):
    network_attempts.append("".join(traceback.format_stack(limit=12)))
    raise OSError("the network is blocked in this test")

class NoNetworkSocket(socket.socket):  # local sockets may be made (urllib3 probes IPv6 so); nothing may connect
    connect = connect_ex = sendto = blocked

socket.socket = NoNetworkSocket
socket.getaddrinfo = socket.gethostbyname = socket.create_connection = blocked

import ppt, scripts  # bench/'s tools run below as commands (their --help), under the same blocked network

# scripts.lm_eval registers a model with lm-eval when imported, which may happen once per process: imported here
# after the cases, one of which runs it as __main__
LATE = {"scripts.lm_eval"}
names = [info.name for pkg in (ppt, scripts) for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")]
modules, failed = [], {}

def import_all(names):
    for name in names:
        try:
            importlib.import_module(name)
            modules.append(name)
        except Exception:
            failed[name] = traceback.format_exc()

import_all(name for name in names if name not in LATE)
results = {"imports": {"modules": modules, "failed": failed, "network_attempts": network_attempts}, "cases": {}}

import torch
from ppt.model import build_model, get_config

with torch.device("meta"):  # pays torch's lazy imports (seconds) once here instead of in every child
    build_model(get_config("tiny"))

def files_under(folder):  # folders too: a refusal leaves no empty one
    return {os.path.relpath(os.path.join(d, f), folder) for d, dirs, names in os.walk(folder) for f in dirs + names}

cases_file, results_file, work = sys.argv[1:]
logs = os.path.join(work, "logs")
os.makedirs(logs)
for case in json.loads(open(cases_file).read()):
    err_path, out_path = (os.path.join(logs, case["id"] + suffix) for suffix in (".stderr", ".stdout"))
    before = files_under(work)
    sys.stdout.flush(), sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.environ.update(case["env"])
            tempfile.tempdir = None  # so that a case's TMPDIR counts
            os.chdir(case.get("cwd", os.getcwd()))
            with open(err_path, "w") as err, open(out_path, "w") as out:
                os.dup2(err.fileno(), 2), os.dup2(out.fileno(), 1)
            sys.modules.pop(case["module"], None)  # runpy re-executes it as __main__
            sys.argv = [case["module"], *case["args"]]
            try:
                runpy.run_module(case["module"], run_name="__main__", alter_sys=True)
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                if not isinstance(exc.code, (int, type(None))):
                    print(exc.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    results["cases"][case["id"]] = {
        "rc": os.waitstatus_to_exitcode(status),
        "stderr": open(err_path).read(),
        "stdout": open(out_path).read(),
        "new_files": sorted(files_under(work) - before - {os.path.relpath(p, work) for p in (err_path, out_path)}),
    }
import_all(name for name in names if name in LATE)
json.dump(results, open(results_file, "w"))
"""

TRAIN = ["--config", "tiny", "--data-dir", "{data}", "--seq-len", "32", "--total-batch-tokens", "64",
         "--device-batch-size", "2", "--device", "cpu", "--compile", "off", "--out-dir", "{work}/out"]  # fmt: skip
B128 = [*TRAIN, "--total-batch-tokens", "128", "--target-tokens", "512", "--eval-tokens", "64"]  # batch128's run
PREPARE = ["--workers", "1", "--out", "{work}/prepared", "--tokenizer", "{data}/tokenizer.json"]
BAD_INPUT = [
    # scripts.prepare_fineweb
    pytest.param("prepare_fineweb", ["--source", "{work}/empty.txt", *PREPARE], {},
                 r"the corpus has no documents.*check --source", id="prepare-empty-corpus"),
    pytest.param("prepare_fineweb", ["--source", "{work}/latin1.txt", *PREPARE], {},
                 r"latin1\.txt is not valid UTF-8 \(byte offset 3\); re-encode it", id="prepare-non-utf8"),
    pytest.param("prepare_fineweb", ["--source", "{work}/absent.jsonl", *PREPARE], {},
                 r"matches no file", id="prepare-missing-source"),
    pytest.param("prepare_fineweb", ["--source", "{work}/table.csv", *PREPARE], {},
                 r"table\.csv: unsupported file type; use \.txt, \.jsonl, \.parquet", id="prepare-unsupported-type"),
    pytest.param("prepare_fineweb", ["--source", "demo", "{work}/empty.txt", *PREPARE], {},
                 r"fineweb, demo, or local files, not a mix", id="prepare-mixed-sources"),
    pytest.param("prepare_fineweb", ["--source", "{work}/story.txt", *PREPARE, "--out", "{work}/a_file/data"], {},
                 r"cannot write into .*a_file/data \(Not a directory\); pass another --out",
                 id="prepare-out-under-a-file"),
    pytest.param("prepare_fineweb", ["--source", "{work}/story.txt", *PREPARE, "--out", "{work}/a_file"], {},
                 r"--out .*a_file is a file; pass a directory", id="prepare-out-is-a-file"),
    pytest.param("prepare_fineweb", ["--source", "{work}/story.txt", *PREPARE, "--out", "{work}/busy"], {},
                 r"busy is in use by another run: pid \d+ on .*; wait for it, or pass another --out",
                 id="prepare-out-in-use"),
    pytest.param("prepare_fineweb", ["--source", "{work}/story.txt", *PREPARE, "--val-tokens", "1e7"], {},
                 r"the corpus is too small for --val-tokens 10,000,000, more than half of it \(1 file, about .* tokens "
                 r".*\); lower --val-tokens, e\.g\. --val-tokens \d+ \(5%\)", id="prepare-val-split-too-big"),
    pytest.param("prepare_fineweb", ["--source", "{work}/story.txt", *PREPARE], {},
                 r"the corpus holds one document, and val and train each take whole documents; split it into several",
                 id="prepare-one-document"),
    pytest.param("prepare_fineweb", ["--source", "{work}/corrupt.parquet", *PREPARE], {},
                 r"corrupt\.parquet is not a readable parquet file \(.*\); ", id="prepare-corrupt-parquet"),
    pytest.param("prepare_fineweb", ["--source", "{work}/story.txt", *PREPARE, "--shards", "0"], {},
                 r"argument --shards: '0' is not an integer >= 1 \(see --help\)", id="prepare-zero-shards"),
    pytest.param("prepare_fineweb", ["--source", "{work}/story.txt", "--train-tokenizer", "--vocab-size", "100"], {},
                 r"argument --vocab-size: '100' is not an integer >= 258 and <= 4294967295",
                 id="prepare-vocab-too-small"),
    pytest.param("prepare_fineweb", ["--source", "{work}/utf16.txt", *PREPARE], {},
                 r"utf16\.txt is UTF-16 text, not UTF-8; re-encode it to UTF-8, e\.g\. `iconv -f utf-16 -t utf-8 "
                 r"utf16\.txt > fixed\.txt`$", id="prepare-utf16"),
    pytest.param("prepare_fineweb", ["--source", "{work}/zeros.txt", *PREPARE], {},
                 r"zeros\.txt holds NUL bytes \(the first at byte offset 0\): binary data, not text; leave it out of "
                 r"--source$", id="prepare-nul-bytes"),
    pytest.param("prepare_fineweb", ["--source", "{work}/licences", *PREPARE], {},
                 r"licences holds no \.txt, \.jsonl, \.parquet file, the suffixes prepare reads, but 2 files of other "
                 r"names \(COPYING, LICENSE\); rename plain-text files to end in \.txt", id="prepare-no-file-it-reads"),
    pytest.param("prepare_fineweb", ["--source", "{work}/story.txt", "{work}/tale.txt", *PREPARE, "--val-tokens", "10",
                                     "--shard-tokens", "100"], {},
                 r"the first document \([\d,]+ tokens\) is longer than the val split \(--val-tokens 10\) and fills a "
                 r"train shard by itself; .* or pass --val-tokens \d+$", id="prepare-first-document-fills-a-shard"),
    # scripts.base_train
    pytest.param("base_train", [*TRAIN, "--config", "nope"], {},
                 r"unknown config 'nope'; valid names: .*tiny", id="train-unknown-config"),
    pytest.param("base_train", [*TRAIN, "--depth", "2"], {},
                 r"either a config name or a depth, not both", id="train-depth-and-config"),
    pytest.param("base_train", [*TRAIN, "--seq-len", "512"], {},
                 r"--seq-len 512 exceeds the config's max_seq_len 256", id="train-seq-len-too-long"),
    pytest.param("base_train", [*TRAIN, "--total-batch-tokens", "100"], {},
                 r"--total-batch-tokens 100 is not divisible by .*\(2 x 32 x 1 = 64\)", id="train-batch-not-divisible"),
    pytest.param("base_train", [*TRAIN, "--data-dir", "{work}/no_such_data"], {},
                 r"no_such_data.* is missing; create it with `python -m scripts\.prepare_fineweb`",
                 id="train-missing-data-dir"),
    pytest.param("base_train", [*TRAIN, "--data-dir", "{work}/bad_magic"], {},
                 r"train_00000\.bin is not a ppt shard \(bad magic number\)", id="train-shard-bad-magic"),
    pytest.param("base_train", [*TRAIN, "--data-dir", "{work}/truncated"], {},
                 r"train_00000\.bin: truncated shard .*; re-run the prepare command that made it \(same --source and "
                 r"--out\): it rebuilds missing and damaged shards$", id="train-shard-truncated"),
    pytest.param("base_train", [*TRAIN, "--data-dir", "{work}/missing_shard"], {},
                 r"missing_shard lacks train_00001\.bin of the 2 train shards its meta\.json records; re-run the "
                 r"prepare command that made it", id="train-shard-missing"),
    pytest.param("base_train", [*TRAIN, "--data-dir", "{work}/old_shard"], {},
                 r"train_00000\.bin was written by an older ppt: its header lacks the largest token id; prepare the "
                 r"data again into a new --out$", id="train-shard-older-format"),
    pytest.param("base_train", [*TRAIN, "--data-dir", "{work}/old_meta"], {},
                 r"old_meta/meta\.json is of format 1, this ppt reads 2; prepare the data again into a new --out$",
                 id="train-data-older-format"),
    pytest.param("base_train", [*TRAIN, "--data-dir", "{work}/other_tokenizer"], {},
                 r"train_00000\.bin was tokenized with other-bpe with fingerprint cdcdcd.*but this run expects",
                 id="train-shard-other-tokenizer"),
    pytest.param("base_train", [*TRAIN, "--resume", "{work}/other_config/step_00000004.pt"], {},
                 r"is from another config: n_layer: checkpoint=2 run=4$", id="train-resume-other-config"),
    pytest.param("base_train", [*TRAIN, "--resume", "{work}/absent/step_00000004.pt"], {},
                 r"checkpoint .*absent/step_00000004\.pt does not exist", id="train-resume-missing-checkpoint"),
    pytest.param("base_train", [*TRAIN, "--out-dir", "{work}/a_file/out"], {},
                 r"output directory .*a_file/out is not writable .*pass --out-dir", id="train-unwritable-out-dir"),
    pytest.param("base_train", TRAIN, {"PPT_DTYPE": "fp8"},
                 r"PPT_DTYPE='fp8' is not a dtype; use one of bf16, fp16, fp32", id="train-bad-ppt-dtype"),
    pytest.param("base_train", [*TRAIN, "--device-batch-size", "0"], {},
                 r"argument --device-batch-size: '0' is not an integer >= 1 \(see --help\)$",
                 id="train-zero-device-batch"),
    pytest.param("base_train", [*TRAIN, "--seq-len", "0"], {},
                 r"argument --seq-len: '0' is not an integer >= 1", id="train-zero-seq-len"),
    pytest.param("base_train", [*TRAIN, "--total-batch-tokens", "0"], {},
                 r"argument --total-batch-tokens: '0' is not a whole number >= 1 and <= 1e15",
                 id="train-zero-batch-tokens"),
    pytest.param("base_train", [*TRAIN, "--target-tokens", "-5"], {},
                 r"argument --target-tokens: '-5' is not a whole number >= 1", id="train-negative-target"),
    pytest.param("base_train", [*TRAIN, "--target-tokens", "10"], {},
                 r"--target-tokens 10 is less than one step of 64 tokens \(--total-batch-tokens\); raise",
                 id="train-target-below-one-step"),
    pytest.param("base_train", [*TRAIN, "--lr=-1e-3"], {},
                 r"argument --lr: '-1e-3' is not a finite number > 0", id="train-negative-lr"),
    pytest.param("base_train", [*TRAIN, "--lr", "nan"], {},
                 r"argument --lr: 'nan' is not a finite number > 0", id="train-nan-lr"),
    pytest.param("base_train", [*TRAIN, "--data-dir", "{work}/big_ids"], {},
                 r"train_00000\.bin holds token id 600, but the model's vocabulary has 512 ids \(0 to 511\); the "
                 r"shard was made by another tokenizer or is damaged", id="train-token-id-outside-vocab"),
    pytest.param("base_train", [*TRAIN, "--out-dir", "{work}/busy"], {},
                 r"busy is in use by another run: pid \d+ on .*\(`base_train --tag busy`\); wait for it, or give "
                 r"this run another --tag or --out-dir$", id="train-out-dir-in-use"),
    pytest.param("base_train", [*TRAIN, "--tag", "busy-tag"], {},
                 r"the run name 'busy-tag' is in use by another run: pid \d+ .*; wait for it, or give this run "
                 r"another --tag$", id="train-tag-in-use"),
    pytest.param("base_train", [*TRAIN, "--out-dir", "{work}/tiny"], {},
                 r"tiny holds checkpoints of an earlier run \(up to step 1\); continue it with --resume auto, or give "
                 r"this run another --tag or --out-dir$", id="train-fresh-run-over-an-earlier-one"),
    pytest.param("base_train", [*TRAIN, "--out-dir", "{work}/other_config"], {},
                 r"other_config holds checkpoints of an earlier run \(up to step 4\); they are another model's "
                 r"\(n_layer: checkpoint=2 run=\d+\): give this run another --tag or --out-dir$",
                 id="train-fresh-run-over-another-models-checkpoints"),
    pytest.param("base_train", [*TRAIN, "--out-dir", "{work}/unreadable"], {},
                 r"unreadable holds checkpoints of an earlier run \(up to step 3\); none of them loads \(see above\): "
                 r"delete them, or give this run another --tag or --out-dir$",
                 id="train-fresh-run-over-unreadable-checkpoints"),
    pytest.param("base_train", [*TRAIN, "--resume", "{work}/batch128/step_00000004.pt"], {},
                 r"step_00000004\.pt trained with other settings \(total_batch_tokens 128 -> 64; .*\): its schedule "
                 r"and data order would not continue",
                 id="train-resume-other-batch"),
    pytest.param("base_train", [*B128, "--data-dir", "{work}/fewer", "--resume", "{work}/batch128/step_00000004.pt"],
                 {},
                 r"step_00000004\.pt trained on other data \(fingerprint [0-9a-f]{12}\) than .*fewer holds "
                 r"\([0-9a-f]{12}\): resume with the --data-dir it trained on, or start a new run$",
                 id="train-resume-other-data"),
    pytest.param("base_train", [*B128, "--resume", "{work}/batch128/step_00000004.pt"], {"PPT_DTYPE": "bf16"},
                 r"step_00000004\.pt trained with other settings \(dtype 'torch.float32' -> 'torch.bfloat16'\): its "
                 r"schedule and data order would not continue", id="train-resume-other-dtype"),
    pytest.param("base_train", [*TRAIN, "--data-dir", "{work}/preparing"], {},
                 r"preparing is being written by a prepare \(pid \d+ .*\); train on it once that has finished$",
                 id="train-data-being-prepared"),
    pytest.param("base_train", [*TRAIN, "--data-dir", "{work}/starting"], {},
                 r"starting is being written by a prepare \(pid \d+ .*\); wait for it to finish$",
                 id="train-data-prepare-starting"),
    pytest.param("base_train", [*TRAIN, "--data-dir", "{work}/damaged_ids"], {},
                 r"damaged_ids/train_00000\.bin holds token id 600, but the model's vocabulary has 512 ids "
                 r"\(0 to 511\); the shard was made by another tokenizer or is damaged", id="train-shard-damaged-ids"),
    pytest.param("base_train", [*TRAIN, "--resume", "{work}/batch128"], {},
                 r"checkpoint .*batch128 is a directory; pass a step_\*\.pt file in it, or --resume auto$",
                 id="train-resume-a-directory"),
    pytest.param("base_train", [*TRAIN, "--target-tokens", "640", "--warmup-tokens", "1000"], {},
                 r"--warmup-tokens 1000 is more than the run's 640 tokens: .*lower --warmup-tokens$",
                 id="train-warmup-past-the-budget"),
    pytest.param("base_train", [*TRAIN, "--eval-tokens", "10"], {},
                 r"--eval-tokens 10 is less than one row of --seq-len 32 per rank \(1 ranks\): raise --eval-tokens "
                 r"to at least 32$", id="train-eval-budget-below-a-row"),
    pytest.param("base_train", [*TRAIN, "--device", "gpu0"], {},
                 r"--device 'gpu0' is not a device name; use cpu, cuda, cuda:N or mps$", id="train-bad-device"),
    pytest.param("base_train", [*TRAIN, "--device", "xla"], {},
                 r"--device xla: this machine has no xla device; leave --device out to autodetect$",
                 id="train-absent-device"),
    pytest.param("base_train", [*TRAIN, "--tag", "../escape"], {},
                 r"argument --tag: '\.\./escape' is not a run name: use letters, digits and \. _ \+ -",
                 id="train-tag-with-a-path"),
    pytest.param("base_train", [*TRAIN, "--lr", "1e300"], {},
                 r"argument --lr: '1e300' is not a finite number > 0 and <= 1e6", id="train-absurd-lr"),
    pytest.param("base_train", [*TRAIN, "--target-flops", "1e300"], {},
                 r"--target-flops 1e\+300 is .* tokens for this model, more than the 1e\+15 any run can count",
                 id="train-absurd-flops-budget"),
    pytest.param("base_train", [*TRAIN, "--from-manifest", "{work}/negative_lr.json"], {},
                 r"negative_lr\.json records --lr -1\.0, which --lr refuses: '-1\.0' is not a finite number > 0",
                 id="train-manifest-with-a-bad-value"),
    pytest.param("base_train", [*TRAIN, "--from-manifest", "{work}/args_list.json"], {},
                 r"args_list\.json's 'args' is not a mapping of settings", id="train-manifest-args-not-a-mapping"),
    # scripts.base_eval
    pytest.param("base_eval", ["--model-tag", "never-trained", "--skip-tasks"], {},
                 r"no checkpoint for tag 'never-trained' in .*; runs under .*checkpoints: some-run; train it or pass "
                 r"--checkpoint", id="eval-unknown-tag"),
    pytest.param("base_eval", ["--checkpoint", "{work}/tiny/step_00000001.pt", "--skip-tasks", "--device", "cpu"], {},
                 r"the run manifest of .*step_00000001\.pt is missing, so the data it was trained on is unknown; "
                 r"pass --data-dir", id="eval-no-manifest"),
    pytest.param("base_eval", ["--checkpoint", "{work}/a_file", "--skip-tasks"], {},
                 r"a_file is not a checkpoint \(not a PyTorch archive\); pass a step_\*\.pt file of base_train$",
                 id="eval-not-a-checkpoint"),
    pytest.param("base_eval", ["--checkpoint", "{work}/tiny/step_00000001.pt", "--data-dir", "{work}/big_ids",
                               "--skip-tasks", "--device", "cpu"], {},
                 r"val_00000\.bin holds token id 600, but the model's vocabulary has 512 ids",
                 id="eval-token-id-outside-vocab"),
    pytest.param("base_eval", ["--model-tag", "never-trained", "--tasks", "hellaswag:five"], {},
                 r"--tasks entry 'hellaswag:five': the shot count after ':' must be a number", id="eval-bad-tasks"),
    pytest.param("base_eval", ["--model-tag", "never-trained", "--limit", "1.5"], {},
                 r"--limit 1\.5: above 1 it counts examples per task, a whole number", id="eval-fractional-limit"),
    pytest.param("base_eval", ["--model-tag", "x", "--batch-size", "0"], {},
                 r"argument --batch-size: '0' is not an integer >= 1", id="eval-zero-batch-size"),
    pytest.param("base_eval", ["--checkpoint", "{work}/absent.pt", "--skip-tasks"], {},
                 r"checkpoint .*absent\.pt does not exist", id="eval-missing-checkpoint"),
    pytest.param("base_eval", ["--checkpoint", "{work}/tiny/step_00000001.pt", "--data-dir", "{data}",
                               "--seq-len", "512", "--skip-tasks", "--device", "cpu"], {},
                 r"--seq-len 512 exceeds the model's max_seq_len 256", id="eval-seq-len-too-long"),
    pytest.param("base_eval", ["--model-tag", "x", "--skip-tasks", "--demo-task"], {},
                 r"--skip-tasks runs bits per byte only; drop it", id="eval-contradictory-flags"),
    pytest.param("base_eval", ["--model-tag", "x", "--checkpoint", "{work}/tiny/step_00000001.pt", "--skip-tasks"], {},
                 r"--model-tag x and --checkpoint .*step_00000001\.pt both name a model; pass one of them$",
                 id="eval-tag-and-checkpoint"),
    pytest.param("base_eval", ["--model-tag", "x", "--limit", "1e19"], {},
                 r"argument --limit: '1e19' is not a finite number > 0 and <= 1e9", id="eval-absurd-limit"),
    pytest.param("base_eval", ["--hf-dir", "{work}/absent_hf", "--data-dir", "{data}", "--skip-tasks"], {},
                 r"absent_hf does not exist; pass a Hugging Face model folder", id="eval-missing-hf-dir"),
    pytest.param("base_eval", ["--hf-dir", "{work}/hf_wide", "--data-dir", "{data}", "--skip-tasks", "--device", "cpu"],
                 {}, r"'s tokenizer has 512 tokens, the model 1,024 \(vocab_size\): they are not of one vocabulary",
                 id="eval-hf-tokenizer-of-another-vocabulary"),
    # scripts.lm_eval: lm-eval's own command line, whose --limit and --num_fewshot ppt checks before handing over
    pytest.param("lm_eval", ["--model", "ppt", "--tasks", "x", "--limit", "nan"], {},
                 r"argument --limit/-L: 'nan' is not a finite number > 0 and <= 1e9", id="lm-eval-nan-limit"),
    pytest.param("lm_eval", ["--model", "ppt", "--tasks", "x", "--limit", "-1"], {},
                 r"argument --limit/-L: '-1' is not a finite number > 0", id="lm-eval-negative-limit"),
    pytest.param("lm_eval", ["--model", "ppt", "--tasks", "x", "--limit", "inf"], {},
                 r"argument --limit/-L: 'inf' is not a finite number", id="lm-eval-infinite-limit"),
    pytest.param("lm_eval", ["--model", "ppt", "--tasks", "x", "--limit", "1e30"], {},
                 r"argument --limit/-L: '1e30' is not a finite number > 0 and <= 1e9", id="lm-eval-absurd-limit"),
    pytest.param("lm_eval", ["--model", "ppt", "--tasks", "x", "--num_fewshot", "-1"], {},
                 r"argument --num_fewshot/-f: '-1' is not an integer >= 0", id="lm-eval-negative-shots"),
    # scripts.export_hf
    pytest.param("export_hf", ["--checkpoint", "{work}/tiny/step_00000001.pt", "--data-dir", "{data}",
                               "--out", "/sys/ppt-export"], {},
                 r"cannot write into /sys \(.*\); pass another --out$", id="export-read-only-out"),
    # scripts.compare and scripts.study
    pytest.param("compare", ["{work}/negative_lr.json", "--plot", "{work}/a_file/bpb.png"], {},
                 r"could not write the plot .*a_file/bpb\.png \(File exists\); pass another --plot$",
                 id="compare-unwritable-plot"),
    pytest.param("study", ["{work}/grid.toml", "--out", "{work}/a_file/study"], {},
                 r"cannot write into .*a_file/study \(Not a directory\); .*pass another --out$",
                 id="study-unwritable-out"),
    pytest.param("study", ["{work}/one_budget.toml", "--dry-run"], {},
                 r"one_budget\.toml: `budgets` has 1: a frontier joins optima at 2 budgets or more; add one$",
                 id="study-one-budget"),
    pytest.param("study", ["{work}/shared_sizes.toml", "--dry-run"], {},
                 r"\[arch\.\*\] tables share sizes \['d3'\]: each size belongs to one architecture",
                 id="study-shared-sizes"),
    pytest.param("study", ["{work}/huge_seed.toml", "--dry-run"], {},
                 r"base_train refuses run d1-f1e\+09-lr0\.003-s1000000000000000019884624838656: argument --seed: "
                 r"'1000000000000000019884624838656' is not an integer >= 0 and <= 4294967295", id="study-huge-seed"),
    pytest.param("study", ["{work}/grid.toml", "--out", "{work}/s_gpus", "--gpus", "7"], {"CUDA_VISIBLE_DEVICES": ""},
                 r"--gpus 7: GPU 7 is not one of the GPUs this machine shows \(none\); pass --gpus all",
                 id="study-unknown-gpu"),
    pytest.param("study", ["{work}/grid.toml", "--out", "{work}/s_k", "--runs-per-gpu", "99"], {},
                 r"--runs-per-gpu 99 is out of range; pass 1 to 16$", id="study-absurd-runs-per-gpu"),
    pytest.param("study", ["{work}/grid.toml", "--out", "{work}/s_slurm", "--launcher", "slurm"],
                 {"PATH": "/nonexistent"}, r"--launcher slurm needs (submitit|Slurm's sbatch and squeue on PATH)",
                 id="study-slurm-without-sbatch"),
    # base_train: said before anything is allocated
    pytest.param("base_train", [*TRAIN, "--weight-decay", "1e30"], {},
                 r"argument --weight-decay: '1e30' is not a finite number >= 0 and <= 1e6",
                 id="train-absurd-weight-decay"),
    pytest.param("base_train", [*TRAIN[2:], "--depth", "64"], {},
                 r"this run needs at least .* GB of memory \(.* for the fp32 weights, gradients and AdamW moments of "
                 r".* parameters\), but .* is free on cpu; choose a smaller config$", id="train-too-big-for-memory"),
    pytest.param("base_train", [*TRAIN[2:], "--depth", "100000"], {},
                 r"depth 100000 is outside the dial's 1 to 64; choose a depth in it$", id="train-depth-past-the-dial"),
    pytest.param("base_train", [*TRAIN[2:], "--config", "d100000"], {},
                 r"depth 100000 is outside the dial's 1 to 64; choose a depth in it$", id="train-config-past-the-dial"),
]  # fmt: skip


def make_bad_inputs(work: Path, data: Path) -> None:
    """The files the BAD_INPUT cases point at."""
    (work / "empty.txt").write_text("  \n")
    (work / "latin1.txt").write_bytes("café".encode("latin-1"))
    (work / "table.csv").write_text("text\nhello\n")
    (work / "a_file").write_text("not a directory")
    (work / "story.txt").write_text("Once upon a time there was a tokenizer. " * 20)
    (work / "corrupt.parquet").write_bytes(b"PAR1" + bytes(100))
    (work / "tale.txt").write_text("A short tale.")
    (work / "utf16.txt").write_bytes("Once upon a time".encode("utf-16"))
    (work / "zeros.txt").write_bytes(bytes(100))
    for name in ("COPYING", "LICENSE"):
        (work / "licences" / name).parent.mkdir(exist_ok=True)
        (work / "licences" / name).write_text("Permission is hereby granted, free of charge, ...")

    def first_shards(name: str, train_shards: int = 1) -> Path:
        """A data directory of the first shard of each split (and train_shards recorded in its meta.json)."""
        meta = read_meta(data)
        meta["train"]["shards"], meta["val"]["shards"] = train_shards, 1
        write_meta(work / name, meta)
        for source in [data / "tokenizer.json", *data.glob("*_00000.bin")]:
            (work / name / source.name).write_bytes(source.read_bytes())
        return work / name

    for name in (
        "bad_magic",
        "truncated",
        "other_tokenizer",
        "big_ids",
        "old_shard",
        "old_meta",
        "damaged_ids",
        "fewer",
    ):
        first_shards(name)
    (work / "old_meta" / "meta.json").write_text(json.dumps({**read_meta(data), "format": 1}))
    first_shards("missing_shard", train_shards=2)
    shard = data / "train_00000.bin"
    old = bytearray(shard.read_bytes())
    old[32:36] = bytes(4)  # flags: no largest token id in the header
    (work / "old_shard" / shard.name).write_bytes(bytes(old))
    (work / "bad_magic" / shard.name).write_bytes(b"NOTSHARD" + shard.read_bytes()[8:])
    (work / "truncated" / shard.name).write_bytes(shard.read_bytes()[:-10])
    damaged = bytearray(shard.read_bytes())
    damaged[-8:-6] = (600).to_bytes(2, "little")  # a token id past the header's largest, its hash not checked
    (work / "damaged_ids" / shard.name).write_bytes(bytes(damaged))
    info, tokens = read_shard(shard)
    write_shard(work / "other_tokenizer" / shard.name, tokens, vocab_size=info.vocab_size, eot_id=info.eot_id,
                fingerprint="cd" * 32, demo=False, tokenizer_name="other-bpe")  # fmt: skip
    for split in ("train", "val"):  # ids that fit the header's vocab (65536) but not the tokenizer's (512)
        info, tokens = read_shard(data / f"{split}_00000.bin")
        tokens = np.array(tokens)
        tokens[7] = 600
        write_shard(work / "big_ids" / f"{split}_00000.bin", tokens, vocab_size=65536, eot_id=info.eot_id,
                    fingerprint=info.tokenizer_fingerprint, demo=True, tokenizer_name=info.tokenizer_name)  # fmt: skip
    # runs held by a live process (this one), and a checkpoint dir left empty beside a real run
    owner = {"pid": os.getpid(), "host": socket.gethostname(), "started": "now",
             "argv": ["base_train", "--tag", "busy"], "process_start": locks._process_start(os.getpid())}  # fmt: skip
    for lock_file in (work / "busy" / locks.LOCK_NAME, work / "cache" / "reports" / ".busy-tag.lock"):
        lock_file.parent.mkdir(parents=True)
        lock_file.write_text(json.dumps(owner))
    (work / "cache" / "checkpoints" / "leftover").mkdir(parents=True)
    preparing = first_shards("preparing")  # a data directory a live prepare (this process) is still writing
    (preparing / locks.LOCK_NAME).write_text(json.dumps({**owner, "argv": ["prepare_fineweb"]}))
    (work / "starting").mkdir()  # ... and one whose prepare has not written meta.json yet
    (work / "starting" / locks.LOCK_NAME).write_text(json.dumps({**owner, "argv": ["prepare_fineweb"]}))
    write_manifest(work, "negative_lr", 1.0, args={"lr": -1.0})
    write_manifest(work, "args_list", 1.0, args=["x"])

    meta = json.loads((data / "meta.json").read_text())["tokenizer"]
    config = dataclasses.replace(get_config("tiny"), vocab_size=meta["vocab_size"])
    other = dataclasses.replace(config, n_layer=2)
    ckpt.save_checkpoint(
        work / "other_config", 4, {"format": 2, "config": {"class": type(other).__name__, **dataclasses.asdict(other)}}
    )
    model = build_model(config)
    model.init_weights()
    payload = {"model": model.state_dict(), "config": {"class": type(config).__name__, **dataclasses.asdict(config)}}
    ckpt.save_checkpoint(work / "tiny", 1, {**payload, "tokenizer_fingerprint": meta["fingerprint"]})
    ckpt.save_checkpoint(work / "cache" / "checkpoints" / "some-run", 1, payload)
    (work / "unreadable").mkdir()
    (work / "unreadable" / "step_00000003.pt").write_bytes(b"not a checkpoint")  # what a disk error may leave
    # a Hugging Face folder whose model has 1,024 token rows but whose tokenizer (the data's) has 512
    from safetensors.torch import load_file, save_file

    from scripts.export_hf import export_model

    wide = export_model(payload["model"], payload["config"], load_data_tokenizer(data), work / "hf_wide")
    weights = load_file(wide / "model.safetensors")
    embed = weights["model.embed_tokens.weight"]
    weights["model.embed_tokens.weight"] = torch.cat([embed, torch.zeros_like(embed)])
    save_file(weights, str(wide / "model.safetensors"), metadata={"format": "pt"})
    (wide / "config.json").write_text(json.dumps(json.loads((wide / "config.json").read_text()) | {"vocab_size": 1024}))
    archs = '[arch.a]\nsizes = ["d1", "d2", "d3"]\nlrs = [3e-3]\n[arch.b]\nsizes = ["d4", "d5", "d6"]\nlrs = [3e-3]\n'
    (work / "grid.toml").write_text(f'data_dir = "{data}"\nbudgets = [1e9, 3e9]\n{archs}')
    (work / "one_budget.toml").write_text(f'data_dir = "{data}"\nbudgets = [1e9]\n{archs}')
    (work / "shared_sizes.toml").write_text(f'data_dir = "{data}"\nbudgets = [1e9, 3e9]\n{archs.replace("d4", "d3")}')
    (work / "huge_seed.toml").write_text(f'data_dir = "{data}"\nbudgets = [1e9, 3e9]\nseeds = [0, 1e30]\n{archs}')
    batch128 = [*B128, "--tag", "b128"]
    with pytest.MonkeyPatch.context() as mp:  # a real checkpoint, its record in a cache of its own
        mp.setenv("PPT_CACHE", str(work / "batch128_cache"))
        base_train.main([a.format(work=work, data=data) for a in batch128] + ["--out-dir", str(work / "batch128")])


def entry_points(suffix: str) -> list[str]:
    """What users start and the measurement tools: every scripts/*.sh and bench/*.sh, and every .py there with a
    __main__ block (found, so that a new script is covered without a test edit), as folder/name."""
    paths = sorted(p for folder in ("scripts", "bench") for p in (REPO_ROOT / folder).glob(f"*{suffix}"))
    return [
        f"{p.parent.name}/{p.name}" for p in paths if suffix == ".sh" or 'if __name__ == "__main__":' in p.read_text()
    ]


def help_case(script: str, work: Path) -> dict:
    """`python -m scripts.X --help` with its own empty cache, home, temp and working directories, to see whether it
    writes anything anywhere."""
    home = work / "help" / script
    places = {name: home / name for name in ("cache", "home", "tmp", "cwd")}
    for place in places.values():
        place.mkdir(parents=True)
    env = {"PPT_CACHE": str(places["cache"]), "HOME": str(places["home"]), "TMPDIR": str(places["tmp"])}
    module = script.removesuffix(".py").replace("/", ".")
    return {"id": f"help-{module}", "module": module, "args": ["--help"], "env": env, "cwd": str(places["cwd"])}


@pytest.fixture(scope="module", autouse=True)
def driver(demo_data_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """Starts DRIVER with this module's first test, so it runs beside the training tests; calling it waits."""
    work = tmp_path_factory.mktemp("bad_input")
    make_bad_inputs(work, demo_data_dir)
    fill = lambda text: text.format(work=work, data=demo_data_dir)  # noqa: E731
    cases = [
        {"id": p.id, "module": f"scripts.{p.values[0]}", "args": [fill(a) for a in p.values[1]], "env": p.values[2]}
        for p in BAD_INPUT
    ]
    cases += [help_case(script, work) for script in entry_points(".py")]
    (work / "cases.json").write_text(json.dumps(cases))
    (work / "driver.py").write_text(DRIVER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))}
    # online as far as libraries know: the blocked socket is what must stop them
    env |= {"PPT_CACHE": str(work / "cache"), "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    with open(work / "driver.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, str(work / "driver.py"), str(work / "cases.json"), str(work / "results.json"), str(work)],
            cwd=REPO_ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    @functools.cache
    def results() -> dict:
        proc.wait(timeout=300)
        assert proc.returncode == 0, (work / "driver.log").read_text()
        return {**json.loads((work / "results.json").read_text()), "work": str(work), "data": str(demo_data_dir)}

    yield results
    proc.kill()
    proc.wait()


def test_nothing_touches_the_network_at_import(driver):
    imports = driver()["imports"]
    assert not imports["failed"], imports["failed"]
    assert not imports["network_attempts"], imports["network_attempts"]
    assert {"ppt.model", "ppt.evals", "scripts.base_train", "scripts.base_eval", "scripts.prepare_fineweb"} <= set(
        imports["modules"]
    )


@pytest.mark.parametrize("script, args, env, message", BAD_INPUT)
def test_bad_input_prints_one_error_line_and_exits_2(script, args, env, message, driver, request):
    result = driver()["cases"][request.node.callspec.id]
    lines = [line for line in result["stderr"].splitlines() if line.strip()]
    assert result["rc"] == 2, result["stderr"]
    assert lines and lines[-1].startswith("error: "), result["stderr"]
    assert re.search(message, lines[-1]), result["stderr"]
    assert "Traceback" not in result["stderr"]
    assert result["new_files"] == [], "left behind"  # nothing written, nothing half-made


def bad_input_table(results: dict) -> str:
    """docs/bad-input.md from its key on: each BAD_INPUT case, its command and the last line it printed, with what
    differs between runs and machines (temporary folders, pids, hosts, free memory, a permission error's wording, the
    demo tokenizer's fingerprint and a shard's size: the demo corpus is the stdlib modules that import) replaced."""

    def shown(text: str) -> str:
        text = text.replace(results["work"] + "/", "").replace(results["data"], "<data>")
        text = re.sub(r"pid \d+ on [^,]+,", "pid <pid> on <host>,", text)
        text = re.sub(r"but [\d.]+ [KMGT]?B is free", "but <n> is free", text)
        text = re.sub(r"fingerprint [0-9a-f]{16}\b(?<!cdcdcdcdcdcdcdcd)", "fingerprint <demo>", text)  # stdlib-made
        text = re.sub(r"\b[0-9a-f]{12}\)", "<fingerprint>)", text)  # a data set's fingerprint: its stdlib-made text
        text = re.sub(
            r"\((\d+) bytes, header says (\d+)\)",
            lambda m: f"(<n> bytes, header says <n + {int(m[2]) - int(m[1])}>)",
            text,
        )
        text = re.sub(r"\((Operation not permitted|Permission denied|Read-only file system)\)", "(<os error>)", text)
        return "`` " + text.replace("|", r"\|") + " ``"

    shared = {"base_train": TRAIN[2:], "prepare_fineweb": PREPARE}
    key = "; ".join(f"{script} {shown(' '.join(args).format(**results))}" for script, args in shared.items())
    rows = [f"`...` stands for the flags the cases of a script share: {key}.", "",
            "| case (id) | command | what it prints |", "|---|---|---|"]  # fmt: skip
    for case in BAD_INPUT:
        script, args, env = case.values[:3]
        args = " ".join(args)
        for flags in shared.values():
            args = args.replace(" ".join(flags), "...")
        command = [*(f"{k}={v}" for k, v in env.items()), f"python -m scripts.{script}", args.format(**results)]
        printed = [line for line in results["cases"][case.id]["stderr"].splitlines() if line.strip()][-1]
        rows.append(f"| {case.id} | {shown(' '.join(command))} | {shown(printed)} |")
    return "\n".join(rows) + "\n"


def test_docs_bad_input_table_states_every_case_with_its_message(driver):
    doc = REPO_ROOT / "docs" / "bad-input.md"
    text = doc.read_text()
    expected = text[: text.index("`...` stands for")] + bad_input_table(driver())
    if os.environ.get("PPT_WRITE_BAD_INPUT_TABLE"):
        doc.write_text(expected)
    assert doc.read_text() == expected, (
        "docs/bad-input.md's table is out of date; rewrite it with "
        "`PPT_WRITE_BAD_INPUT_TABLE=1 pytest tests/test_reliability.py -k table`"
    )


@pytest.mark.parametrize("script", entry_points(".py"))
def test_every_python_entry_point_answers_help_and_does_nothing_else(script, driver):
    result = driver()["cases"][f"help-{script.removesuffix('.py').replace('/', '.')}"]
    assert result["rc"] == 0, result["stderr"]
    assert "usage:" in result["stdout"], result["stdout"]
    assert result["new_files"] == []  # nothing in its cache, home, temp or working directory


@pytest.mark.parametrize("script", entry_points(".sh"))
def test_every_shell_entry_point_answers_help_and_does_nothing_else(script, tmp_path):
    """Before anything else: no environment sync, no install (uv, pip and python are stubs that would leave a
    mark), nothing prepared, trained or written."""
    stubs, marks = tmp_path / "bin", tmp_path / "marks"
    stubs.mkdir(), marks.mkdir()
    for tool in ("uv", "pip", "python", "python3", "torchrun", "nvidia-smi"):
        (stubs / tool).write_text(f'#!/bin/sh\ntouch "{marks}/{tool}"\n')
        (stubs / tool).chmod(0o755)
    places = {name: tmp_path / name for name in ("cache", "home", "tmp")}
    for place in places.values():
        place.mkdir()
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "PPT_CACHE": str(places["cache"]), "HOME": str(places["home"])}
    out = subprocess.run(
        ["bash", str(REPO_ROOT / script), "--help"],
        env={**env, "TMPDIR": str(places["tmp"])},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.splitlines()) >= 2, out.stdout  # its usage
    assert not list(marks.iterdir()), "ran " + ", ".join(p.name for p in marks.iterdir())
    assert not [p for place in places.values() for p in place.rglob("*")]
