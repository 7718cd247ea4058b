"""One run per output directory: a lock file that names its owner, taken over when that owner is dead (SPEC.md).
`lock_directory` locks a directory through `<directory>/.ppt.lock`, `hold_lock` anything else (a run name); locks are
released by `release_locks()`, at exit, on errors and on signals."""

from __future__ import annotations

import atexit
import errno
import json
import os
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from ppt.common import PPTError, temp_path, warn0

LOCK_NAME = ".ppt.lock"


@dataclass(frozen=True)
class Lock:
    """A lock file this process holds: JSON naming its owner, removed by `release`."""

    path: Path
    token: str
    pid: int
    made_dirs: tuple[Path, ...] = ()  # folders the run made, deepest first: gone again if it wrote nothing there

    def release(self) -> None:
        """Remove the lock file if it is still this process's (never in a forked child, never another's lock)."""
        if os.getpid() != self.pid:
            return
        try:
            if json.loads(self.path.read_text()).get("token") == self.token:
                self.path.unlink()
                for directory in self.made_dirs:
                    directory.rmdir()  # fails, as it should, when the run left anything in it
        except (OSError, ValueError):
            pass


_held_locks: list[Lock] = []


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (Linux; None elsewhere or when there is no such pid)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _process_start(pid: int) -> str | None:
    """When the kernel started a process (stat's field 22): tells a lock's owner from a newer process with its pid."""
    fields = _proc_stat(pid)
    return fields[19] if fields and len(fields) > 19 else None


def _owner_alive(owner: dict) -> bool:
    pid = int(owner["pid"])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        pass
    fields = _proc_stat(pid)
    if fields is None:  # no /proc: the pid exists, take it for the owner
        return True
    started = owner.get("process_start")
    return fields[0] != "Z" and (started is None or _process_start(pid) == started)  # Z: killed, not yet reaped


def _read_owner(lock_file: Path, what: str) -> dict | None:
    """The owner recorded in a lock file; None when the file vanished meanwhile (its owner released it)."""
    try:
        owner = json.loads(lock_file.read_text())
        if not isinstance(owner, dict) or "pid" not in owner:
            raise ValueError("no pid")
        return owner
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise PPTError(f"the lock file {lock_file} is unreadable ({exc}); if no run uses {what}, delete it") from exc


def _describe_owner(owner: dict) -> str:
    command = " ".join(str(arg) for arg in owner.get("argv", []))
    described = f"pid {owner['pid']} on {owner.get('host')}, started {owner.get('started')}"
    return described + (f" (`{command}`)" if command else "")


def directory_user(directory: Path) -> str | None:
    """Who holds `directory`'s lock, described, if a live process (or one on another host) does; else None."""
    lock_file = Path(directory) / LOCK_NAME
    owner = _read_owner(lock_file, str(directory)) if lock_file.is_file() else None
    if owner is None or (owner.get("host") == socket.gethostname() and not _owner_alive(owner)):
        return None
    return _describe_owner(owner)


def missing_dirs(directory: Path) -> tuple[Path, ...]:
    """The folders that making `directory` would create, deepest first."""
    return tuple(p for p in (directory, *directory.parents) if not p.exists())


def lock_directory(directory: Path, fix: str, made_dirs: tuple[Path, ...] = ()) -> Lock:
    """hold_lock on `directory/.ppt.lock`."""
    directory = Path(directory)
    return hold_lock(directory / LOCK_NAME, str(directory), fix, made_dirs)


def hold_lock(lock_file: Path, what: str, fix: str, made_dirs: tuple[Path, ...] = ()) -> Lock:
    """Give this process sole use of `what` through `lock_file` until `release_locks()` or exit. A live owner on this
    host, or any owner on another host (whose liveness this host cannot see), stops this run with a PPTError naming the
    owner and `fix`; a dead one's lock is taken over with a warning. The file appears whole (hard-linked from temp).
    Released, it takes along those of `made_dirs` (the folders the run made) that the run left empty, as a refused
    run does."""
    lock_file, host, pid = Path(lock_file), socket.gethostname(), os.getpid()
    owner = {
        "pid": pid,
        "host": host,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": sys.argv,
        "process_start": _process_start(pid),
        "token": uuid.uuid4().hex,
    }
    tmp = temp_path(lock_file)
    try:
        lock_file.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(owner))
    except OSError as exc:
        raise PPTError(f"cannot write into {lock_file.parent} ({exc.strerror or exc}); {fix}") from exc
    try:
        for _ in range(3):  # a lock released, or a dead owner's lock moved away, between two looks: look again
            if _link(tmp, lock_file):
                break
            found = _read_owner(lock_file, what)
            if found is None:
                continue
            if found.get("host") != host:
                raise PPTError(
                    f"{what} is locked by {_describe_owner(found)}, another host, which this one cannot check; "
                    f"{fix}, or if that run has ended, delete {lock_file}"
                )
            if _owner_alive(found):
                raise PPTError(f"{what} is in use by another run: {_describe_owner(found)}; wait for it, or {fix}")
            moved = lock_file.with_name(f"{lock_file.name}.{pid}.stale")
            try:
                os.rename(lock_file, moved)
            except FileNotFoundError:
                continue
            if json.loads(moved.read_text()).get("token") != found.get("token"):
                _link(moved, lock_file)  # another run took the dead lock over first: its lock goes back
                moved.unlink()
                continue
            moved.unlink()
            warn0(f"{what} was locked by {_describe_owner(found)}, which is no longer running; taking it over")
        else:
            raise PPTError(f"could not lock {what}: other runs keep taking and releasing it; {fix}")
    finally:
        tmp.unlink(missing_ok=True)
    lock = Lock(lock_file, owner["token"], pid, made_dirs)
    if not _held_locks:
        atexit.register(release_locks)
    _held_locks.append(lock)
    return lock


def _link(source: Path, lock_file: Path) -> bool:
    """Create lock_file with source's content unless it exists; True when this call created it."""
    try:
        os.link(source, lock_file)
        return True
    except FileExistsError:
        return False
    except OSError as exc:  # a filesystem without hard links: exclusive create, then write
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
            raise
    try:
        fd = os.open(lock_file, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as f:
        f.write(source.read_bytes())
    return True


def release_locks(keep: int = 0) -> None:
    """Release the locks this process holds, but for the first `keep` it took (scripts call it when they finish; also
    run at exit). A caller that runs another script's main in-process releases only what that main took."""
    while len(_held_locks) > keep:
        _held_locks.pop().release()


def locks_held() -> int:
    """How many locks this process holds: what a caller passes to release_locks afterwards to keep its own."""
    return len(_held_locks)


def remove_leftovers(directory: Path, prefix: str = "") -> list[Path]:
    """Remove what killed processes of this host left in `directory` (of the files named `.<prefix>...`): a lock whose
    owner is dead, and a temp file of `atomic_file` whose writer is (a process killed mid-write never renames it). For
    folders that only finished or dead runs write into: a temp file names its writer's pid, not its host."""
    removed = []
    for path in Path(directory).glob(f".{prefix}*"):
        if path.name.endswith(".lock"):
            owner = _read_owner(path, str(directory))
            dead = owner is not None and owner.get("host") == socket.gethostname() and not _owner_alive(owner)
        else:
            pid = path.name.rsplit(".", 2)[-2] if path.name.endswith(".tmp") else ""
            dead = pid.isdigit() and not _owner_alive({"pid": pid})
        if dead:
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed
