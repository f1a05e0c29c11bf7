"""What `mtune run --nproc_per_node N` says when a rank dies: one summary after torchrun exits, instead of leaving
the user to read its wall of tracebacks.

Two records make it. torchrun's agent runs in ``python -m mtune._cli.rank_failures REPORT_DIR torchrun-args...``,
which writes, when workers fail, each failed rank's exit code or signal into ``REPORT_DIR/agent_<pid>.json``
(torchrun's own error table is left out). Each worker (``mtune._cli.launch_recipe``) writes the exception that ends
it, if any, into ``REPORT_DIR/rank_<r>.json``; a rank that was killed writes nothing. The summary names the rank that
died first and how (a signal, an error such as running out of memory, or an exit status) and what to do: for an
mtune error (bad data, a config or checkpoint the run cannot use) its own hint, since resuming or running again
would meet it again; for anything else the latest complete checkpoint in ``output_dir`` and the command that resumes
from it. A worker launched so leaves the printing of an mtune error, and of a broken collective (its peer died
first), to the summary: each rank printing the same line was noise.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["FAILURES_DIR_VARIABLE", "record_rank_failure", "summary"]

FAILURES_DIR_VARIABLE = "MTUNE_FAILURES_DIR"
"""The environment variable naming the directory where the agent and the workers record failures."""

# A worker that fails because another one died sees its collective break: not the cause.
_PEER_LOST = ("connection closed by peer", "connection reset", "broken pipe", "timed out", "nccl", "gloo",
              "socket", "watchdog")


def record_rank_failure(err: BaseException) -> bool:
    """In a worker: write the exception ending it into the failures directory (when mtune launched it). True when
    the summary will report it (an mtune error or a broken collective), so the worker need not print it."""
    from mtune.errors import MtuneError

    where, rank = os.environ.get(FAILURES_DIR_VARIABLE), os.environ.get("RANK")
    if not where or rank is None or isinstance(err, SystemExit):
        return False
    text = str(err).splitlines()[0] if str(err) else ""
    user_error = isinstance(err, MtuneError)
    record = {"type": type(err).__name__, "message": text, "time": time.time(), "pid": os.getpid(),
              "user_error": user_error, "hint": err.hint if user_error else None}
    Path(where, f"rank_{rank}.json").write_text(json.dumps(record))
    return user_error or _lost_peer(text)


def _lost_peer(message: str) -> bool:
    return any(word in message.lower() for word in _PEER_LOST)


def _how(failure: dict[str, Any], error: dict[str, Any] | None) -> str:
    code = failure["exitcode"]
    if code < 0:
        name = failure.get("signal") or f"signal {-code}"
        how = f"was killed by {name} (signal {-code})"
        if -code == signal.SIGKILL:
            how += ": kill -9, or the kernel's out-of-memory killer (`dmesg | grep -i oom` tells which)"
        return how
    if error is not None:
        oom = error["type"] in ("OutOfMemory", "OutOfMemoryError", "MemoryError") or "out of memory" in \
            error["message"].lower()
        if oom:
            return f"ran out of memory: {error['message']}"
        return f"stopped: {error['message']}" if error.get("user_error") else \
            f"stopped with {error['type']}: {error['message']}"
    return f"exited with status {code}"


def _first(failures: list[dict[str, Any]], errors: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The failure that started it, in this order: a rank killed by a signal other than SIGTERM, an error that is
    not a lost peer, a rank killed by SIGTERM, a lost peer; the earliest within each.

    torchrun stops the ranks still running with SIGTERM once one fails and records them as failed too, stamped to
    the second: a SIGTERM is most often its own doing, so it never outranks a kill or an error."""

    def cause_rank(f: dict[str, Any]) -> tuple:
        error = errors.get(f["rank"])
        if f["exitcode"] < 0:
            kind = 2 if -f["exitcode"] == signal.SIGTERM else 0
        else:
            kind = 3 if error is not None and _lost_peer(error["message"]) else 1
        return (kind, error["time"] if error else f["timestamp"], f["rank"])

    return min(failures, key=cause_rank)


def summary(report_dir: Path, *, output_dir: str | None, command: list[str]) -> list[str] | None:
    """The lines to print after torchrun failed: ``error: ...`` and ``hint: ...``; None when the agent recorded no
    failed rank (torchrun itself failed: its own message says why)."""
    failures = [f for path in sorted(report_dir.glob("agent_*.json")) for f in json.loads(path.read_text())]
    if not failures:
        return None
    errors = {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in report_dir.glob("rank_*.json")}
    first = _first(failures, errors)
    others = len({f["rank"] for f in failures}) - 1
    error = errors.get(first["rank"])
    line = f"error: rank {first['rank']} (pid {first['pid']}) {_how(first, error)}"
    line += "; the other ranks were stopped" + (f" ({others} of them failed after it)" if others else "")
    if error is not None and error.get("user_error"):  # the same command would meet it again: the error's own advice
        return [line] + ([f"hint: {error['hint']}"] if error.get("hint") else [])
    resume = [arg for arg in command if not arg.startswith("resume_from_checkpoint=")] + ["resume_from_checkpoint=true"]
    latest = _latest_checkpoint(output_dir)
    if latest is None:
        hint = f"no checkpoint was saved yet in {output_dir}: run the same command again to start over"
    else:
        hint = f"the latest complete checkpoint is {latest}; resume from it: {shlex.join(resume)}"
    return [line, f"hint: {hint}"]


def _latest_checkpoint(output_dir: str | None) -> Path | None:
    if not output_dir or not Path(output_dir).is_dir():
        return None
    from mtune.training.checkpointing.checkpoint_dir import find_latest_checkpoint

    try:
        return find_latest_checkpoint(output_dir, clean=False)
    except Exception:  # a damaged mtune_state.json: the resume itself names it
        return None


def _agent(argv: list[str]) -> int:
    """torchrun's agent (``torch.distributed.run``) with ``argv``; on failed workers, their records into
    ``report_dir`` and exit status 1."""
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # torchrun's lines about the failed worker and the SIGTERM it sends the others: the summary says both
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(
        lambda record: not record.getMessage().startswith(("failed (exitcode", "Sending process")))
    report_dir, args = Path(argv[0]), argv[1:]
    try:
        run(parse_args(args))
    except ChildFailedError as err:
        records = [{"rank": int(rank), "local_rank": f.local_rank, "pid": f.pid, "exitcode": f.exitcode,
                    "signal": f.signal_name() if f.exitcode < 0 else None, "timestamp": f.timestamp}
                   for rank, f in err.failures.items()]
        (report_dir / f"agent_{os.getpid()}.json").write_text(json.dumps(records))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_agent(sys.argv[1:]))
