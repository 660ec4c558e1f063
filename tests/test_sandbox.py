"""The sandbox as a security boundary: hostile programs, each contained and reported by kind.

Each test plants something the program must not reach (a secret file, an environment variable, a
listener on 127.0.0.1, the test process itself) and checks from outside that it was not reached, not
only what the program says.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import tempfile
import textwrap
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from posttrain import sandbox
from posttrain.sandbox import _bubblewrap, _cgroup, _seccomp

try:
    sandbox.check_available()
except sandbox.SandboxUnavailable as error:  # scripts/setup.sh installs bubblewrap where it can
    pytestmark = pytest.mark.skip(reason=f"no sandbox on this machine: {error}")

LIMITS = dict(timeout_s=5, memory_mb=256, max_processes=8, max_output_bytes=10_000)


def run(source: str, **overrides):
    return sandbox.run(textwrap.dedent(source), **{**LIMITS, **overrides})


@pytest.fixture()
def secret(tmp_path):
    path = tmp_path / "secret.txt"
    path.write_text("the-planted-secret")
    return path


def test_a_well_behaved_program_runs_with_its_files_stdin_and_args():
    result = sandbox.run("import sys, helper\nprint(helper.double(int(sys.stdin.read())), sys.argv[1:])",
                         stdin="21", files={"helper.py": "def double(x):\n    return 2 * x\n"}, args=["a", "b"])
    assert result.ok and result.stdout == "42 ['a', 'b']\n" and result.limit is None
    failed = sandbox.run("raise SystemExit(3)")
    assert (failed.returncode, failed.limit, failed.ok) == (3, None, False)


def test_reading_a_file_outside_the_sandbox_fails(secret):
    result = run(f"""
        import os
        for path in [{str(secret)!r}, {str(Path(__file__).resolve())!r}, "/etc/shadow", "/etc/passwd",
                     "/root/.bashrc", os.path.expanduser("~/.ssh/id_rsa")]:
            try:
                print("READ", path, open(path).read()[:40])
            except OSError as error:
                print("DENIED", path, type(error).__name__)
        print(sorted(os.listdir("/")))
    """)
    assert result.ok, result.stderr
    assert "the-planted-secret" not in result.stdout and "READ" not in result.stdout
    assert "['bin', 'dev', 'etc', 'lib', 'lib64', 'proc', 'sandbox', 'sbin', 'tmp', 'usr']" in result.stdout.replace(
        "'lib32', ", "").replace("'libx32', ", "")


def test_writing_outside_the_sandbox_fails_and_its_tmp_is_its_own(tmp_path):
    target = tmp_path / "pwned"
    result = run(f"""
        for path in [{str(target)!r}, "/usr/pwned", "/sandbox/pwned", "/pwned"]:
            try:
                open(path, "w").write("x")
                print("WROTE", path)
            except OSError as error:
                print("DENIED", path, type(error).__name__)
        open("/tmp/mine", "w").write("private")
        print(open("/tmp/mine").read())
    """)
    assert result.ok and "WROTE" not in result.stdout and result.stdout.endswith("private\n")
    assert not target.exists()
    assert "private" not in run("import os; print(os.listdir('/tmp'))").stdout  # a fresh /tmp every time


def test_a_socket_to_a_listener_on_the_host_does_not_connect():
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(3)
    port = server.getsockname()[1]
    accepted = []

    def accept():
        try:
            accepted.append(server.accept())
        except OSError:
            pass

    listener = threading.Thread(target=accept)
    listener.start()
    result = run(f"""
        import socket
        for host in ["127.0.0.1", "localhost", "8.8.8.8"]:
            try:
                socket.create_connection((host, {port}), timeout=1)
                print("CONNECTED", host)
            except OSError as error:
                print("REFUSED", host, type(error).__name__)
    """)
    listener.join()
    server.close()
    assert accepted == [] and "CONNECTED" not in result.stdout and result.stdout.count("REFUSED") == 3


def test_a_fork_bomb_is_contained_and_leaves_nothing_behind():
    result = run("""
        import os
        print(os.getuid(), flush=True)
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """, timeout_s=3, cpu_time_s=2)
    assert result.limit in ("processes", "cpu_time", "wall_time")
    uid = int(result.stdout.split()[0])
    assert _all_gone(uid) or uid == os.getuid()  # the namespace takes every child with it
    assert run("print('still fine')").stdout == "still fine\n"  # and the next sandbox starts


def test_a_plain_fork_bomb_is_reported_as_the_process_limit():
    result = run("import os\nwhile True:\n    os.fork()\n", timeout_s=5)
    assert result.limit == "processes", result


def test_a_thread_bomb_is_reported_as_the_process_limit():
    result = run("""
        import threading, time
        while True:
            threading.Thread(target=time.sleep, args=(10,), daemon=True).start()
    """)
    assert result.limit in ("processes", "memory"), result  # each thread's stack also counts as address space


def test_a_memory_bomb_is_reported_as_the_memory_limit():
    result = run("chunks = []\nwhile True:\n    chunks.append(bytearray(10 * 2**20))\n")
    assert result.limit == "memory" and result.returncode != 0


@pytest.mark.parametrize("source, limit", [
    ("while True:\n    pass\n", "cpu_time"),
    ("import time\ntime.sleep(60)\n", "wall_time"),
    ("import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass\n", "cpu_time"),
])
def test_time_limits(source, limit):
    # the wall clock leaves the CPU limit (1 s soft, 2 s hard for a program ignoring SIGXCPU) room on a
    # loaded machine, where a looping program gets a fraction of a core
    timeout = 4 if limit == "wall_time" else 15
    started = time.monotonic()
    result = run(source, timeout_s=timeout, cpu_time_s=1)
    assert result.limit == limit and time.monotonic() - started < timeout + 4
    assert (result.returncode is None) == (limit == "wall_time")


def test_huge_output_is_cut_at_the_cap_and_reported():
    result = run("import sys\nwhile True:\n    sys.stdout.write('x' * 4096)\n")
    assert result.limit == "output" and len(result.stdout) == LIMITS["max_output_bytes"]
    result = run("import sys\nwhile True:\n    sys.stderr.write('y' * 4096)\n")
    assert result.limit == "output" and len(result.stderr) == LIMITS["max_output_bytes"]


def test_filling_the_disk_is_reported():
    result = run("""
        with open("/tmp/big", "w") as f:
            while True:
                f.write("z" * 4096)
    """, max_output_bytes=10**9, disk_mb=4)
    assert result.limit == "disk", result


def test_dev_is_read_only_and_dev_shm_is_capped():
    result = run("""
        try:
            open("/dev/pwned", "w")
            print("WROTE /dev")
        except OSError as error:
            print("DENIED /dev", error.errno)
        with open("/dev/shm/big", "w") as f:
            while True:
                f.write("z" * 4096)
    """, max_output_bytes=10**9, disk_mb=4)
    assert "DENIED /dev 30" in result.stdout and result.limit == "disk", result


def test_signalling_the_parent_or_anything_outside_fails():
    me = os.getpid()
    result = run(f"""
        import os, signal
        for pid in [os.getppid(), {me}, 1, -1]:
            try:
                os.kill(pid, signal.SIGKILL if pid != -1 else signal.SIGTERM)
                print("SENT", pid)
            except OSError as error:
                print("DENIED", pid, type(error).__name__)
    """)
    assert f"SENT {me}" not in result.stdout  # not in its pid namespace
    os.kill(me, 0)  # this test process is alive to check


def test_the_parent_environment_is_not_visible(monkeypatch):
    monkeypatch.setenv("POSTTRAIN_TEST_SECRET", "env-secret-value")
    result = run("""
        import os, json
        seen = dict(os.environ)
        for path in ["/proc/self/environ", "/proc/1/environ"]:
            try:
                seen[path] = open(path, "rb").read().decode(errors="replace")
            except OSError as error:
                seen[path] = type(error).__name__
        print(json.dumps(seen))
    """)
    assert "env-secret-value" not in result.stdout and "POSTTRAIN_TEST_SECRET" not in result.stdout
    assert set(json.loads(result.stdout)) <= {"PATH", "HOME", "PWD", "LC_CTYPE", "/proc/self/environ",
                                              "/proc/1/environ"}


def test_escaping_through_proc_fails(secret):
    me = os.getpid()
    result = run(f"""
        import os
        attempts = ["/proc/{me}/root{secret}", "/proc/{me}/environ", "/proc/1/root{secret}",
                    "/proc/self/root{secret}", "/proc/{me}/cwd/secret.txt", "/proc/sys/kernel/hostname"]
        for path in attempts:
            try:
                print("READ", path, open(path).read()[:40])
            except OSError as error:
                print("DENIED", path, type(error).__name__)
        print("PIDS", sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
    """)
    assert "the-planted-secret" not in result.stdout
    pids = json.loads(result.stdout.split("PIDS ")[1])
    assert me not in pids and len(pids) <= 4  # its own namespace: bwrap's init and itself


def test_run_many_keeps_order_and_limits_each():
    results = sandbox.run_many(["print(1)", {"source": "import sys; print(sys.stdin.read())", "stdin": "two"},
                                "while True:\n    pass\n"], timeout_s=3, cpu_time_s=1)
    assert [r.stdout for r in results[:2]] == ["1\n", "two\n"] and results[2].limit == "cpu_time"


def test_bad_arguments_name_the_problem():
    with pytest.raises(ValueError, match="memory_mb: got 0"):
        sandbox.run("print(1)", memory_mb=0)
    with pytest.raises(ValueError, match="files: 'main.py'"):
        sandbox.run("print(1)", files={"main.py": ""})
    with pytest.raises(ValueError, match="files: '../x'"):
        sandbox.run("print(1)", files={"../x": ""})


def _all_gone(uid: int) -> bool:
    """Whether no live process runs as ``uid`` within a second: the kernel kills what is left in the pid
    namespace when its init exits, a moment after bubblewrap has reported the program's exit."""
    for _ in range(100):
        if _tasks_of(uid) == 0:
            return True
        time.sleep(0.01)
    return False


def _tasks_of(uid: int) -> int:
    """Live processes on the machine running as ``uid`` (under root, an execution's own). Not zombies: they
    run nothing, and bubblewrap's init is one for a moment after an execution, until the machine's pid 1
    reaps it."""
    count = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        count += int(status.split("Uid:")[1].split()[0]) == uid and status.split("State:")[1].split()[0] != "Z"
    return count


def test_concurrent_executions_in_two_processes_get_uids_of_their_own():
    """Under root each execution runs as a uid of its own, also across processes: RLIMIT_NPROC counts per uid."""
    if os.geteuid() != 0:
        pytest.skip("the sandbox runs as the user's own uid when posttrain does not run as root")
    import multiprocessing

    context = multiprocessing.get_context("fork")
    results = context.Queue()
    workers = [context.Process(target=_uid_in_sandbox, args=(results,)) for _ in range(2)]
    for worker in workers:
        worker.start()
    uids = [results.get(timeout=60) for _ in workers]
    for worker in workers:
        worker.join()
    assert len(set(uids)) == 2 and all(uid >= 2_000_000_000 for uid in uids)


def _uid_in_sandbox(results) -> None:
    results.put(int(sandbox.run("import os; print(os.getuid())").stdout))


def test_results_are_data_never_exceptions():
    """Whatever the program does to itself, run returns."""
    for source in ["import os; os.kill(os.getpid(), 9)", "import os; os._exit(0)", "import ctypes; ctypes.string_at(0)",
                   "raise KeyboardInterrupt", "import sys; sys.stdout.close(); sys.stderr.close()"]:
        result = run(source)
        assert isinstance(result, sandbox.SandboxResult)
    assert run("import os; os.kill(os.getpid(), 9)").returncode == -signal.SIGKILL


# ---------------------------------------------------------------------------------------
# The kernel's attack surface: the seccomp filter, nested user namespaces, the host's files and tables
# ---------------------------------------------------------------------------------------

HOSTILE_CALLS = r'''
import ctypes, errno, json, os, socket, struct, sys, time

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
NR = json.loads(sys.argv[1])  # the host's numbers for the calls' names
CLONE_FLAGS = json.loads(sys.argv[2])
buffer = ctypes.create_string_buffer(512)


def attempt(name, *args):
    ctypes.set_errno(0)
    result = libc.syscall(ctypes.c_long(NR[name]), *[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
    return errno.errorcode[ctypes.get_errno()] if result == -1 else f"returned {result}"


def clone3_args(flags):  # struct clone_args: flags, pidfd, child_tid, parent_tid, exit_signal, ...
    return ctypes.create_string_buffer(struct.pack("11Q", flags, 0, 0, 0, 17, 0, 0, 0, 0, 0, 0), 88)


# a software clock on its own process, user space only: what perf_event_paranoid 2 lets anyone open
perf_attr = ctypes.create_string_buffer(struct.pack("IIQQQQQ", 1, 128, 0, 0, 0, 0, 1 | 1 << 5 | 1 << 6), 128)
child = os.fork()
if child == 0:
    time.sleep(30)
    os._exit(0)
report = {
    "unshare": attempt("unshare", 0x10000000 | 0x40000000 | 0x20000),  # CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWNS
    "setns": attempt("setns", os.open("/proc/self/ns/net", os.O_RDONLY), 0),
    **{f"clone {flag:#x}": attempt("clone", flag | 17, 0, None, None, 0)  # each CLONE_NEW* flag, with SIGCHLD
       for flag in CLONE_FLAGS},
    "clone3": attempt("clone3", clone3_args(0x10000000), 88),
    "mount": attempt("mount", b"none", b"/tmp", b"tmpfs", 0, None),
    "umount2": attempt("umount2", b"/proc", 2),
    "chroot": attempt("chroot", b"/tmp"),
    "pivot_root": attempt("pivot_root", b"/tmp", b"/tmp"),
    "fsopen": attempt("fsopen", b"tmpfs", 0),
    "open_tree": attempt("open_tree", -100, b"/tmp", 1),
    "ptrace": attempt("ptrace", 16, child, None, None),  # PTRACE_ATTACH to its own child
    "process_vm_readv": attempt("process_vm_readv", child, None, 0, None, 0, 0),
    "bpf": attempt("bpf", 5, buffer, 128),
    "perf_event_open": attempt("perf_event_open", perf_attr, 0, -1, -1, 0),
    "userfaultfd": attempt("userfaultfd", 0o2000000 | 1),  # O_CLOEXEC | UFFD_USER_MODE_ONLY
    "keyctl": attempt("keyctl", 0, -2, 1),
    "add_key": attempt("add_key", b"user", b"posttrain-hostile", b"x", 1, -2),
    "request_key": attempt("request_key", b"user", b"posttrain-hostile", None, 0),
    "io_uring_setup": attempt("io_uring_setup", 8, buffer),
    "io_uring_enter": attempt("io_uring_enter", 0, 0, 0, 0, None, 0),
    "io_uring_register": attempt("io_uring_register", 0, 0, None, 0),
    "init_module": attempt("init_module", buffer, 16, b""),
    "finit_module": attempt("finit_module", os.open("/sandbox/main.py", os.O_RDONLY), b"", 0),
    "delete_module": attempt("delete_module", b"ext4", 0),
    "kexec_load": attempt("kexec_load", 0, 0, None, 0),
    "kexec_file_load": attempt("kexec_file_load", -1, -1, 0, b"", 0),
    "personality": attempt("personality", 0x0040000),  # ADDR_NO_RANDOMIZE
    "modify_ldt": attempt("modify_ldt", 0, buffer, 16),
    "open_by_handle_at": attempt("open_by_handle_at", -100, buffer, 0),
    "syslog": attempt("syslog", 3, buffer, 256),  # read the kernel's log
    "reboot": attempt("reboot", 0xfee1dead, 0x28121969, 0x4321fedc, None),
}
for family in (16, 17, 21, 30, 31, 38, 40, 44):  # netlink, packet, RDS, TIPC, bluetooth, ALG, vsock, XDP
    try:
        socket.socket(family, socket.SOCK_DGRAM).close()
        report[f"socket {family}"] = "created"
    except OSError as error:
        report[f"socket {family}"] = errno.errorcode[error.errno]
os.kill(child, 9)
report["uid"] = os.getuid()
print(json.dumps(report))
'''
CLONE_FLAGS = (0x20000, 0x2000000, 0x4000000, 0x8000000, 0x10000000, 0x20000000, 0x40000000)  # CLONE_NEW*
DENIED = {
    **dict.fromkeys(["unshare", "setns", *(f"clone {flag:#x}" for flag in CLONE_FLAGS), "mount", "umount2", "chroot",
                     "pivot_root", "fsopen", "open_tree", "ptrace", "process_vm_readv", "bpf", "perf_event_open",
                     "userfaultfd", "keyctl", "add_key", "request_key", "init_module", "finit_module", "delete_module",
                     "kexec_load", "kexec_file_load", "personality", "modify_ldt", "open_by_handle_at", "syslog",
                     "reboot"], "EPERM"),
    **dict.fromkeys(["clone3", "io_uring_setup", "io_uring_enter", "io_uring_register"], "ENOSYS"),
    **dict.fromkeys([f"socket {family}" for family in (16, 17, 21, 30, 31, 38, 40, 44)], "EAFNOSUPPORT"),
}
"""What each call of HOSTILE_CALLS gets. Without the filter, most succeed on an ordinary kernel (the clones,
unshare, perf_event_open, userfaultfd, io_uring_setup, ptrace of its own child, the sockets)."""


def _syscall_numbers() -> dict[str, int]:
    import pyseccomp

    names = {key.split()[0] for key in DENIED if not key.startswith("socket")}
    return {name: pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, name) for name in names}


def test_every_call_the_filter_closes_fails_inside_and_the_host_is_untouched():
    mounts, user_namespaces = Path("/proc/self/mountinfo").read_text(), _max_user_namespaces()
    result = run(HOSTILE_CALLS, args=[json.dumps(_syscall_numbers()), json.dumps(CLONE_FLAGS)], timeout_s=10)
    assert result.ok, result.stderr
    report = json.loads(result.stdout)
    uid = report.pop("uid")
    assert report == DENIED
    assert _all_gone(uid) or uid == os.getuid()  # none of its clones outlived it
    assert Path("/proc/self/mountinfo").read_text() == mounts and _max_user_namespaces() == user_namespaces
    assert _tracer() == 0 and "posttrain-hostile" not in Path("/proc/keys").read_text()


def _max_user_namespaces() -> str:
    return Path("/proc/sys/user/max_user_namespaces").read_text()


def _tracer() -> int:
    """The pid tracing this test process (0: none)."""
    return int(Path("/proc/self/status").read_text().split("TracerPid:")[1].split()[0])


def test_a_nested_user_namespace_cannot_be_made(tmp_path):
    """The door to most kernel privilege escalations: full capabilities in a namespace of its own. Closed twice:
    the filter, and bubblewrap's --disable-userns (a user namespace whose limit of nested ones is spent)."""
    user_namespaces = _max_user_namespaces()
    target = tmp_path / "escaped"
    result = run(f"""
        import ctypes, os, subprocess
        libc = ctypes.CDLL(None, use_errno=True)
        print("unshare", libc.unshare(0x10000000 | 0x20000), os.strerror(ctypes.get_errno()))
        tool = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "--net", "sh", "-c",
                               "mount -t tmpfs none /tmp && touch {target}"], capture_output=True, text=True)
        print("tool", tool.returncode, tool.stderr.strip())
        print("capabilities", open("/proc/self/status").read().split("CapEff:")[1].split()[0])
    """)
    assert result.stdout.splitlines() == ["unshare -1 Operation not permitted",
                                          "tool 1 unshare: unshare failed: Operation not permitted",
                                          "capabilities 0000000000000000"], result
    assert not target.exists() and _max_user_namespaces() == user_namespaces


def test_ptrace_of_the_parent_fails_and_leaves_it_untraced():
    me = os.getpid()
    result = run(f"""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        parent = os.getppid()
        for pid in [parent, {me}, 1]:
            print("attach", pid, libc.ptrace(16, pid, None, None), os.strerror(ctypes.get_errno()))
        print("traceme", libc.ptrace(0, 0, None, None), os.strerror(ctypes.get_errno()))
        os.kill(parent, 0)  # still there
        print("tracer", open(f"/proc/{{parent}}/status").read().split("TracerPid:")[1].split()[0])
    """)
    assert result.ok, result.stderr
    assert result.stdout.count("-1 Operation not permitted") == 4 and "tracer 0" in result.stdout
    assert _tracer() == 0


def test_system_calls_through_another_abi_kill_the_program():
    """i386's int 0x80 and x32's numbers are not the native numbers the filter is keyed on: the filter's
    architecture check kills the process before the kernel runs either."""
    if os.uname().machine != "x86_64":
        pytest.skip("i386 and x32 are x86_64's other ABIs")
    x32 = run("import ctypes\nctypes.CDLL(None).syscall(0x40000000 | 39)\nprint('survived')")  # x32 getpid
    i386 = run("""
        import ctypes, mmap
        page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
        page.write(bytes([0xB8, 20, 0, 0, 0, 0xCD, 0x80, 0xC3]))  # mov eax, 20 (i386 getpid); int 0x80; ret
        print(ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(page)))())
        print("survived")
    """)
    assert x32.returncode == -signal.SIGSYS, x32
    assert i386.returncode in (-signal.SIGSYS, -signal.SIGSEGV), i386  # SIGSEGV: a kernel without the i386 entry
    assert "survived" not in x32.stdout + i386.stdout


def test_another_execution_s_files_are_closed_to_it_and_to_other_uids():
    """An execution's code, stdin and outputs sit in a host directory of 0700, owned by its uid: another
    execution cannot see the host's /tmp, and another uid (the next execution's) cannot read it there."""
    marker = "secret-of-the-first-execution"
    first: list = []
    running = threading.Thread(target=lambda: first.append(run(f"import time\n# {marker}\ntime.sleep(4)",
                                                               timeout_s=10)))
    running.start()
    work_dir = None
    for _ in range(100):
        for candidate in Path(tempfile.gettempdir()).glob("posttrain-sandbox-*"):
            try:
                if marker in (candidate / "code" / "main.py").read_text():
                    work_dir = candidate
            except OSError:
                continue
        if work_dir is not None:
            break
        time.sleep(0.05)
    assert work_dir is not None
    info = work_dir.stat()
    assert info.st_mode & 0o777 == 0o700
    second = run(f"""
        import glob, os
        for path in [{str(work_dir / "code" / "main.py")!r}, *glob.glob("/proc/*/root/{work_dir.name}")]:
            try:
                print("READ", open(path).read())
            except OSError as error:
                print("DENIED", type(error).__name__)
        print(glob.glob("/tmp/posttrain-sandbox-*"))
    """)
    assert second.ok and "READ" not in second.stdout and second.stdout.endswith("[]\n"), second
    if os.geteuid() == 0:  # the uid the next concurrent execution would run as
        other = subprocess.run(["cat", str(work_dir / "code" / "main.py")], capture_output=True, text=True,
                               user=info.st_uid + 1, group=info.st_uid + 1, extra_groups=[])
        assert other.returncode != 0 and "Permission denied" in other.stderr and marker not in other.stdout
    running.join()
    assert first[0].ok and not work_dir.exists()


def test_exhausting_file_descriptors_stops_at_its_own_limit():
    host_fds = len(os.listdir("/proc/self/fd"))
    result = run("""
        import os
        opened = []
        try:
            while True:
                opened.append(os.open("/dev/null", os.O_RDONLY))
        except OSError as error:
            print(len(opened), error.errno)
    """)
    opened, code = map(int, result.stdout.split())
    assert code == errno.EMFILE and 200 < opened < 256  # RLIMIT_NOFILE 256, less what Python holds open
    assert len(os.listdir("/proc/self/fd")) == host_fds and run("print('next')").stdout == "next\n"


def test_a_fork_storm_stops_at_the_process_limit_and_leaves_nothing():
    """Children that stay alive: the storm is held at ``max_processes`` (the cgroup's pids.max where the host
    delegates one, RLIMIT_NPROC of the execution's uid otherwise), and the pid namespace ends them all."""
    result = run("""
        import os, time
        print(os.getuid(), flush=True)
        children = 0
        while True:
            try:
                pid = os.fork()
            except OSError as error:
                print(children, error.errno, flush=True)
                break
            if pid == 0:
                time.sleep(60)
                os._exit(0)
            children += 1
    """, max_processes=8, timeout_s=20)
    uid, children, code = map(int, result.stdout.split())
    assert result.ok and code == errno.EAGAIN and children <= 7  # itself and 7 children
    assert _all_gone(uid) or uid == os.getuid()
    assert run("print('next')").stdout == "next\n"


def test_an_interpreter_whose_prefix_is_a_whole_top_level_directory_is_refused():
    """Its installation is bound read-only into the sandbox: never the host's root or a home."""
    for python, prefix in [("/opt/python3", "/"), ("/root/bin/python3", "/root")]:
        with pytest.raises(sandbox.SandboxUnavailable, match=f"its prefix would be {prefix},"):
            sandbox.run("print(1)", python=python)


def test_the_cgroup_is_used_where_delegated_and_its_absence_is_said():
    """This process's cgroup v2 directory from /proc's texts: a systemd user scope, a container at its
    namespace's root, and a cgroup v1 host whose v2 hierarchy sits beside v1's controllers."""
    mount = "35 24 0:30 / /sys/fs/cgroup rw,nosuid shared:9 - cgroup2 cgroup2 rw,nsdelegate\n"
    scope = "0::/user.slice/user-1000.slice/user@1000.service/app.slice/run-r1.scope\n"
    assert _cgroup.cgroup_dir(scope, mount) == Path("/sys/fs/cgroup/user.slice/user-1000.slice/user@1000.service"
                                                    "/app.slice/run-r1.scope")
    assert _cgroup.cgroup_dir("0::/\n", mount) == Path("/sys/fs/cgroup")
    hybrid = "4:memory:/process_api/c9\n8:pids:/\n0::/\n"
    unified = "40 24 0:35 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n"
    assert _cgroup.cgroup_dir(hybrid, unified) == Path("/sys/fs/cgroup/unified")
    assert _cgroup.cgroup_dir("4:memory:/a\n", unified) == "this host has no cgroup v2 hierarchy"
    delegation = _cgroup.delegated()
    result = run("print(1)")
    assert result.cgroup == (delegation.parent is not None)
    if delegation.parent is None:  # what bounds a sandbox instead is said
        assert "memory is capped per process" in delegation.note and "RLIMIT_NPROC" in delegation.note


def test_the_whole_sandbox_memory_is_capped_where_a_cgroup_is_delegated():
    """Four processes of 200 MB each under RLIMIT_AS of 256 MB each: what the rlimit allows, the cgroup
    (memory_mb for all of them) stops."""
    if _cgroup.delegated().parent is None:
        pytest.skip(f"no cgroup here: {_cgroup.delegated().note}")
    result = run("""
        import os, time
        for _ in range(3):
            if os.fork() == 0:
                break
        block = bytearray(200 * 2**20)
        block[::4096] = b"x" * len(block[::4096])
        time.sleep(2)
    """, memory_mb=256, timeout_s=20, disk_mb=4)
    assert result.limit == "memory" and result.cgroup, result


def test_an_execution_with_a_cgroup_starts_only_once_moved_into_it(monkeypatch, tmp_path):
    """The execution's first process waits until the parent has moved it into its cgroup, so nothing it
    starts is outside; if the move fails, nothing runs. (The kernel's side, the cgroup itself, is stood in
    for: this checks the order and the program's stdin through the wait.)"""
    @contextmanager
    def execution_cgroup(**limits):
        yield tmp_path

    moved = []

    def enter(path, pid):
        moved.append(os.readlink(f"/proc/{pid}/exe"))  # what it runs when moved

    monkeypatch.setattr(_bubblewrap, "_execution_cgroup", execution_cgroup)
    monkeypatch.setattr(_cgroup, "enter", enter)
    monkeypatch.setattr(_cgroup, "out_of_memory", lambda path: False)
    result = run("import sys\nprint(sys.stdin.read()[::-1])", stdin="olleh")
    assert result.ok and result.stdout == "hello\n" and result.cgroup
    assert moved == [os.path.realpath("/bin/sh")]  # the shell, still waiting: not yet prlimit or bwrap

    def refuse(path, pid):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(_cgroup, "enter", refuse)
    with pytest.raises(PermissionError):
        run("print('ran')")
    stdin = tmp_path / "stdin"
    stdin.write_text("")
    gate = subprocess.run(["/bin/sh", "-c", _bubblewrap.CGROUP_GATE, str(stdin), "echo", "ran"], input=b"",
                          capture_output=True)
    assert gate.returncode != 0 and gate.stdout == b""  # stdin closed without the line: the command never starts


def test_without_libseccomp_it_refuses_to_sandbox_rather_than_run_weaker(monkeypatch):
    def missing():
        raise RuntimeError("Unable to find libseccomp")  # what pyseccomp raises on import without libseccomp.so.2

    monkeypatch.setattr(_seccomp, "program", missing)
    monkeypatch.setattr(_bubblewrap, "_available", {})
    with pytest.raises(sandbox.SandboxUnavailable, match="pip install pyseccomp"):
        sandbox.run("print(1)")
