"""Where a study's runs train, each a base_train process of its own: a run that dies (out of memory, a lost node)
takes nothing else with it, and its GPU is chosen through CUDA_VISIBLE_DEVICES before CUDA starts.

- LocalPool: K runs to each GPU of this machine (`--gpus`, `--runs-per-gpu`), or K at once on its CPU, forked from a
  server process that imported base_train once (a run starts in a fraction of a second, not after seconds of torch).
- SlurmLauncher: one Slurm job per run through submitit; a run saves and stops at Slurm's warning before a time limit
  or a preemption, and submitit requeues the job, which resumes it (`--resume auto` is in every run's flags).

A launcher starts runs, says which ended with what exit status, and stops them. Exit statuses are base_train's: 0
finished, 2 an error line (`error: ...` in the log), 128 + SIGTERM stopped with a checkpoint; None: the process or
job vanished without one (killed, node lost).
"""

from __future__ import annotations

import contextlib
import ctypes
import getpass
import json
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ppt.common import PPTError, atomic_file, run_cli
from scripts.slurm_job import REPO_ROOT, SlurmRun, run_env

MAX_RUNS_PER_GPU = 16  # more small runs than this on one GPU only contend for its launch queue and memory
SLURM_POLL_S = 15.0  # seconds between looks at squeue (a cluster's controller serves many users)
PR_SET_PDEATHSIG = 1  # Linux prctl: the signal a process gets when its parent dies
# What every run imports, once in the pool's server: base_train, torch._inductor (--deterministic imports it), and the
# loss curve's plotting
PRELOADED = ["scripts.base_train", "torch._inductor", "matplotlib.backends.backend_agg"]


@dataclass
class Job:
    """A run in flight: where it trains (`where`: "GPU 0", "CPU", "Slurm job 1234") and since when."""

    name: str
    where: str
    started: float = field(default_factory=time.time)
    handle: object = None  # the local process, or the Slurm job id
    slot: int | None = None  # the local pool's slot: its GPU id, None for the CPU


def last_error(log: Path) -> str:
    """The last line a run's log says about how it ended: its `error:` line, else a traceback's last line."""
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return f"no log at {log}"
    errors = [line for line in lines if line.startswith("error:")]
    return (errors or lines or ["(empty log)"])[-1]


# ---------------------------------------------------------------------------------------------------------------------
# The local pool


def chosen_gpus(choice: str) -> list[str]:
    """--gpus: 'all' (every visible GPU; none on a machine without one) or ids 0,1,3 of the visible GPUs, each as
    CUDA_VISIBLE_DEVICES names it for a child (this process's own list, if set)."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = listed.split(",")[:count] if listed else [str(i) for i in range(count)]
    if choice == "all":
        return visible
    try:
        ids = [int(i) for i in choice.split(",")]
    except ValueError:
        raise PPTError(f"--gpus {choice!r} is not 'all' or a list of GPU ids such as 0,1,3") from None
    if bad := [i for i in ids if not 0 <= i < len(visible)] or len(set(ids)) < len(ids):
        shown = f"{len(visible)}: ids 0 to {len(visible) - 1}" if visible else "none"
        problem = f"GPU {', '.join(map(str, bad))} is not" if bad else "an id is repeated:"
        raise PPTError(f"--gpus {choice}: {problem} one of the GPUs this machine shows ({shown}); pass --gpus all "
                       "or ids from that range, each once")  # fmt: skip
    return [visible[i] for i in ids]


def _child(argv: list[str], log: str, env: dict[str, str], cwd: str) -> None:
    """A local run's process: base_train in its own process group (a terminal's Ctrl-C reaches the study, which stops
    its runs), stopped with SIGTERM (a checkpoint, then exit) when the pool's server dies with the study, even by
    kill -9, output into its log."""
    os.setsid()
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() == 1:  # the server died before prctl: nobody is left to report to
        sys.exit(128 + signal.SIGTERM)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout.reconfigure(line_buffering=True)
    from scripts import base_train

    if threads := env.get("OMP_NUM_THREADS"):  # torch, imported by the server, has not started its threads yet
        base_train.torch.set_num_threads(int(threads))
    sys.argv = ["scripts/base_train.py", *argv]
    print(f"$ python -m scripts.base_train {shlex.join(argv)}", flush=True)
    run_cli(lambda: base_train.main(argv))


class LocalPool:
    """`runs_per_gpu` runs at once on each GPU of `gpus`, or on the CPU when `gpus` is empty."""

    def __init__(self, gpus: list[str], runs_per_gpu: int) -> None:
        if not 1 <= runs_per_gpu <= MAX_RUNS_PER_GPU:
            raise PPTError(f"--runs-per-gpu {runs_per_gpu} is out of range; pass 1 to {MAX_RUNS_PER_GPU}")
        self.gpus, self.runs_per_gpu = gpus, runs_per_gpu
        self.free: list[str | None] = [gpu for gpu in gpus for _ in range(runs_per_gpu)] or [None] * runs_per_gpu
        self.slots = len(self.free)
        self.device = "GPU" if gpus else "CPU"
        self.running: dict[int, tuple[Job, multiprocessing.Process]] = {}
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(PRELOADED)
        multiprocessing.forkserver.ensure_running()  # its imports now, beside the study's planning

    def describe(self) -> str:
        where = f"GPU {','.join(sorted(self.gpus))}" if self.gpus else "the CPU"
        return f"{self.slots} slot{'s' * (self.slots > 1)}: {self.runs_per_gpu} run(s) at once on {where}"

    def start(self, name: str, argv: list[str], log: Path, env: dict[str, str]) -> Job:
        gpu = self.free.pop(0)
        extra = {**env, "PPT_RUNS_PER_GPU": str(self.runs_per_gpu)}
        if gpu is None:  # one thread a run: a run's bits do not depend on how many train beside it
            extra["OMP_NUM_THREADS"] = "1"
        else:
            extra["CUDA_VISIBLE_DEVICES"] = gpu
        process = self.context.Process(target=_child, args=(argv, str(log), run_env(extra), os.getcwd()), name=name)
        process.start()
        job = Job(name, "CPU" if gpu is None else f"GPU {gpu}", handle=process.pid, slot=gpu)
        self.running[process.sentinel] = (job, process)
        return job

    def wait(self, timeout: float) -> list[tuple[Job, int | None]]:
        """The runs that ended within `timeout` seconds (returns as soon as one has), with their exit statuses."""
        if not self.running:
            time.sleep(timeout)
            return []
        done = []
        for sentinel in multiprocessing.connection.wait(list(self.running), timeout):
            job, process = self.running.pop(sentinel)
            process.join()
            self.free.append(job.slot)
            done.append((job, None if process.exitcode < 0 else process.exitcode))  # < 0: killed by a signal
        return done

    def stop(self, job: Job) -> None:
        """Ask a run to stop: base_train ends its step, saves a checkpoint and exits."""
        with contextlib.suppress(ProcessLookupError):  # it has ended meanwhile
            os.kill(job.handle, signal.SIGTERM)

    def adopt(self, runs: dict[str, Path]) -> list[Job]:
        """Runs of an earlier study on this machine still stopping (their server died with it, so they got SIGTERM):
        wait until they have saved and exited, so that this study resumes them from their checkpoints."""
        from ppt.locks import directory_user

        for name, run_dir in runs.items():
            while user := directory_user(run_dir):
                print(f"waiting for {name}, still stopping from an earlier study ({user})", flush=True)
                time.sleep(2)
        return []

    @property
    def capacity(self) -> int:
        return len(self.free)


# ---------------------------------------------------------------------------------------------------------------------
# Slurm


@dataclass
class SlurmSettings:
    """The sbatch settings of every run's job (the grid's [slurm] table, or flags)."""

    partition: str | None = None
    time_min: int = 60
    gpus_per_run: int = 1
    cpus_per_run: int | None = None
    account: str | None = None
    sbatch: list[str] = field(default_factory=list)  # other sbatch flags, e.g. ["--qos=high", "--constraint=h100"]


class SlurmLauncher:
    """One job per run, through submitit; the job ids in `<folder>/jobs.json`, so that a study started again adopts
    its jobs still queued or running instead of submitting them twice."""

    def __init__(self, folder: Path, settings: SlurmSettings) -> None:
        try:
            import submitit
        except ImportError:
            raise PPTError("--launcher slurm needs submitit: uv sync --extra slurm (or pip install submitit)") from None
        if shutil.which("sbatch") is None or shutil.which("squeue") is None:
            raise PPTError("--launcher slurm needs Slurm's sbatch and squeue on PATH, and neither is here; run the "
                           "study on a login node of the cluster, or use --launcher local")  # fmt: skip
        self.folder, self.settings = folder, settings
        self.jobs_file = folder / "jobs.json"
        self.executor = submitit.SlurmExecutor(folder=folder / "%j")
        flags = (flag.removeprefix("--").partition("=") for flag in settings.sbatch)
        extra = {key.replace("-", "_"): value or True for key, _, value in flags}
        gpus = {"gpus_per_node": settings.gpus_per_run} if settings.gpus_per_run else {}
        self.executor.update_parameters(
            time=settings.time_min, partition=settings.partition, account=settings.account,
            cpus_per_task=settings.cpus_per_run, additional_parameters=extra, **gpus,
            setup=[f"export PYTHONPATH={shlex.quote(str(REPO_ROOT))}${{PYTHONPATH:+:$PYTHONPATH}}"],  # for SlurmRun
        )  # fmt: skip
        self.running: dict[str, Job] = {}  # by job id
        self.device = "GPU" if settings.gpus_per_run else "CPU"

    def describe(self) -> str:
        where = f"partition {self.settings.partition}" if self.settings.partition else "the default partition"
        return f"one Slurm job a run on {where}, {self.settings.time_min} min each; submitit's files in {self.folder}"

    def _record(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        with atomic_file(self.jobs_file) as f:
            f.write(json.dumps({job.name: job_id for job_id, job in self.running.items()}, indent=1).encode())

    def start(self, name: str, argv: list[str], log: Path, env: dict[str, str]) -> Job:
        self.executor.update_parameters(job_name=name)
        if not self.settings.gpus_per_run:  # a CPU job's threads: its CPUs (one: the bits of the local pool's runs)
            env = {**env, "OMP_NUM_THREADS": str(self.settings.cpus_per_run or 1)}
        try:
            submitted = self.executor.submit(SlurmRun(argv, str(log), os.getcwd(), env))
        except Exception as exc:  # submitit raises its own errors and subprocess's, with sbatch's message inside
            lines = [line for line in str(exc).splitlines() if "error" in line.lower()] or str(exc).splitlines()
            raise PPTError(f"sbatch refused run {name}: {lines[0].strip() if lines else exc}; fix the Slurm "
                           "settings (--partition, --account, --sbatch)") from None  # fmt: skip
        job = Job(name, f"Slurm job {submitted.job_id}", handle=submitted.job_id)
        self.running[submitted.job_id] = job
        self._record()
        return job

    def alive(self) -> set[str]:
        """The ids of this user's jobs Slurm still has queued, running or requeued."""
        out = subprocess.run(["squeue", "--noheader", "--format=%i", "--user", getpass.getuser()],
                             capture_output=True, text=True)  # fmt: skip
        if out.returncode:
            raise PPTError(f"squeue failed: {(out.stderr or out.stdout).strip()}; check that Slurm answers (sinfo)")
        return {line.strip() for line in out.stdout.splitlines()}

    def wait(self, timeout: float) -> list[tuple[Job, int | None]]:
        time.sleep(max(timeout, SLURM_POLL_S))
        alive = self.alive()
        if done := [(self.running.pop(i), self._exit_status(i)) for i in list(self.running) if i not in alive]:
            self._record()
        return done

    def _exit_status(self, job_id: str) -> int | None:
        """base_train's exit status, from the result submitit's job wrote; None if it wrote none (killed, lost)."""
        import submitit

        path = submitit.core.utils.JobPaths(self.folder / "%j", job_id).result_pickle
        try:
            outcome, value = submitit.core.utils.pickle_load(path)
        except (OSError, EOFError, ValueError):
            return None
        return value if outcome == "success" and isinstance(value, int) else None

    def stop(self, job: Job) -> None:
        subprocess.run(["scancel", "--signal=TERM", "--full", job.handle], capture_output=True)

    def adopt(self, runs: dict[str, Path]) -> list[Job]:
        """The jobs an earlier study submitted that Slurm still has: followed, not submitted again."""
        recorded = json.loads(self.jobs_file.read_text()) if self.jobs_file.is_file() else {}
        alive = self.alive()
        for name, job_id in recorded.items():
            if job_id in alive and name in runs:
                self.running[job_id] = Job(name, f"Slurm job {job_id}", handle=job_id)
        self._record()
        return list(self.running.values())

    @property
    def capacity(self) -> float:
        return float("inf")  # Slurm queues what the cluster cannot run yet


def jobs_in_flight(folder: Path) -> dict[str, str]:
    """Runs an earlier study left as Slurm jobs that Slurm still has ({} without squeue, or without a jobs file)."""
    try:
        recorded = json.loads((folder / "jobs.json").read_text())
    except OSError:  # none written (or no such folder)
        return {}
    if shutil.which("squeue") is None:
        return {}
    alive = set(subprocess.run(["squeue", "--noheader", "--format=%i"], capture_output=True, text=True).stdout.split())
    return {name: job_id for name, job_id in recorded.items() if job_id in alive}
