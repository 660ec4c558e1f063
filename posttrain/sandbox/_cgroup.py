"""Limits on a whole sandbox, all its processes together: a cgroup v2 of each execution's own, where
the host delegates one.

Rlimits cap each process of a sandbox (``memory_mb`` of address space each, ``RLIMIT_NPROC`` tasks per
uid); a cgroup caps them together, tmpfs files and kernel memory included. A cgroup v2 is delegated to
this process when its own cgroup offers the ``memory`` and ``pids`` controllers and this user may write
it (``systemd-run --user --scope -p Delegate=yes``, a container with a private, writable cgroup
namespace). Controllers reach only child cgroups, and a cgroup with processes in it cannot hand them on
(cgroup v2's "no internal processes" rule), so the first execution moves this process into a leaf child
of its cgroup, ``posttrain``, and enables the two controllers for children; where other processes share
the cgroup that fails, and the process moves back. Each execution then gets a child ``sandbox-<pid>-<n>``
with ``memory.max``, ``memory.swap.max`` 0, ``memory.oom.group`` 1 (an out-of-memory kill takes the whole
sandbox) and ``pids.max``; its first process waits on a pipe until the parent has moved it in, so
everything it starts is inside.

Where no cgroup is delegated (a cgroup v1 host, whose memory and pids controllers no v2 cgroup can
have; a cgroup this user may not write; a shared one), :func:`delegated` says why, and the sandbox runs
with its rlimits only.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

CONTROLLERS = ("memory", "pids")
LEAF = "posttrain"
"""The child of its own cgroup that this process moves into, so that its cgroup may enable controllers."""


@dataclass(frozen=True)
class Delegation:
    """Where executions get cgroups of their own, or why they do not."""

    parent: Path | None
    """The cgroup v2 directory whose children the executions get; None where there is none."""
    note: str
    """One sentence: the cgroup used, or why there is none and what bounds a sandbox instead."""


_delegation: list[Delegation] = []
_delegation_lock = threading.Lock()
_names = itertools.count()


def delegated() -> Delegation:
    """This process's delegation, found (and, where needed, this process moved into its leaf) once; where
    there is none, a warning says why, once."""
    with _delegation_lock:
        if not _delegation:
            _delegation.append(_find())
            if _delegation[0].parent is None:
                logger.warning("posttrain.sandbox: %s", _delegation[0].note)
        return _delegation[0]


def _find() -> Delegation:
    own = cgroup_dir(Path("/proc/self/cgroup").read_text(), Path("/proc/self/mountinfo").read_text())
    if isinstance(own, str):
        return _absent(own)
    offered = set((own / "cgroup.controllers").read_text().split())
    if not set(CONTROLLERS) <= offered:
        return _absent(f"this process's cgroup v2 ({own}) offers {' '.join(sorted(offered)) or 'no controller'}, "
                       "not memory and pids (they are cgroup v1's on this host, or not delegated)")
    if not os.access(own / "cgroup.subtree_control", os.W_OK) or not os.access(own, os.W_OK):
        return _absent(f"this process's cgroup v2 ({own}) is not writable by this user (not delegated)")
    try:
        _enable_for_children(own)
    except OSError as error:
        return _absent(f"this process's cgroup v2 ({own}) cannot give controllers to children ({error.strerror}: "
                       "other processes share it)")
    return Delegation(own, f"each execution runs in a cgroup v2 of its own under {own}: memory and tasks are "
                           "capped for the whole sandbox")


def _enable_for_children(own: Path) -> None:
    """Enable memory and pids for ``own``'s children, first moving this process into its leaf child where
    ``own`` may not have processes and children with controllers both; moved back if that fails."""
    enable = " ".join(f"+{name}" for name in CONTROLLERS)
    try:
        (own / "cgroup.subtree_control").write_text(enable)  # the hierarchy's root may
        return
    except OSError:
        pass
    (own / LEAF).mkdir(exist_ok=True)
    (own / LEAF / "cgroup.procs").write_text(str(os.getpid()))
    try:
        (own / "cgroup.subtree_control").write_text(enable)
    except OSError:
        (own / "cgroup.procs").write_text(str(os.getpid()))  # back where it was
        (own / LEAF).rmdir()
        raise


def cgroup_dir(proc_cgroup: str, mountinfo: str) -> Path | str:
    """A process's cgroup v2 directory, from its ``/proc/PID/cgroup`` and ``/proc/PID/mountinfo``; or why
    there is none."""
    paths = [line[len("0::"):] for line in proc_cgroup.splitlines() if line.startswith("0::")]
    if not paths:
        return "this host has no cgroup v2 hierarchy"
    for line in mountinfo.splitlines():
        fields = line.split()
        # ID PARENT MAJOR:MINOR ROOT MOUNT_POINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER_OPTIONS
        if fields[fields.index("-") + 1] == "cgroup2":
            relative = os.path.relpath(paths[0], fields[3])
            if not relative.startswith(".."):
                return Path(fields[4]) / relative
    return "no cgroup v2 mount holds this process's cgroup"


def _absent(reason: str) -> Delegation:
    return Delegation(None, f"no cgroup for the whole sandbox: {reason}; memory is capped per process "
                            "(memory_mb of address space each) and tasks by RLIMIT_NPROC")


@contextmanager
def execution(parent: Path, *, memory_bytes: int, tasks: int) -> Iterator[Path]:
    """A fresh child of ``parent`` capped at ``memory_bytes`` (no swap) and ``tasks``, removed (its
    processes killed) on exit."""
    path = parent / f"sandbox-{os.getpid()}-{next(_names)}"
    path.mkdir()
    try:
        (path / "memory.max").write_text(str(memory_bytes))
        if (path / "memory.swap.max").exists():  # absent where the kernel does not account swap
            (path / "memory.swap.max").write_text("0")
        (path / "memory.oom.group").write_text("1")
        (path / "pids.max").write_text(str(tasks))
        yield path
    finally:
        _remove(path)


def enter(path: Path, pid: int) -> None:
    """Move process ``pid`` (waiting to start the sandbox) into the execution's cgroup."""
    (path / "cgroup.procs").write_text(str(pid))


def out_of_memory(path: Path) -> bool:
    """Whether the kernel killed a process of the execution at its ``memory.max``."""
    events = dict(line.split() for line in (path / "memory.events").read_text().splitlines())
    return int(events.get("oom_kill", "0")) > 0


def _remove(path: Path) -> None:
    """Kill what is left in the cgroup and remove it (the kernel refuses while a process is in it)."""
    if (path / "cgroup.kill").exists():  # Linux 5.14+; the sandbox's pid namespace ends with it anyway
        (path / "cgroup.kill").write_text("1")
    for _ in range(100):
        try:
            path.rmdir()
            return
        except OSError:
            time.sleep(0.01)
    path.rmdir()
