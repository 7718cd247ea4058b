"""A study run as a Slurm job: what submitit pickles and runs on a node. It imports nothing heavy, so a job starts
one Python that imports torch (base_train's), not two."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_env(extra: dict[str, str]) -> dict[str, str]:
    """This process's environment for a run: `extra`, and the repository importable from any working directory."""
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


@dataclass
class SlurmRun:
    """base_train as a child process that ignores the warning signal Slurm sends before a time limit or a preemption
    (submitit's, USR2 unless SUBMITIT_PREEMPT_SIGNAL says otherwise). submitit catches it and calls `checkpoint`,
    which lets the run end its step and save, then requeues the job with this same run, which resumes from that
    checkpoint (`--resume auto` is in every study run's flags). Returns base_train's exit status."""

    argv: list[str]
    log: str
    cwd: str
    env: dict[str, str]
    process: subprocess.Popen | None = None

    def __call__(self) -> int:
        warning = signal.Signals[f"SIG{os.environ.get('SUBMITIT_PREEMPT_SIGNAL', 'USR2')}"]
        with open(self.log, "a") as log:
            print(f"$ python -m scripts.base_train {shlex.join(self.argv)}", file=log, flush=True)
            self.process = subprocess.Popen(
                [sys.executable, "-m", "scripts.base_train", *self.argv], cwd=self.cwd, env=run_env(self.env),
                stdout=log, stderr=subprocess.STDOUT, preexec_fn=lambda: signal.signal(warning, signal.SIG_IGN),
            )  # fmt: skip
            return self.process.wait()

    def checkpoint(self) -> object:
        import submitit

        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # base_train ends its step and saves
            self.process.wait()
        return submitit.helpers.DelayedSubmission(replace(self, process=None))

    def __getstate__(self) -> dict:
        return self.__dict__ | {"process": None}
