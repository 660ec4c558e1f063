"""A run as a cluster runs it: requeued, preempted, sharing a file system with other jobs.

- **Requeue-safe resume.** A scheduler that requeues a preempted job runs the same command line again.
  ``auto_resume`` resumes when ``--output`` holds a run with a checkpoint and starts one there
  otherwise (:func:`resume_dir`); resuming a run that already reached ``max_steps`` is not an error but
  a finished job: it says so and exits 0 (:func:`completed_run`), before any model loads.
- **Preemption.** A scheduler stops a job with SIGTERM and, after a grace period, SIGKILL; a person
  with Ctrl-C (SIGINT). :class:`StopSignals` turns the first of either into a request the loop reads
  between optimizer steps: the step in progress finishes, a checkpoint is written, and the run raises
  :class:`Preempted`, which the command line turns into exit status 75 (``EX_TEMPFAIL``: stopped early,
  resume to go on), distinct from 0 (finished), 1 (a crash) and 2 (a problem with the input). A second
  signal stops the process at once. With several processes the request is all-reduced, so every
  process stops after, and checkpoints, the same step.
- **One run per directory.** :class:`RunLock` holds an exclusive ``flock`` on ``RUN_DIR/.lock`` for
  the run's life. The kernel releases it when the process ends, however it ends (``kill -9``
  included), so a killed run never leaves a directory locked; the file names the holder (pid, host,
  start time) for the error a second run gets. ``flock`` is per host on some network file systems
  (NFS without lock support): there the lock protects against runs of the same host only.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import time
from pathlib import Path
from types import FrameType
from typing import Any

from posttrain.parallel import distributed
from posttrain.training.checkpoint import FINAL_MODEL_DIR, checkpoint_step, latest_checkpoint

PREEMPTED_EXIT_CODE = 75
"""Exit status of a run stopped by SIGTERM or SIGINT after checkpointing (sysexits' EX_TEMPFAIL)."""

LOCK_FILE = ".lock"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(Exception):
    """The run stopped at a signal after writing the checkpoint of ``step``; resume it to go on."""

    def __init__(self, signal_name: str, step: int, run_dir: Path):
        self.signal_name, self.step, self.run_dir = signal_name, step, run_dir
        super().__init__(f"{signal_name}: stopped after step {step} and saved its checkpoint; resume with "
                         f"--resume {run_dir} (or the same command with --auto-resume)")


class RunLocked(FileExistsError):
    """Another live process holds the run directory's lock."""


def resume_dir(run: Any) -> Path | None:
    """The run directory this run continues: ``resume``, or with ``auto_resume`` the ``output`` directory
    when it holds a complete checkpoint; None for a new run. ``run``: the config's run section."""
    if run.resume:
        return Path(run.resume)
    if run.auto_resume and run.output and latest_checkpoint(run.output) is not None:
        return Path(run.output)
    return None


def completed_run(run: Any) -> tuple[Path, int] | None:
    """``(run_dir, step)`` when the run this config resumes already reached ``max_steps`` and saved its final
    model: nothing is left to train, and a requeued job should end as the first one did."""
    run_dir = resume_dir(run)
    if run_dir is None or not (run_dir / FINAL_MODEL_DIR).is_dir():
        return None
    checkpoint = latest_checkpoint(run_dir)
    step = checkpoint_step(checkpoint) if checkpoint is not None else -1
    return (run_dir, step) if step >= run.max_steps else None


class RunLock:
    """An exclusive lock on a run directory for one process's lifetime (see the module docstring)."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_FILE
        self.fd: int | None = None

    def acquire(self) -> RunLock:
        """Take the lock, or raise :class:`RunLocked` naming the process that holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise RunLocked(
                f"output: {self.path.parent} is in use by another run ({holder}); two runs writing one "
                "directory would mix their checkpoints and logs. Wait for it to end, or use another --output "
                "(the lock goes with the process that holds it, however it ends)") from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode())
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor releases the flock
            self.fd = None


def _read_holder(fd: int) -> str:
    try:
        holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {holder['pid']} on {holder['host']}, started {holder['started']}"
    except (ValueError, KeyError, OSError):
        return "a process that has not written its name yet"


class StopSignals:
    """SIGTERM and SIGINT as a stop request the training loop reads between steps; a second signal stops the
    process at once. Installed for the ``with`` block (main thread only: elsewhere Python cannot install
    handlers, and the signals keep their default action), the previous handlers restored after."""

    def __init__(self) -> None:
        self.received: str | None = None
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        try:
            for number in STOP_SIGNALS:
                self.previous[number] = signal.signal(number, self._handle)
        except ValueError:  # not the main thread
            self.__exit__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for number, handler in self.previous.items():
            signal.signal(number, handler)
        self.previous = {}

    def _handle(self, number: int, frame: FrameType | None) -> None:
        name = signal.Signals(number).name
        if self.received is not None:  # the second signal: no more grace
            self.__exit__()
            if number == signal.SIGINT:
                raise KeyboardInterrupt
            signal.signal(number, signal.SIG_DFL)
            os.kill(os.getpid(), number)
            return
        self.received = name
        distributed.say(f"{name}: finishing the current step, then writing a checkpoint and stopping "
                        "(send it again to stop at once)")
