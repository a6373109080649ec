"""Hostile programs: each gets its expected verdict, and the host is checked afterwards
(processes, files, network, the service itself). The battery runs against the service in each
execution mode (in batch mode a single program is a group of one, forked from the fork server)."""

from __future__ import annotations

import hashlib
import socket
import subprocess
import threading
from pathlib import Path

import pytest

from tests.conftest import wait_until
from tests.sandbox.helpers import cgroup_dirs, verdict
from tests.sandbox.helpers import client as sandbox_client

FORK_BOMB_PY = """
import os
while True:
    os.fork()
"""

FORK_BOMB_SH = ":(){ :|:& };:\n"  # the classic: the main shell returns at once, the bomb goes on
FORK_BOMB_SH_FOREGROUND = ":(){ :|: ; };:\n"

MEMORY_BOMB = """
chunks = []
while True:
    chunks.append(bytearray(16 << 20))
"""

THREAD_SPIN_C = r"""
#include <pthread.h>
static void *spin(void *arg) { volatile unsigned long x = 0; for (;;) x++; return arg; }
int main(void) {
    pthread_t t[8];
    for (int i = 0; i < 8; i++) pthread_create(&t[i], 0, spin, 0);
    spin(0);
}
"""

WRITES_OUTSIDE = """
import os
targets = ["/etc/temper-evil", "/usr/bin/temper-evil", "/grader/harness.py", "/temper-evil", "/dev/temper-evil",
           "/proc/sys/kernel/hostname", "/stash/evil", "/sys/temper-evil"]
for path in targets:
    try:
        with open(path, "w") as f:
            f.write("pwned")
        print("WROTE", path)
    except OSError as e:
        print("denied", path, type(e).__name__)
with open("/tmp/inside-only", "w") as f:
    f.write("fine")
with open("/work/inside-only", "w") as f:
    f.write("fine")
print("done")
"""


@pytest.fixture(scope="module", params=["isolated", "batch"])
def mode(request):
    return request.param


@pytest.fixture(scope="module")
def service(mode, request):
    return request.getfixturevalue(f"{mode}_service")


@pytest.fixture(scope="module")
def client(service):
    with sandbox_client(service) as c:
        yield c


def assert_host_recovered(service, client):
    """The hostile sandbox is gone (only warm ones remain) and the service still runs programs."""
    wait_until(lambda: len(list(cgroup_dirs(service)[0].glob("temper-*"))) <= 2, what="hostile sandbox removed")
    resp = client.execute("print(6 * 7)", wall_seconds=10)
    assert verdict(resp) == "OK" and resp.stdout == b"42\n", resp


@pytest.mark.parametrize("language, source, expected", [
    ("python3", FORK_BOMB_PY, {"RUNTIME_ERROR", "TIMEOUT"}),
    ("bash", FORK_BOMB_SH, {"OK", "RUNTIME_ERROR", "TIMEOUT"}),
    ("bash", FORK_BOMB_SH_FOREGROUND, {"RUNTIME_ERROR", "TIMEOUT"}),
], ids=["python", "bash", "bash-foreground"])
def test_fork_bomb(service, client, language, source, expected):
    resp = client.execute(source, language, wall_seconds=3, max_processes=32)
    assert verdict(resp) in expected, resp.message
    assert resp.wall_seconds < 10
    assert_host_recovered(service, client)


def test_memory_bomb(service, client):
    resp = client.execute(MEMORY_BOMB, wall_seconds=20, memory_mb=128)
    assert verdict(resp) == "MEMORY_LIMIT", (resp.message, resp.stderr[-500:])
    assert_host_recovered(service, client)


def test_memory_within_limit_is_fine(client):
    resp = client.execute("x = bytearray(64 << 20)\nprint(len(x))", wall_seconds=20, memory_mb=256)
    assert verdict(resp) == "OK", resp.message
    assert 64 << 20 < resp.peak_memory_bytes < 256 << 20


def test_infinite_loop(client):
    resp = client.execute("while True:\n    pass\n", wall_seconds=2, cpu_seconds=1)
    assert verdict(resp) == "TIMEOUT"
    assert resp.wall_seconds < 4


def test_cpu_spin_in_many_threads(service, client):
    resp = client.execute(THREAD_SPIN_C, "c", wall_seconds=20, cpu_seconds=2)
    assert verdict(resp) == "TIMEOUT", resp.message
    assert "CPU" in resp.message  # the CPU limit, summed over the threads, ended it; not the wall limit
    assert_host_recovered(service, client)


def test_sleeping_past_the_deadline(client):
    resp = client.execute("import time\ntime.sleep(60)\n", wall_seconds=1)
    assert verdict(resp) == "TIMEOUT" and "wall" in resp.message
    assert resp.wall_seconds < 3


def test_background_process_does_not_hold_the_run(client):
    resp = client.execute("sleep 100 &\necho started\n", "bash", wall_seconds=10)
    assert verdict(resp) == "OK" and resp.stdout == b"started\n"
    assert resp.wall_seconds < 5


@pytest.mark.parametrize("language, source", [
    ("python3", "import sys\nwhile True:\n    sys.stdout.write('x' * 4096)\n"),
    ("c", "#include <stdio.h>\nint main(void) { for (;;) putchar('y'); }\n"),
], ids=["python", "c"])
def test_huge_stdout(client, language, source):
    resp = client.execute(source, language, wall_seconds=10, max_output_bytes=100_000)
    assert verdict(resp) == "OUTPUT_LIMIT"
    assert len(resp.stdout) == 100_000 and resp.output_truncated


def test_binary_garbage_on_stdout(client):
    source = ("import os, sys, hashlib\ndata = os.urandom(200_000)\nsys.stdout.buffer.write(data)\n"
              "sys.stderr.write(hashlib.sha256(data).hexdigest())\n")
    resp = client.execute(source, wall_seconds=10)
    assert verdict(resp) == "OK"
    assert len(resp.stdout) == 200_000
    assert hashlib.sha256(resp.stdout).hexdigest() == resp.stderr.decode()


def test_writes_outside_the_workdir(service, client):
    resp = client.execute(WRITES_OUTSIDE, wall_seconds=10)
    assert verdict(resp) == "OK", resp.stderr
    assert b"WROTE" not in resp.stdout and b"done" in resp.stdout, resp.stdout
    for path in ("/etc/temper-evil", "/usr/bin/temper-evil", "/temper-evil", "/tmp/inside-only"):
        assert not Path(path).exists()
    harness = next(service.data_dir.glob("instance-*/grader/harness.py"))
    assert harness.read_bytes() == (Path(__file__).parents[2] / "services/temper/sandbox/harness.py").read_bytes()


def test_reading_host_secrets(client, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-7f3a9")
    source = f"""
import os
for path in [{str(secret)!r}, "/etc/shadow", "/root/.bash_history", "/proc/1/environ", "/work/../../etc/shadow"]:
    try:
        print(path, open(path, "rb").read()[:200])
    except OSError as e:
        print(path, "denied", type(e).__name__)
for d in [{str(tmp_path)!r}, "/root", "/home", "/", "/etc", "/proc"]:
    try:
        print(d, sorted(os.listdir(d))[:50])
    except OSError as e:
        print(d, "denied", type(e).__name__)
"""
    resp = client.execute(source, wall_seconds=10)
    assert verdict(resp) == "OK", resp.stderr
    assert b"TOP-SECRET" not in resp.stdout + resp.stderr
    assert f"{secret} denied".encode() in resp.stdout
    assert b"shadow" not in resp.stdout.split(b"/etc [")[-1].split(b"]")[0]


def test_network_is_unreachable(client):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    accepted = []
    stop = threading.Event()

    def accept():
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    host_ip = socket.gethostbyname(socket.gethostname())
    source = f"""
import socket
for host in ["127.0.0.1", {host_ip!r}, "10.0.2.2", "8.8.8.8"]:
    s = socket.socket()
    s.settimeout(2)
    try:
        s.connect((host, {port}))
        print("CONNECTED", host)
    except OSError as e:
        print("tcp", host, type(e).__name__)
try:
    print("RESOLVED", socket.getaddrinfo("pypi.org", 443))
except OSError as e:
    print("dns", type(e).__name__)
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
try:
    u.sendto(b"x", ("8.8.8.8", 53))
    print("SENT udp")
except OSError as e:
    print("udp", type(e).__name__)
"""
    try:
        resp = client.execute(source, wall_seconds=20)
    finally:
        stop.set()
        thread.join()
        listener.close()
    assert verdict(resp) == "OK", resp.stderr
    assert b"CONNECTED" not in resp.stdout and b"RESOLVED" not in resp.stdout and b"SENT" not in resp.stdout, resp.stdout
    assert not accepted


def test_killing_the_parent_and_signalling_others(service, client):
    victim = subprocess.Popen(["sleep", "60"])
    try:
        source = f"""
import os, signal
for pid in [os.getppid(), 1, {victim.pid}]:
    try:
        os.kill(pid, signal.SIGKILL)
        print("KILLED", pid)
    except OSError as e:
        print("kill", pid, type(e).__name__)
killed = 0
for pid in range(2, 5000):
    if pid != os.getpid():
        try:
            os.kill(pid, signal.SIGKILL)
            killed += 1
        except OSError:
            pass
try:
    os.kill(-1, signal.SIGKILL)  # everything this uid may signal: only itself and its children
except OSError as e:
    print("kill -1", type(e).__name__)
print("survived", killed)
"""
        resp = client.execute(source, wall_seconds=20)
        assert verdict(resp) == "OK", (resp.message, resp.stderr)
        assert b"KILLED" not in resp.stdout and b"survived 0" in resp.stdout, resp.stdout
        assert victim.poll() is None, "a host process was killed"
    finally:
        victim.kill()
        victim.wait()
    assert_host_recovered(service, client)


def test_nothing_persists_between_executions(client, mode):
    first = """
import os, subprocess
open("/tmp/left-behind", "w").write("x")
open("/work/left-behind", "w").write("x")
subprocess.Popen(["sleep", "1000"], start_new_session=True)
print(os.getpid())
"""
    assert verdict(client.execute(first, wall_seconds=10)) == "OK"
    second = """
import os
print(os.path.exists("/tmp/left-behind"), os.path.exists("/work/left-behind"))
print(sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
"""
    resp = client.execute(second, wall_seconds=10)
    lines = resp.stdout.decode().splitlines()
    assert lines[0] == "False False"
    # the agent and this program (in batch mode also the fork server, root): nothing else
    assert len(eval(lines[1])) == (3 if mode == "batch" else 2)


def test_nothing_persists_between_test_cases(client, mode):
    source = """
import os, subprocess
print(os.path.exists("/tmp/case-marker"), len([p for p in os.listdir("/proc") if p.isdigit()]))
open("/tmp/case-marker", "w").write("x")
subprocess.Popen(["sleep", "1000"], start_new_session=True)
"""
    alive = 3 if mode == "batch" else 2
    resp = client.run_tests(source, [{"stdin": "", "expected_stdout": f"False {alive}"}] * 3, wall_seconds=10)
    assert [verdict(r) for r in resp.results] == ["OK"] * 3, [r.stdout for r in resp.results]


def test_tests_go_on_after_a_memory_kill(client):
    """A test case that blows the memory limit kills its sandbox; the next cases get a fresh one
    (the program is compiled again there)."""
    source = ("#include <stdio.h>\n#include <stdlib.h>\n#include <string.h>\n"
              "int main(void){int n; scanf(\"%d\", &n); char *p = malloc((size_t)n << 20);\n"
              "memset(p, 1, (size_t)n << 20); printf(\"%d\\n\", n + p[(size_t)n << 19] - 1);}\n")
    cases = [{"stdin": str(n), "expected_stdout": str(n)} for n in (8, 600, 16)]
    resp = client.run_tests(source, cases, "c", memory_mb=128, wall_seconds=20)
    assert [verdict(r) for r in resp.results] == ["OK", "MEMORY_LIMIT", "OK"], [r.message for r in resp.results]
