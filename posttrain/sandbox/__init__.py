"""Running model-written code where it can do no harm.

``run(source)`` executes a Python program in a fresh bubblewrap sandbox and returns what happened as
data; ``run_many`` runs a batch of them in parallel. Rewards that execute completions (the ``code``
task's tests) and tools that run code use it, and so can users' own::

    from posttrain import sandbox

    result = sandbox.run("print(sum(range(10)))", timeout_s=5, memory_mb=256)
    result.stdout, result.returncode, result.limit      # ('45\\n', 0, None)

What the program gets (each a separate line of defence):

- **no network**: its own network namespace, with only a loopback of its own;
- **a read-only view of what Python needs** (``/usr`` and the interpreter's prefix): no home
  directory, no project, no ``/etc``, no ``/sys``; its source and ``files`` read-only in ``/sandbox``;
- **a private writable ``/tmp``** and ``/dev/shm`` (tmpfs of ``disk_mb`` each), gone when it ends; the rest
  of ``/dev`` read-only;
- **its own process tree** (a pid namespace: it can see and signal only its own processes; when
  the sandbox ends, every process in it ends), its own session (no terminal to inject into), no
  capabilities, an unprivileged user (a dedicated uid when posttrain runs as root);
- **a smaller kernel**: it cannot make a user namespace (bubblewrap's ``--disable-userns``),
  and a seccomp filter denies the calls behind most kernel privilege escalations and that a test program
  never needs (namespaces and mounts, ptrace, BPF, perf events, io_uring, userfaultfd, keyrings, modules,
  kexec, ``personality``, socket families other than Unix and IP, and the i386 and x32 system-call ABIs);
- **limits**: wall time (``timeout_s``), CPU time, address space (``memory_mb``), processes and
  threads, open files, and the size of its output and of any file it writes; where the host delegates
  a cgroup v2, also the memory and tasks of all its processes together (``SandboxResult.cgroup`` says
  which; where none is delegated, a warning is logged once, saying why);
- **an empty environment**: nothing of the parent's variables, secrets included;
- **its files closed to others**: the host directory of its code and outputs is 0700, its own uid's.

A result is never an exception: ``limit`` names the limit that stopped the program (``wall_time``,
``cpu_time``, ``memory``, ``processes``, ``output``, ``disk``) or is None. Only a machine that cannot
sandbox at all (no bubblewrap or one older than 0.8, no libseccomp, user namespaces refused) raises
:class:`SandboxUnavailable`, with the command that fixes it; it never runs a program with less.
What the sandbox does not close is in docs/guides/code-execution.md.
"""

from posttrain.sandbox._bubblewrap import (
    LIMITS,
    SandboxResult,
    SandboxUnavailable,
    check_available,
    run,
    run_many,
)

__all__ = ["LIMITS", "SandboxResult", "SandboxUnavailable", "check_available", "run", "run_many"]
