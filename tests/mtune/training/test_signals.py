import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mtune.training.signals import GracefulStop

REPO_ROOT = Path(__file__).resolve().parents[3]

# Announces itself, then runs "steps" until a stop is requested; after the request it finishes the step in progress
# and "saves", then exits normally.
TRAIN_SCRIPT = textwrap.dedent("""
    import sys, time
    from mtune.training.signals import GracefulStop
    with GracefulStop() as stop:
        print("ready", flush=True)
        step = 0
        while not stop.requested:
            step += 1
            time.sleep(0.05)  # the work of one step
        print(f"stopped after step {step} on {stop.received.name}; saved", flush=True)
    sys.exit(0)
""")


def _start():
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.Popen([sys.executable, "-c", TRAIN_SCRIPT], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_first_signal_lets_the_step_finish_and_exit_zero(sig):
    proc = _start()
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert out.startswith("stopped after step ") and out.strip().endswith(f"on {sig.name}; saved")
    assert f"Received {sig.name}: finishing the current step" in err


def test_second_sigint_interrupts_and_handlers_are_restored():
    previous = signal.getsignal(signal.SIGINT)
    with GracefulStop() as stop:
        assert signal.getsignal(signal.SIGINT) == stop._handle
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested and stop.received == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGTERM)  # repeated SIGTERM: still just stopping
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested_on_any_rank()  # no process group: the local flag
    assert signal.getsignal(signal.SIGINT) is previous


def test_a_first_signal_drops_an_evaluation_of_one_process_and_lets_ranks_finish_it():
    """Ctrl-C during a minute's task eval used to wait for it, then train a step, then save. In one process the
    evaluation now stops at once; ranks of a distributed run must leave its collectives together, so they finish
    it; a signal that came before it stops it at its start."""
    from mtune.training.signals import StopDuringEvaluation

    with GracefulStop() as stop:
        with pytest.raises(StopDuringEvaluation):
            with stop.interrupting("task eval before training"):
                os.kill(os.getpid(), signal.SIGINT)
                pytest.fail("the evaluation went on")
        assert stop.requested and stop.received == signal.SIGINT and stop._droppable is None
        with pytest.raises(StopDuringEvaluation):  # already stopping: the next evaluation does not start
            with stop.interrupting("val_loss"):
                pytest.fail("the evaluation started")
    with GracefulStop(world_size=2) as stop:
        with stop.interrupting("val_loss"):
            os.kill(os.getpid(), signal.SIGTERM)
            finished = True
        assert finished and stop.requested
