"""The seccomp filter bubblewrap loads just before it runs the program: the kernel's calls a test
program never needs, closed.

Most kernel privilege escalations start at a call an ordinary program never makes: creating a user
namespace (which hands full capabilities inside it, and with them netfilter, mounts, ...), io_uring,
BPF, perf events, userfaultfd, keyrings, ptrace. The filter allows by default and denies those by
name, so a program that calls one gets an error it can handle (``EPERM``; ``ENOSYS`` where a
library probes and falls back) and the call never reaches the kernel's code behind it:

1. **namespaces and mounts**: ``unshare``, ``setns``, ``clone`` with any ``CLONE_NEW*`` flag, the
   mount calls old and new, ``chroot``, ``pivot_root``. ``clone3`` passes its flags in memory,
   where a filter cannot read them, so it returns ``ENOSYS``: glibc then falls back to ``clone``,
   whose flags the filter checks (threads, ``fork``, ``subprocess`` and ``posix_spawn`` all work);
2. **other processes**: ``ptrace``, ``process_vm_readv``/``writev``, ``process_madvise``,
   ``pidfd_getfd``, ``kcmp``, ``move_pages``, ``migrate_pages``;
3. **the kernel's big attack surfaces**: ``bpf``, ``perf_event_open``, ``userfaultfd``, ``keyctl``,
   ``add_key``, ``request_key``, and ``io_uring_*`` (``ENOSYS``: as on kernels built without it);
4. **the machine's administration** (each also needs a capability the program does not have):
   modules, ``kexec``, ``reboot``, swap, ``acct``, ``syslog``, quotas, the clocks, I/O ports,
   ``open_by_handle_at`` (the classic container escape), ``fanotify_init`` and obsolete calls;
5. **the execution domain**: ``personality`` (it can turn off address-space randomisation) and
   ``modify_ldt``;
6. **socket families** other than ``AF_UNIX``, ``AF_INET`` and ``AF_INET6`` (``EAFNOSUPPORT``):
   ``AF_ALG``, ``AF_VSOCK``, ``AF_NETLINK``, ``AF_PACKET``, ... are kernel code few programs reach;
7. **other system-call ABIs**: a call through the i386 entry (``int 0x80``) or with x32's number
   bit kills the process. Filters are keyed on the native numbers, which those ABIs do not use.

libseccomp compiles the rules (through ``pyseccomp``, its ctypes bindings) into a classic BPF
program, once per process; bubblewrap reads it from a file descriptor (``--seccomp FD``).
"""

from __future__ import annotations

import errno
import os
import tempfile
import threading

CLONE_NEW = {"CLONE_NEWNS": 0x00020000, "CLONE_NEWCGROUP": 0x02000000, "CLONE_NEWUTS": 0x04000000,
             "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUSER": 0x10000000, "CLONE_NEWPID": 0x20000000,
             "CLONE_NEWNET": 0x40000000}
"""``clone``'s namespace flags (``CLONE_NEWTIME`` exists only for ``clone3`` and ``unshare``, both denied)."""

DENIED_EPERM = (
    # 1. namespaces and mounts
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount", "fsopen", "fsconfig",
    "fsmount", "fspick", "mount_setattr",
    # 2. other processes
    "ptrace", "process_vm_readv", "process_vm_writev", "process_madvise", "pidfd_getfd", "kcmp", "move_pages",
    "migrate_pages",
    # 3. the kernel's big attack surfaces
    "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key",
    # 4. the machine's administration, and obsolete calls
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot", "swapon", "swapoff",
    "acct", "syslog", "quotactl", "quotactl_fd", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "iopl",
    "ioperm", "vhangup", "open_by_handle_at", "lookup_dcookie", "nfsservctl", "uselib", "fanotify_init", "_sysctl",
    "sysfs", "ustat",
    # 5. the execution domain
    "personality", "modify_ldt",
)
"""Calls that fail with ``EPERM``, whatever their arguments."""

DENIED_ENOSYS = ("clone3", "io_uring_setup", "io_uring_enter", "io_uring_register")
"""Calls that fail with ``ENOSYS``, as on a kernel without them: glibc falls back from ``clone3`` to
``clone``, and a library that probes for io_uring uses ordinary reads and writes."""

SOCKET_FAMILIES = {"AF_UNIX": 1, "AF_INET": 2, "AF_INET6": 10}
"""The socket families ``socket`` and ``socketpair`` may create; any other fails with ``EAFNOSUPPORT``."""

INSTALL_HINT = ("the sandbox's seccomp filter needs libseccomp and its bindings: pip install pyseccomp "
                "(posttrain's own dependency) and sudo apt-get install libseccomp2 (Debian, Ubuntu) or "
                "sudo dnf install libseccomp (Fedora)")

_program: list[bytes] = []
_program_lock = threading.Lock()


def program() -> bytes:
    """The filter as classic BPF (``struct sock_filter[]``), as bubblewrap's ``--seccomp`` reads it; built
    once per process. Raises ImportError without pyseccomp, RuntimeError without libseccomp.so.2 (pyseccomp
    raises it on import), OSError where libseccomp does not know a call (one older than 2.5)."""
    with _program_lock:
        if not _program:
            _program.append(_compile())
        return _program[0]


def _compile() -> bytes:
    import pyseccomp as seccomp

    rules = seccomp.SyscallFilter(seccomp.ALLOW)
    # A call from another ABI (i386, x32) kills the process: the rules below are keyed on native numbers.
    rules.set_attr(seccomp.Attr.ACT_BADARCH, seccomp.KILL_PROCESS)

    def deny(error: int, name: str, *conditions: object) -> None:
        if seccomp.resolve_syscall(seccomp.Arch.NATIVE, name) == -1:  # libseccomp's "no such call"
            raise OSError(errno.ENOSYS, f"libseccomp does not know the call {name}; libseccomp 2.5 or newer knows "
                                        "every call the filter names")
        rules.add_rule(seccomp.ERRNO(error), name, *conditions)

    for name in DENIED_EPERM:
        deny(errno.EPERM, name)
    for name in DENIED_ENOSYS:
        deny(errno.ENOSYS, name)
    for flag in CLONE_NEW.values():  # rules on one call are alternatives: any one flag set denies
        deny(errno.EPERM, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    allowed = sorted(SOCKET_FAMILIES.values())
    for name in ("socket", "socketpair"):
        for family in range(allowed[-1]):  # every family below the highest allowed that is not allowed...
            if family not in allowed:
                deny(errno.EAFNOSUPPORT, name, seccomp.Arg(0, seccomp.EQ, family))
        deny(errno.EAFNOSUPPORT, name, seccomp.Arg(0, seccomp.GT, allowed[-1]))  # ...and every one above it
    with tempfile.TemporaryFile() as out:
        rules.export_bpf(out)
        out.seek(0)
        return out.read()


def file_descriptor() -> int:
    """A file descriptor to read the filter from, at its start (a memfd holding it), for ``bwrap --seccomp
    FD``. The caller passes it to bubblewrap and closes it."""
    filter_bpf = program()
    fd = os.memfd_create("posttrain-seccomp")  # close-on-exec: only a child it is passed to gets it
    os.write(fd, filter_bpf)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
