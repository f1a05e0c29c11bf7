"""One run at a time per ``output_dir``: a lock file that the run's main process holds while it trains.

Two runs writing into one directory would interleave their ``metrics.jsonl`` rows and leave ``final/`` to whichever
saved last, and both would exit 0. So the launcher's main process (global rank 0; the other ranks wait at a barrier)
creates ``${output_dir}/.mtune.lock`` with ``O_CREAT | O_EXCL`` before it touches anything else there, and writes
into it who holds it: host, pid, the process's start time and when the run started. ``O_EXCL`` creation is atomic on
local file systems and on NFS v3+ and Lustre, where ``flock`` is not reliable.

A lock that exists is judged by what it says:

- held by this process (a second recipe run in one Python process): taken over;
- held on this host by a pid that no longer runs (or a pid reused by another process: its start time differs):
  stale, removed and taken, with one line saying so; a resume after ``kill -9`` needs no manual step;
- held on this host by a live process: refused with one line naming the directory and that process;
- held on another host: mtune cannot see that machine's processes, so it is refused too, unless
  ``force_unlock=true`` says the other run is known to be gone.

The lock is released when the recipe returns or raises (``mtune run`` releases it in ``finally``), on SIGTERM
before the training loop takes over that signal (the loop stops cleanly, saves, returns, and so releases it too), and
at interpreter exit. ``kill -9`` leaves the file behind; the next run finds its pid gone and takes it.

This module does not import torch.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from mtune.errors import MtuneError

__all__ = ["LOCK_FILENAME", "LockOwner", "OutputDirLock", "OutputDirLockedError", "lock_output_dir",
           "release_output_locks"]

log = logging.getLogger(__name__)

LOCK_FILENAME = ".mtune.lock"


class OutputDirLockedError(MtuneError, RuntimeError):
    """Another run holds the lock of this ``output_dir``; the message names the directory and that run."""


def _process_start(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot (``/proc/<pid>/stat`` field 22), or None where
    there is no ``/proc`` or no such process. Together with the pid it names one process, even after pid reuse."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: split after its closing parenthesis.
    fields = stat[stat.rfind(")") + 2:].split()
    return fields[19] if len(fields) > 19 else None


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


@dataclass(frozen=True)
class LockOwner:
    """Who holds a lock: written into the lock file as JSON."""

    host: str
    pid: int
    process_start: str | None  # /proc start time of pid (None where unknown)
    started: str  # when the run took the lock, local time
    command: str  # the command line, shortened

    @classmethod
    def this_process(cls) -> "LockOwner":
        command = " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv))
        return cls(host=socket.gethostname(), pid=os.getpid(), process_start=_process_start(os.getpid()),
                   started=time.strftime("%Y-%m-%d %H:%M:%S"), command=command[:200])

    @classmethod
    def read(cls, path: Path) -> "LockOwner | None":
        """The owner a lock file names, or None when it cannot be read (gone, empty, or not ours)."""
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            return cls(host=str(data["host"]), pid=int(data["pid"]), process_start=data.get("process_start"),
                       started=str(data.get("started", "?")), command=str(data.get("command", "")))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host}, started {self.started}" + (
            f" ({self.command})" if self.command else "")

    def is_this_process(self) -> bool:
        return self.host == socket.gethostname() and self.pid == os.getpid()

    def is_gone(self) -> bool:
        """True only when this host can tell the owner's process has ended: same host, and its pid is not running
        or now belongs to a process that started at another time."""
        if self.host != socket.gethostname():
            return False
        if not _pid_running(self.pid):
            return True
        now = _process_start(self.pid)
        return self.process_start is not None and now is not None and now != self.process_start


# An unreadable lock file younger than this may be one another process is writing at this moment.
_UNREADABLE_GRACE_S = 10.0


class OutputDirLock:
    """The lock of one ``output_dir``. :meth:`acquire` takes it or raises :class:`OutputDirLockedError`;
    :meth:`release` removes the file if it still names this process.

    Args:
        output_dir: the run's directory (created when absent).
        force: take a lock that another host holds (``force_unlock=true``).
    """

    def __init__(self, output_dir: str | os.PathLike, *, force: bool = False):
        self.output_dir = Path(output_dir)
        self.path = self.output_dir / LOCK_FILENAME
        self.force = force
        self.owner: LockOwner | None = None
        self._previous_sigterm = None

    def acquire(self) -> "OutputDirLock":
        self.output_dir.mkdir(parents=True, exist_ok=True)
        me = LockOwner.this_process()
        for _ in range(5):  # each pass either takes the lock, raises, or removes a stale one and tries again
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._judge_existing()
                continue
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(asdict(me), f)
                f.flush()
                os.fsync(f.fileno())
            self.owner = me
            _HELD[self.path] = self
            self._catch_sigterm()
            return self
        raise OutputDirLockedError(f"output_dir={self.output_dir}: could not take {self.path} (other runs keep "
                                   "taking it)", "start one run per output_dir")

    def _judge_existing(self) -> None:
        """Return when the existing lock was ours or stale and has been removed (the caller tries again); raise
        when another run holds it."""
        owner = LockOwner.read(self.path)
        if owner is None:
            try:
                age = time.time() - self.path.stat().st_mtime
            except FileNotFoundError:
                return  # released meanwhile
            if age < _UNREADABLE_GRACE_S:
                time.sleep(0.2)  # its writer is filling it in
                return
            self._break(f"an unreadable lock file {age:.0f} s old")
            return
        if owner.is_this_process():
            self._break(None)  # an earlier run in this process left it: ours to take
            return
        if owner.is_gone():
            self._break(f"a stale lock of {owner.describe()}, which is no longer running")
            return
        if owner.host != socket.gethostname():
            if self.force:
                self._break(f"the lock of {owner.describe()} (force_unlock=true)")
                return
            raise OutputDirLockedError(
                f"output_dir={self.output_dir} is locked by another run: {owner.describe()}; this host cannot tell "
                "whether it still runs",
                "wait for it, choose another output_dir, or, if that run is known to be gone, set force_unlock=true")
        raise OutputDirLockedError(
            f"output_dir={self.output_dir} is in use by another run: {owner.describe()}",
            "wait for it to finish (or stop it), or choose another output_dir")

    def _break(self, why: str | None) -> None:
        """Remove the lock file atomically: rename it to a unique name first, so that of two runs breaking the
        same stale lock only one succeeds, and neither removes a lock the other has just taken."""
        aside = self.path.with_name(f"{LOCK_FILENAME}.stale.{socket.gethostname()}.{os.getpid()}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        aside.unlink(missing_ok=True)
        if why:
            log.warning("output_dir %s: removed %s", self.output_dir, why)

    def release(self) -> None:
        """Remove the lock file if it still names this process; restore the SIGTERM handler it replaced."""
        if self.owner is None:
            return
        if LockOwner.read(self.path) == self.owner:
            self.path.unlink(missing_ok=True)
        self.owner = None
        _HELD.pop(self.path, None)
        self._restore_sigterm()

    # SIGTERM before the training loop installs its own graceful handler: release, then act as before.
    def _catch_sigterm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _restore_sigterm(self) -> None:
        if self._previous_sigterm is None or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
        self._previous_sigterm = None

    def _on_sigterm(self, signum, frame) -> None:
        previous = self._previous_sigterm
        self.release()
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:  # the default action: end the process as SIGTERM would have
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)


_HELD: dict[Path, OutputDirLock] = {}


def lock_output_dir(output_dir: str | os.PathLike, *, force: bool = False) -> OutputDirLock:
    """Take the lock of ``output_dir`` for this process (see the module docstring); raises
    :class:`OutputDirLockedError` naming the run that holds it."""
    return OutputDirLock(output_dir, force=force).acquire()


def release_output_locks() -> None:
    """Release every output-directory lock this process holds (``mtune run`` calls it when the recipe ends)."""
    for lock in list(_HELD.values()):
        lock.release()


atexit.register(release_output_locks)
