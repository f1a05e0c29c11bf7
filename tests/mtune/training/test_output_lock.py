"""One run per output_dir: a second run is refused with one line naming the directory and the running process; a
lock whose process is gone (kill -9) is taken without a manual step; another host's lock needs force_unlock."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mtune._cli.main import main

from mtune.training.output_lock import LOCK_FILENAME, OutputDirLockedError, lock_output_dir


REPO = Path(__file__).resolve().parents[3]


def _write_lock(root, **fields):
    root.mkdir(parents=True, exist_ok=True)
    owner = {"host": os.uname().nodename, "pid": os.getpid(), "process_start": None,
             "started": "2026-01-01 00:00:00", "command": "mtune run lora_single_device"}
    owner.update(fields)
    (root / LOCK_FILENAME).write_text(json.dumps(owner))


@pytest.fixture
def other_process():
    """A live process that is not this one (the 'first run')."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def test_a_second_run_is_refused_naming_the_directory_and_the_running_process(tmp_path, other_process):
    _write_lock(tmp_path, pid=other_process.pid)
    with pytest.raises(OutputDirLockedError) as info:
        lock_output_dir(tmp_path)
    message = str(info.value)
    assert message.startswith(f"output_dir={tmp_path} is in use by another run: pid {other_process.pid} on host ")
    assert "mtune run lora_single_device" in message and "\n" not in message
    assert json.loads((tmp_path / LOCK_FILENAME).read_text())["pid"] == other_process.pid  # left alone


def test_the_lock_of_a_killed_run_is_stale_and_taken(tmp_path, other_process):
    _write_lock(tmp_path, pid=other_process.pid)
    other_process.send_signal(signal.SIGKILL)
    other_process.wait()
    lock = lock_output_dir(tmp_path)
    assert json.loads((tmp_path / LOCK_FILENAME).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / LOCK_FILENAME).exists()


def test_a_reused_pid_does_not_keep_a_stale_lock(tmp_path, other_process):
    """The lock names a pid that runs now, but with another start time than the one it recorded (the pid was
    reused by an unrelated process after the run died): stale, taken. With the recorded start time equal to the
    live process's (read here from /proc's field 22), the same pid holds the lock.

    Mutation checked: ``LockOwner.is_gone`` without the start-time comparison (``return False`` once the pid runs)
    fails the first half; comparing nothing (``return True``) fails the second."""
    stat = Path(f"/proc/{other_process.pid}/stat").read_text()
    start = stat[stat.rfind(")") + 2:].split()[19]
    _write_lock(tmp_path, pid=other_process.pid, process_start=str(int(start) + 1))  # an earlier process's start
    lock = lock_output_dir(tmp_path)
    assert json.loads((tmp_path / LOCK_FILENAME).read_text())["pid"] == os.getpid()
    lock.release()
    _write_lock(tmp_path, pid=other_process.pid, process_start=start)
    with pytest.raises(OutputDirLockedError):
        lock_output_dir(tmp_path)


def test_another_hosts_lock_is_refused_unless_forced(tmp_path):
    _write_lock(tmp_path, host="node-that-is-not-this-one", pid=1)
    with pytest.raises(OutputDirLockedError) as info:
        lock_output_dir(tmp_path)
    assert "on host node-that-is-not-this-one" in str(info.value) and "force_unlock=true" in info.value.hint
    lock = lock_output_dir(tmp_path, force=True)
    assert json.loads((tmp_path / LOCK_FILENAME).read_text())["host"] == os.uname().nodename
    lock.release()


def test_sigterm_releases_the_lock(tmp_path):
    """A run killed by SIGTERM before its training loop starts leaves no lock behind (and still dies of SIGTERM)."""
    code = ("import sys, time; from mtune.training.output_lock import lock_output_dir; "
            f"lock_output_dir({str(tmp_path)!r}); print('locked', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline().strip() == "locked"
    assert (tmp_path / LOCK_FILENAME).exists()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM
    assert not (tmp_path / LOCK_FILENAME).exists()


def test_mtune_run_refuses_a_locked_output_dir_in_one_line(capsys, tmp_path, other_process):
    _write_lock(tmp_path, pid=other_process.pid)
    code = main(["run", "lora_single_device", "--config", "tiny/lora_single_device", f"output_dir={tmp_path}",
                 "device=cpu"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert f"error: output_dir={tmp_path} is in use by another run: pid {other_process.pid} on host" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_FILENAME]  # nothing else written


def test_a_lock_this_process_left_is_taken_and_release_restores_sigterm(tmp_path):
    """A lock naming this very process (an earlier run in it) is taken, not refused; releasing puts back the SIGTERM
    handler that was there before. Mutations checked: this process's own lock refused; the handler not restored."""
    def before(signum, frame):
        pass

    previous = signal.signal(signal.SIGTERM, before)
    try:
        _write_lock(tmp_path)  # this host, this pid
        lock = lock_output_dir(tmp_path)
        assert signal.getsignal(signal.SIGTERM) is not before  # the lock's own, until released
        lock.release()
        assert signal.getsignal(signal.SIGTERM) is before
        assert not (tmp_path / LOCK_FILENAME).exists()
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_an_unreadable_lock_past_its_grace_is_broken_and_taken(tmp_path, caplog):
    """A lock file cut short (its writer killed mid-write) is taken once it is older than the writer's grace
    (_UNREADABLE_GRACE_S, 10 s), with a warning naming it; before that the writer may still be filling it in."""
    lock_file = tmp_path / LOCK_FILENAME
    lock_file.write_text('{"pid": 12')  # cut short
    old = lock_file.stat().st_mtime - 11
    os.utime(lock_file, (old, old))
    lock = lock_output_dir(tmp_path)
    assert json.loads(lock_file.read_text())["pid"] == os.getpid()
    lock.release()
    assert "an unreadable lock file 11 s old" in caplog.text
