"""The sandbox as a security boundary: hostile programs, each contained and reported by kind.

Each test plants something the program must not reach (a secret file, an environment variable, a
listener on 127.0.0.1, the test process itself) and checks from outside that it was not reached, not
only what the program says.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import textwrap
import threading
import time
from pathlib import Path

import pytest

from posttrain import sandbox

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
    assert _tasks_of(uid) == 0 or uid == os.getuid()  # when run returns, the namespace took every child with it
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


def _tasks_of(uid: int) -> int:
    """Processes on the machine running as ``uid`` (under root, an execution's own)."""
    count = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        count += int(status.split("Uid:")[1].split()[0]) == uid
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
