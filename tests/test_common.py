import argparse
import json
import os
import re
import socket
import subprocess
import sys

import pytest
import torch

from ppt import common, locks


def test_dtype_autodetect_and_override(monkeypatch):
    monkeypatch.delenv("PPT_DTYPE", raising=False)
    assert common.autodetect_dtype(torch.device("cpu")) == torch.float32
    monkeypatch.setenv("PPT_DTYPE", "bf16")
    assert common.autodetect_dtype(torch.device("cpu")) == torch.bfloat16
    monkeypatch.setenv("PPT_DTYPE", "int3")
    with pytest.raises(common.PPTError, match="PPT_DTYPE"):
        common.autodetect_dtype(torch.device("cpu"))


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("PPT_CACHE", str(tmp_path))
    assert common.cache_dir() == tmp_path
    monkeypatch.delenv("PPT_CACHE")
    assert common.cache_dir().parts[-2:] == (".cache", "ppt")


def test_single_process_runtime(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    rt = common.init_runtime("cpu")
    assert (rt.rank, rt.world_size, rt.is_master, rt.distributed) == (0, 1, True, False)
    assert rt.device.type == "cpu"


def test_print0_is_silent_off_rank_zero(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    common.print0("hidden")
    monkeypatch.setenv("RANK", "0")
    common.print0("shown")
    assert capsys.readouterr().out == "shown\n"


# ---- one run per directory -----------------------------------------------------------------------------------------


def owner_record(pid: int, host: str | None = None) -> str:
    """A lock file's content as another process would have written it."""
    return json.dumps(
        {"pid": pid, "host": host or socket.gethostname(), "started": "2025-01-01T00:00:00", "argv": ["base_train"],
         "process_start": locks._process_start(pid), "token": "someone-else"}
    )  # fmt: skip


@pytest.fixture
def live_process():
    """A process that stays alive while the test runs, as the owner of a lock."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def test_a_live_owner_keeps_its_lock_and_is_named(tmp_path, live_process):
    (tmp_path / locks.LOCK_NAME).write_text(owner_record(live_process.pid))
    with pytest.raises(common.PPTError) as busy:
        locks.lock_directory(tmp_path, "pass another --out-dir")
    message = str(busy.value)
    assert f"is in use by another run: pid {live_process.pid} on {socket.gethostname()}" in message
    assert "`base_train`" in message and message.endswith("wait for it, or pass another --out-dir")
    assert json.loads((tmp_path / locks.LOCK_NAME).read_text())["token"] == "someone-else"


def test_a_dead_owners_lock_is_taken_over_and_released(tmp_path, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: its pid names no process now
    (tmp_path / locks.LOCK_NAME).write_text(owner_record(dead.pid))
    lock = locks.lock_directory(tmp_path, "pass another --out-dir")
    err = capsys.readouterr().err
    assert (
        f"was locked by pid {dead.pid} on {socket.gethostname()}" in err and "no longer running; taking it over" in err
    )
    owner = json.loads(lock.path.read_text())
    assert owner["pid"] == os.getpid() and owner["host"] == socket.gethostname() and "argv" in owner
    locks.release_locks()
    assert not lock.path.exists() and not list(tmp_path.iterdir())


def test_a_pid_reused_by_a_newer_process_does_not_hold_the_lock(tmp_path, live_process):
    record = json.loads(owner_record(live_process.pid))
    record["process_start"] = "1"  # the owner started at boot; the process with its pid now did not
    (tmp_path / locks.LOCK_NAME).write_text(json.dumps(record))
    locks.lock_directory(tmp_path, "fix")
    locks.release_locks()


def test_another_hosts_lock_is_refused_with_how_to_remove_it(tmp_path):
    (tmp_path / locks.LOCK_NAME).write_text(owner_record(12345, host="gpu-node-7"))
    with pytest.raises(
        common.PPTError, match=r"locked by pid 12345 on gpu-node-7, .*another host.*delete .*\.ppt\.lock"
    ):
        locks.lock_directory(tmp_path, "pass another --out")


def test_release_leaves_another_runs_lock_alone(tmp_path):
    lock = locks.lock_directory(tmp_path, "fix")
    lock.path.write_text(owner_record(os.getpid()))  # replaced, say by hand, by someone else's
    locks.release_locks()
    assert lock.path.exists()


def test_an_unreadable_lock_file_says_to_delete_it_if_unused(tmp_path):
    (tmp_path / locks.LOCK_NAME).write_text("{half")
    with pytest.raises(common.PPTError, match=r"lock file .*\.ppt\.lock is unreadable .*if no run uses .*, delete it"):
        locks.lock_directory(tmp_path, "fix")


def test_only_what_dead_processes_of_this_host_left_is_removed(tmp_path, live_process):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = {
        ".ppt.lock": owner_record(dead.pid),
        ".run.lock": owner_record(live_process.pid),
        ".other.lock": owner_record(dead.pid, host="gpu-node-7"),  # its liveness cannot be seen from here
        f".run_loss.png.{dead.pid}.tmp": "",
        f".run.json.{live_process.pid}.tmp": "",
        "run.json": "{}",
    }
    for name, text in left.items():
        (tmp_path / name).write_text(text)
    removed = locks.remove_leftovers(tmp_path)
    assert sorted(p.name for p in removed) == [".ppt.lock", f".run_loss.png.{dead.pid}.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(set(left) - {p.name for p in removed})


# ---- numbers and sizes ---------------------------------------------------------------------------------------------


def test_number_checks_name_what_is_accepted():
    assert common.positive_int("3") == 3 and common.nonneg_int("0") == 0
    assert common.token_count("2e9") == 2_000_000_000 and common.token_count("1_000") == 1000
    assert common.positive_float("1e-3") == 1e-3 and common.nonneg_float("0") == 0.0
    refused = [(common.positive_int, "0"), (common.positive_int, "2.5"), (common.token_count, "2.5"),
               (common.token_count, "2e16"), (common.positive_float, "nan"), (common.nonneg_float, "-0.1")]  # fmt: skip
    for validator, text in refused:
        with pytest.raises(
            argparse.ArgumentTypeError, match=f"'{re.escape(text)}' is not {re.escape(validator.accepted)}"
        ):
            validator(text)
    assert common.token_count.accepted == "a whole number >= 1 and <= 1e15 (2e9 notation allowed)"
    assert common.positive_float.accepted == "a finite number > 0"


def test_format_sizes_shows_enough_digits_to_tell_sizes_apart():
    assert common.format_sizes(21.37e6, 21.6e6) == ["21.4 MB", "21.6 MB"]
    assert common.format_sizes(21.61e6, 21.6e6) == ["21.61 MB", "21.60 MB"]
    assert common.format_sizes(2.5e10, 1.5e6) == ["25.0 GB", "1.5 MB"]
