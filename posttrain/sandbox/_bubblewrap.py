"""The sandbox: bubblewrap (namespaces, a minimal read-only root, a seccomp filter) inside prlimit (resource limits).

One execution is ``prlimit --cpu --as --fsize --nproc --nofile -- bwrap ... python -I /sandbox/main.py``:
prlimit sets the rlimits and execs bwrap, which builds the sandbox, closes user namespaces to it
(``--disable-userns``), loads the seccomp filter (:mod:`posttrain.sandbox._seccomp`, read from a file
descriptor) and runs the program. The program's stdout and stderr go to files the parent opened, so
``RLIMIT_FSIZE`` caps them (a pipe has no such cap, and a program printing gigabytes would fill the
parent's memory before the wall clock stopped it). The parent kills the process group at the wall-clock
limit; the pid namespace takes every process in the sandbox with it. prlimit and bwrap start with an
empty environment: bwrap's init is the sandbox's pid 1, and its ``/proc/1/environ`` is readable from inside.

Processes are limited with ``RLIMIT_NPROC``, which counts every task of a uid. Under root, each
concurrent execution therefore runs as a uid of its own (from the process's pid and a slot), so the limit
counts that execution's tasks only; otherwise it runs as the user, and the limit is the user's current
task count plus the execution's allowance. Where the host delegates a cgroup v2
(:mod:`posttrain.sandbox._cgroup`), the execution's own cgroup also caps its memory and tasks together.

The host directory holding an execution's code, stdin and outputs is 0700 and owned by the execution's
uid: another execution's uid cannot list or read it.
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.sandbox import _cgroup, _seccomp

LIMITS = ("wall_time", "cpu_time", "memory", "processes", "output", "disk")
"""The names ``SandboxResult.limit`` takes when a limit stopped (or, for output, truncated) a program."""

UID_BASE = 2_000_000_000
"""Under root, execution slot k of process p runs as uid and gid ``UID_BASE + SLOTS * p + k``: far above any
account's, and distinct between processes (two training processes must not share a process count)."""
SLOTS = 256
MAX_PID = 2**22
"""Linux's largest pid_max: the uids stay below 2**32."""
BWRAP_TASKS = 2
"""Tasks bubblewrap itself holds during an execution (measured with bubblewrap 0.8: the outer bwrap and the
pid namespace's init), added to ``max_processes`` in ``RLIMIT_NPROC`` and the cgroup's ``pids.max``. (When an
execution ends, its init can linger as a zombie until the machine's pid 1 reaps it; under root its uid is
not reused before 255 other executions, and otherwise it is among the user's tasks counted at the start.)"""
OPEN_FILES = 256
"""Open files of each process of the sandbox (``RLIMIT_NOFILE``)."""
SANDBOX_PATH = "/usr/bin:/bin"
CGROUP_GATE = 'read -r _ && exec "$@" <"$0"'
"""``sh -c`` script an execution with a cgroup starts as: it waits for a line on stdin (the parent sends it once
the process is in the cgroup), then execs the command with the program's stdin file (``$0``) as stdin."""
SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
"""What of the host's root the sandbox sees, read-only (besides ``/etc/ld.so.cache`` and the interpreter's prefix)."""
INSTALL_HINT = ("install bubblewrap: sudo apt-get install bubblewrap (Debian, Ubuntu), sudo dnf install bubblewrap "
                "(Fedora), or run scripts/setup.sh")
NAMESPACE_HINT = ("bubblewrap could not create its namespaces: allow unprivileged user namespaces (sysctl -w "
                  "kernel.unprivileged_userns_clone=1 on Debian; on Ubuntu 24.04 an AppArmor profile granting userns "
                  "to /usr/bin/bwrap); in a container, grant bubblewrap's own calls, never --privileged or unconfined "
                  "(docs/guides/code-execution.md, 'Where bubblewrap cannot start')")


class SandboxUnavailable(RuntimeError):
    """This machine cannot sandbox (no bubblewrap, or namespaces refused); the message says how to fix it."""


@dataclass(frozen=True)
class SandboxResult:
    """What one execution did. Never raised: a program that crashed, hung or misbehaved is data."""

    stdout: str
    stderr: str
    returncode: int | None
    """The program's exit status; ``-N`` when signal N ended it; None when the wall clock did."""
    limit: str | None
    """Which of :data:`LIMITS` stopped it (``output``: its output was cut at the cap), or None."""
    wall_seconds: float
    cgroup: bool
    """Whether a cgroup v2 of its own capped the memory and tasks of all its processes together. False where the
    host delegates none (the log's warning says why): then each process's address space is capped
    (``memory_mb``, so ``memory_mb x max_processes`` in all) and its tasks by ``RLIMIT_NPROC``."""

    @property
    def ok(self) -> bool:
        """It ran to a zero exit status within every limit."""
        return self.returncode == 0 and self.limit is None


def run(source: str, *, stdin: str = "", timeout_s: float = 10.0, cpu_time_s: float | None = None,
        memory_mb: int = 512, max_processes: int = 8, max_output_bytes: int = 1_000_000, disk_mb: int = 64,
        files: Mapping[str, str] | None = None, args: Sequence[str] = (), python: str | None = None) -> SandboxResult:
    """Run the Python program ``source`` in a fresh sandbox (see :mod:`posttrain.sandbox`).

    Args:
        source: the program, run as ``python -E -s /sandbox/main.py ARGS`` with ``/tmp`` as its directory.
        stdin: its standard input.
        timeout_s: wall-clock limit in seconds; the whole sandbox is killed at it.
        cpu_time_s: CPU-time limit of each of its processes (``RLIMIT_CPU``), whole seconds, at least 1;
            default ``timeout_s`` (the wall clock bounds them all together).
        memory_mb: address-space limit of each of its processes (``RLIMIT_AS``): the program's memory is at
            most ``memory_mb x max_processes``.
        max_processes: processes and threads it may have at once, itself included.
        max_output_bytes: cap on stdout and on stderr each, and on any file it writes.
        disk_mb: size of its private ``/tmp``, and of its ``/dev/shm`` (the rest of ``/dev`` is read-only).
        files: more read-only files beside ``main.py`` in ``/sandbox`` (name -> text), e.g. a module
            to import or data to read.
        args: its command-line arguments.
        python: the interpreter; default the system's (``/usr/bin/python3``), whose standard library is
            all the program sees.
    """
    _check_limits(timeout_s=timeout_s, cpu_time_s=cpu_time_s, memory_mb=memory_mb, max_processes=max_processes,
                  max_output_bytes=max_output_bytes, disk_mb=disk_mb)
    for name in files or {}:
        if name == "main.py" or "/" in name or name in ("", ".", ".."):
            raise ValueError(f"files: {name!r} is not a plain file name other than main.py")
    interpreter = python or default_python()
    check_available(interpreter)
    tools = _tools()
    cpu_limit = max(1, round(cpu_time_s if cpu_time_s is not None else timeout_s))
    tasks = max_processes + BWRAP_TASKS
    # the cgroup holds its tmpfs files too (/tmp and /dev/shm), which disk_mb caps apart
    cgroup_memory = (memory_mb + 2 * disk_mb) * 2**20
    with (_execution_uid() as uid, _work_dir(uid, {"main.py": source, **(files or {})}, stdin) as host_dir,
          _execution_cgroup(memory_bytes=cgroup_memory, tasks=tasks) as cgroup, _seccomp_fd() as seccomp_fd):
        processes = tasks + (0 if uid is not None else _tasks_of(os.getuid()))
        command = [tools["prlimit"], f"--cpu={cpu_limit}:{cpu_limit + 1}", f"--as={memory_mb * 2**20}",
                   f"--fsize={max_output_bytes}", f"--nproc={processes}", f"--nofile={OPEN_FILES}", "--core=0", "--",
                   *_bwrap_command(tools["bwrap"], interpreter, host_dir / "code", disk_mb, seccomp_fd),
                   *_python(interpreter), *args]
        out_path, err_path = host_dir / "stdout", host_dir / "stderr"
        with open(host_dir / "stdin", "rb") as fin, open(out_path, "wb") as fout, open(err_path, "wb") as ferr:
            status, wall_seconds = _run_until(command, fin, fout, ferr, uid, timeout_s, seccomp_fd, cgroup)
        stdout, stderr = _read(out_path, max_output_bytes), _read(err_path, max_output_bytes)
        capped = max(out_path.stat().st_size, err_path.stat().st_size) >= max_output_bytes
        out_of_memory = cgroup is not None and _cgroup.out_of_memory(cgroup)
    returncode = None if status is None else _program_status(status)
    limit = "memory" if out_of_memory and status is not None else _classify(
        returncode, stderr, capped=capped, wall_seconds=wall_seconds, cpu_limit=cpu_limit)
    return SandboxResult(stdout, stderr, returncode, limit, wall_seconds, cgroup is not None)


def run_many(programs: Sequence[str | Mapping[str, Any]], *, max_workers: int | None = None,
             **limits: Any) -> list[SandboxResult]:
    """:func:`run` on each program, ``max_workers`` at a time (default: one per CPU core), in order.

    A program is a source string or a mapping of :func:`run`'s per-program arguments (``source``,
    ``stdin``, ``files``, ``args``); ``limits`` are :func:`run`'s other keyword arguments, shared.
    """
    jobs = [{"source": p} if isinstance(p, str) else dict(p) for p in programs]
    if not jobs:
        return []
    check_available(limits.get("python") or default_python())
    workers = max(1, min(max_workers or os.cpu_count() or 1, len(jobs)))
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda job: run(**job, **limits), jobs))


def default_python() -> str:
    """The system's Python 3, whose standard library the program gets (a project's virtual environment
    would hand it the project's packages, and often lives where the sandbox's uid cannot read)."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("python3")
    if found is None:
        raise SandboxUnavailable("no python3 to run sandboxed programs with; pass python=PATH")
    return found


_available: dict[str, None] = {}
_available_lock = threading.Lock()


def check_available(python: str | None = None) -> None:
    """Raise :class:`SandboxUnavailable` (with the fix) unless a trivial program runs in the sandbox.
    Checked once per interpreter and process."""
    interpreter = python or default_python()
    with _available_lock:
        if interpreter in _available:
            return
        tools = _tools()
        try:
            _seccomp.program()
        except (ImportError, RuntimeError, OSError) as error:  # pyseccomp raises RuntimeError without libseccomp
            raise SandboxUnavailable(f"no seccomp filter ({error}): {_seccomp.INSTALL_HINT}") from None
        with (_execution_uid() as uid, _work_dir(uid, {"main.py": "print('ok')\n"}, "") as host_dir,
              _seccomp_fd() as seccomp_fd):
            command = [*_bwrap_command(tools["bwrap"], interpreter, host_dir / "code", 1, seccomp_fd),
                       *_python(interpreter)]
            done = subprocess.run(command, capture_output=True, text=True, timeout=60, user=uid, group=uid,
                                  extra_groups=[] if uid is not None else None, env={}, pass_fds=(seccomp_fd,))
        if "Unknown option --disable-userns" in done.stderr:  # bubblewrap before 0.8
            raise SandboxUnavailable(f"bubblewrap 0.8 or newer is needed (for --disable-userns; Debian 12 ships 0.8, "
                                     f"Ubuntu 24.04 0.9): {done.stderr.strip()[-200:]!r}; {INSTALL_HINT}")
        if done.returncode != 0 or done.stdout != "ok\n":
            raise SandboxUnavailable(f"the sandbox does not start here (bwrap exit {done.returncode}: "
                                     f"{done.stderr.strip()[-400:]!r}); {NAMESPACE_HINT}")
        _cgroup.delegated()  # found now, so that its warning (where there is none) comes before any program
        _available[interpreter] = None


# --------------------------------------------------------------------------------------------


def _tools() -> dict[str, str]:
    """Absolute paths of bwrap and prlimit (they run with an empty environment, so without PATH)."""
    found = {name: shutil.which(name) for name in ("bwrap", "prlimit")}
    missing = [name for name, path in found.items() if path is None]
    if missing:
        raise SandboxUnavailable(f"{' and '.join(missing)} not on PATH (prlimit is util-linux's); {INSTALL_HINT}")
    return found  # type: ignore[return-value]


def _python(interpreter: str) -> list[str]:
    """The program's command: no PYTHON* variables, no user site, and /sandbox on sys.path (for ``files``)."""
    return [interpreter, "-E", "-s", "/sandbox/main.py"]


def _bwrap_command(bwrap: str, interpreter: str, code_dir: Path, disk_mb: int, seccomp_fd: int) -> list[str]:
    """bwrap's arguments: new namespaces of every kind and none for the program to make, the seccomp filter,
    a read-only root with /usr (and the interpreter's prefix), fresh /proc, /dev and a private writable
    /tmp, the code read-only in /sandbox, and nothing of the parent's environment."""
    command = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
               "--cap-drop", "ALL", "--seccomp", str(seccomp_fd), "--clearenv", "--setenv", "PATH", SANDBOX_PATH,
               "--setenv", "HOME", "/tmp", "--hostname", "sandbox"]
    for name in SYSTEM_DIRS:
        path = Path("/") / name
        if path.is_symlink():  # merged /usr: /lib -> usr/lib
            command += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            command += ["--ro-bind", str(path), str(path)]
    if Path("/etc/ld.so.cache").exists():  # the dynamic linker's index of /usr/lib; nothing else of /etc
        command += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    prefix = _prefix(interpreter)
    if prefix is not None:
        command += ["--ro-bind", str(prefix), str(prefix)]
    size = str(disk_mb * 2**20)
    # /dev is a tmpfs of its own: read-only but for a sized /dev/shm, or files there would fill the host's memory
    return command + ["--proc", "/proc", "--dev", "/dev", "--size", size, "--tmpfs", "/dev/shm", "--remount-ro", "/dev",
                      "--size", size, "--tmpfs", "/tmp", "--ro-bind", str(code_dir), "/sandbox", "--remount-ro", "/",
                      "--chdir", "/tmp"]


def _prefix(interpreter: str) -> Path | None:
    """The interpreter's installation (its binary's directory's parent) to bind, where the system directories
    do not hold it already. Never ``/`` or another whole top-level directory of the host (``/root``, ``/home``):
    an interpreter whose prefix is one cannot run in the sandbox."""
    binary = Path(os.path.realpath(interpreter))
    prefix = binary.parent.parent
    if binary.parts[1] in SYSTEM_DIRS:  # /usr/bin/python3, /usr/local/bin/python3, /bin/python3
        return None
    if len(prefix.parts) < 3:
        raise SandboxUnavailable(f"python={interpreter}: its prefix would be {prefix}, which the sandbox does not "
                                 "bind (a whole top-level directory of the host); use an interpreter installed "
                                 "under /usr or a prefix of its own (/opt/python3.12)")
    return prefix


@contextmanager
def _work_dir(uid: int | None, files: Mapping[str, str], stdin: str) -> Iterator[Path]:
    """A host directory for one execution, 0700 and the execution uid's: ``code/`` (its files, bound read-only
    in /sandbox), ``stdin``, and the ``stdout`` and ``stderr`` the parent writes."""
    with tempfile.TemporaryDirectory(prefix="posttrain-sandbox-") as host:  # made 0700, this process's
        host_dir = Path(host)
        code_dir = host_dir / "code"
        code_dir.mkdir()
        (host_dir / "stdin").write_text(stdin)
        for name, text in files.items():
            (code_dir / name).write_text(text)
        for path in (code_dir, *code_dir.iterdir(), host_dir / "stdin"):  # whatever the umask
            path.chmod(0o755 if path.is_dir() else 0o644)
        if uid is not None:  # bwrap runs as the execution's uid and binds code/ as that uid
            os.chown(host_dir, uid, uid)
        yield host_dir


@contextmanager
def _execution_cgroup(*, memory_bytes: int, tasks: int) -> Iterator[Path | None]:
    """The execution's own cgroup where the host delegates one (see :mod:`posttrain.sandbox._cgroup`), else None."""
    parent = _cgroup.delegated().parent
    if parent is None:
        yield None
        return
    with _cgroup.execution(parent, memory_bytes=memory_bytes, tasks=tasks) as path:
        yield path


@contextmanager
def _seccomp_fd() -> Iterator[int]:
    """A file descriptor holding the seccomp filter, for one bwrap; closed on exit."""
    fd = _seccomp.file_descriptor()
    try:
        yield fd
    finally:
        os.close(fd)


_slots: queue.Queue[int] = queue.Queue()
_slots_pid: list[int] = []  # the process the slots were made for (a forked child makes its own)
_slots_lock = threading.Lock()


@contextmanager
def _execution_uid() -> Iterator[int | None]:
    """Under root, a uid of this execution's own for as long as it runs; otherwise None (the user's)."""
    if os.geteuid() != 0:
        yield None
        return
    with _slots_lock:
        if _slots_pid != [os.getpid()]:
            _slots_pid[:] = [os.getpid()]
            while not _slots.empty():
                _slots.get_nowait()
            for slot in range(SLOTS):
                _slots.put(UID_BASE + SLOTS * (os.getpid() % MAX_PID) + slot)
    uid = _slots.get()
    try:
        yield uid
    finally:
        _slots.put(uid)


def _tasks_of(uid: int) -> int:
    """Tasks (processes and threads) the uid has now: what RLIMIT_NPROC counts against."""
    count = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            status = Path(entry.path, "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields.get("Uid", "-1").split()[0]) == uid:
            count += int(fields.get("Threads", "1"))
    return count


def _run_until(command: list[str], fin: Any, fout: Any, ferr: Any, uid: int | None, timeout_s: float,
               seccomp_fd: int, cgroup: Path | None) -> tuple[int | None, float]:
    """Start the command in its own process group with an empty environment (in ``cgroup``, if any) and wait,
    killing the group at ``timeout_s``. Returns (its exit status, or None when killed; wall seconds)."""
    started = time.monotonic()
    if cgroup is not None:
        command = ["/bin/sh", "-c", CGROUP_GATE, fin.name, *command]
    process = subprocess.Popen(command, stdin=fin if cgroup is None else subprocess.PIPE, stdout=fout, stderr=ferr,
                               start_new_session=True, close_fds=True, pass_fds=(seccomp_fd,), env={}, user=uid,
                               group=uid, extra_groups=[] if uid is not None else None)
    if cgroup is not None:
        assert process.stdin is not None
        try:
            _cgroup.enter(cgroup, process.pid)
        except OSError:
            process.stdin.close()  # no line: the shell exits, and nothing runs
            process.wait()
            raise
        process.stdin.write(b"\n")
        process.stdin.close()
    try:
        status: int | None = process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        _kill(process)
        status = None
    return status, time.monotonic() - started


def _kill(process: subprocess.Popen) -> None:
    """Kill the sandbox from its pid 1 down, then bwrap: the kernel kills every process of a pid namespace
    whose init dies and waits for them, and bwrap reaps that init. (Killing bwrap first would orphan the
    init for a moment, and leave it a zombie where the machine's pid 1 does not reap.)"""
    try:
        inits = Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()
    except OSError:
        inits = []
    for pid in inits:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        process.wait(2)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _program_status(code: int) -> int:
    """The program's exit status from bwrap's: bwrap exits with the program's status, or 128 + N when
    signal N ended it (so a program exiting with 129-192 itself reads as a signal)."""
    return -(code - 128) if 128 < code <= 128 + 64 else code


def _read(path: Path, cap: int) -> str:
    with open(path, "rb") as f:
        return f.read(cap).decode("utf-8", errors="replace")


_MEMORY_MARKS = ("MemoryError", "Cannot allocate memory", "out of memory")
_PROCESS_MARKS = ("Resource temporarily unavailable", "can't start new thread")
_DISK_MARKS = ("File too large", "No space left on device")


def _classify(returncode: int | None, stderr: str, *, capped: bool, wall_seconds: float,
              cpu_limit: int) -> str | None:
    """Which limit stopped the program, from how it ended and what it said: the wall clock first (it
    was killed), then the output cap (its output is cut), then the CPU (SIGXCPU at the soft limit,
    SIGKILL at the hard one a second later, which only a program that spent that long can reach), then
    the errors Python raises at the memory, process and file limits."""
    if returncode is None:
        return "wall_time"
    if capped:
        return "output"
    if returncode == -signal.SIGXCPU or (returncode == -signal.SIGKILL and wall_seconds >= cpu_limit):
        return "cpu_time"
    if returncode == 0:
        return None
    tail = stderr[-2000:]
    for name, marks in (("memory", _MEMORY_MARKS), ("processes", _PROCESS_MARKS), ("disk", _DISK_MARKS)):
        if any(mark in tail for mark in marks):
            return name
    return None


def _check_limits(**limits: float | None) -> None:
    for name, value in limits.items():
        if value is not None and not value > 0:
            raise ValueError(f"{name}: got {value}; use a positive number")
