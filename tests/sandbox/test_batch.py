"""Batch mode: the programs of a RunTestsBatch group run one after the other in one gVisor sandbox.

What must hold: each program runs as its own uid in its own private workdir, and a program can
neither observe nor affect the others, nor their verdicts: files (workdir, /tmp, /dev/shm,
HOME), background processes, signals and ptrace, System V IPC, environment, a filled /tmp, the
harness nonce of a sibling. Verdicts in a group equal those of each program run alone in the
isolated mode, and those of the same commands run bare on the host.
"""

from __future__ import annotations

import json

import grpc
import pytest

from temper.client.sdk import SandboxClient, verdict_name
from temper.v1 import sandbox_pb2
from tests.sandbox.helpers import verdict
from tests.sandbox.test_correctness import PROGRAMS, WALL, bare_verdicts
from tests.sandbox.test_harness import ATTACKS, HONEST, WRONG_TEST

pytestmark = pytest.mark.slow  # real sandbox services, in both modes

UID_BASE = 10000

# Program A of a group: leaves everything it can behind, for the programs after it to find.
LEAVER = r"""
import ctypes, json, os, socket, subprocess
libc = ctypes.CDLL(None, use_errno=True)
left = {}
def attempt(name, f):
    try:
        f()
        left[name] = "ok"
    except OSError as e:
        left[name] = type(e).__name__
def write(path, data=b"secret-of-A"):
    with open(path, "wb") as f:
        f.write(data)
attempt("work", lambda: write("/work/secret-A"))
attempt("tmp", lambda: write("/tmp/secret-A"))
attempt("shm", lambda: write("/dev/shm/secret-A"))
attempt("home", lambda: write(os.path.expanduser("~/secret-A")))
attempt("fifo", lambda: os.mkfifo("/tmp/fifo-A"))
def fill():
    with open("/tmp/filler", "wb") as f:
        while True:
            f.write(b"x" * (1 << 20))
            f.flush()
attempt("fill /tmp", fill)
os.environ["SECRET_A"] = "leaked"
os.putenv("SECRET_A", "leaked")
# System V IPC objects open to everyone (mode 0666), at fixed keys
left["shmget"] = libc.shmget(0x7E3A, 4096, 0o1000 | 0o666)
left["msgget"] = libc.msgget(0x7E3B, 0o1000 | 0o666)
left["semget"] = libc.semget(0x7E3C, 1, 0o1000 | 0o666)
# background processes: a plain child, a new session, a double-forked daemon holding a socket
subprocess.Popen(["sleep", "1000"])
subprocess.Popen(["sleep", "1000"], start_new_session=True)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        s = socket.socket(socket.AF_UNIX)
        s.bind("\0temper-secret-A")
        s.listen()
        while True:
            s.accept()
    os._exit(0)
print(json.dumps(left))
"""

# Program B: reports what it can see of the others and what it can do to them.
PROBE = r"""
import ctypes, json, os, signal, socket
libc = ctypes.CDLL(None, use_errno=True)
me = os.getpid()
seen = {"uid": os.getuid(), "cwd": os.getcwd(), "cwd_mode": oct(os.stat(".").st_mode & 0o777),
        "cwd_owner": os.stat(".").st_uid}
seen["files"] = sorted(p for d in ("/work", "/tmp", "/dev/shm", os.path.expanduser("~"))
                       for p in (os.path.join(d, n) for n in os.listdir(d)) if p != "/work/main.py")
seen["env"] = {k: v for k, v in os.environ.items() if k not in ("PATH", "HOME", "TMPDIR", "LANG")}
seen["shmget"] = libc.shmget(0x7E3A, 0, 0)
seen["msgget"] = libc.msgget(0x7E3B, 0)
seen["semget"] = libc.semget(0x7E3C, 0, 0)
try:
    s = socket.socket(socket.AF_UNIX)
    s.connect("\0temper-secret-A")
    seen["abstract socket"] = "connected"
except OSError as e:
    seen["abstract socket"] = type(e).__name__
others = {}
for p in os.listdir("/proc"):
    if p.isdigit() and int(p) != me:
        status = open(f"/proc/{p}/status").read()
        uid = int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])
        others[int(p)] = uid
seen["other uids"] = sorted(set(others.values()))
seen["other processes"] = len(others)
signalled = ptraced = mem = 0
environs = []
for pid in others:
    try:
        os.kill(pid, 0)
        signalled += 1
    except OSError:
        pass
    if libc.ptrace(16, pid, 0, 0) == 0:
        ptraced += 1
    try:
        with open(f"/proc/{pid}/mem", "rb") as f:
            mem += 1
    except OSError:
        pass
    try:  # gVisor shows other uids' environ (Linux would not): it must hold nothing of any program
        environs.append(open(f"/proc/{pid}/environ", "rb").read().decode())
    except OSError:
        pass
seen["signalled"], seen["ptraced"], seen["mem opened"] = signalled, ptraced, mem
seen["their environ"] = sorted(environs)
with open("/tmp/room", "wb") as f:  # a full /tmp left by another program would stop this
    f.write(b"y" * (32 << 20))
seen["tmp room"] = "32 MiB written"
print(json.dumps(seen, sort_keys=True))
"""


def batch(client: SandboxClient, sources: list[str], tests: list, language: str = "python3", **kw):
    resp = client.run_tests_batch(sources, tests, language, **kw)
    assert len(resp.results) == len(sources)
    return resp


def test_each_program_runs_as_its_own_uid_in_a_private_workdir(batch_client):
    resp = batch(batch_client, [PROBE] * 3, [{"stdin": "", "expected_stdout": ""}], wall_seconds=20)
    assert resp.execution_mode == "batch"
    seen = [json.loads(r.results[0].stdout) for r in resp.results]
    assert [s["uid"] for s in seen] == [UID_BASE, UID_BASE + 1, UID_BASE + 2]
    for i, s in enumerate(seen):
        assert (s["cwd"], s["cwd_mode"], s["cwd_owner"]) == ("/work", "0o700", UID_BASE + i)
        # the others are the agent and the fork server, both root and out of reach
        assert s["other uids"] == [0] and s["other processes"] == 2
        assert (s["signalled"], s["ptraced"], s["mem opened"]) == (0, 0, 0), s
        assert all(set(e.split("\0")) <= {"", "PATH=/usr/local/bin:/usr/bin:/bin", "LANG=C.UTF-8", "HOME=/root",
                                           "HOME=/work", "TMPDIR=/tmp"} for e in s["their environ"]), s


def test_programs_of_a_group_cannot_observe_or_affect_each_other(batch_client):
    """A leaves files, processes, IPC objects, environment and a full /tmp behind; the probes
    after it see exactly what the probe before it saw."""
    resp = batch(batch_client, [PROBE, LEAVER, PROBE, PROBE], [{"stdin": "", "expected_stdout": ""}],
                 wall_seconds=20)
    outcomes = [(verdict(r.results[0]), r.results[0].message) for r in resp.results]
    assert [v for v, _ in outcomes] == ["WRONG_ANSWER"] * 4, outcomes  # they print; nothing expected
    left = json.loads(resp.results[1].results[0].stdout)
    # A really did leave all of it (else the probes prove nothing); /dev/shm is root's, not A's
    assert {k: left[k] for k in ("work", "tmp", "home", "fifo")} == dict.fromkeys(("work", "tmp", "home", "fifo"),
                                                                                  "ok")
    assert left["shm"] == "PermissionError" and left["fill /tmp"] == "OSError", left  # ENOSPC: /tmp was full
    assert min(left["shmget"], left["msgget"], left["semget"]) >= 0, left
    before, *after = (json.loads(r.results[0].stdout) for r in (resp.results[0], resp.results[2], resp.results[3]))
    for i, seen in enumerate(after):
        for key in ("uid", "cwd_owner"):
            seen.pop(key)
            before.pop(key, None)
        assert seen == before, (i, seen, before)
    assert before["files"] == [] and before["env"] == {}
    assert before["shmget"] == before["msgget"] == before["semget"] == -1
    assert before["abstract socket"] == "ConnectionRefusedError"


def test_verdicts_in_a_group_equal_those_of_each_program_alone(batch_client, client):
    """The harness attacks, honest programs and broken ones, interleaved in one group: each gets the
    verdict it gets alone in its own sandbox (isolated mode); the attacks never pass."""
    programs = []
    for attack, honest in zip(ATTACKS.values(), list(HONEST.values()) * 3):
        programs += [attack, honest]
    tests = [WRONG_TEST, "assert add(2, 2) == 4\nassert add(-1, 1) == 0\n"]
    resp = batch(batch_client, programs, tests, wall_seconds=20)
    grouped = [[verdict(r) for r in res.results] for res in resp.results]
    alone = [[verdict(r) for r in client.run_tests(p, tests, wall_seconds=20).results] for p in programs]
    assert grouped == alone
    for i, v in enumerate(grouped):
        assert v[0] != "OK", (i, programs[i])  # add(2, 2) == 5 never passes
        if i % 2:
            assert v[1] == "OK" or "Sum(" in programs[i], (i, programs[i])


def test_correctness_battery_in_one_group(batch_client):
    """All four languages in one group (compiles and timeouts included): as unsandboxed."""
    by_language = {}
    for language, name, source, tests in PROGRAMS:
        by_language.setdefault(language, []).append((name, source, tests))
    for language, programs in by_language.items():
        reqs = []
        for _, source, tests in programs:
            cases = [t if isinstance(t, str) else {"stdin": t[0], "expected_stdout": t[1]} for t in tests]
            reqs.append(SandboxClient.tests_request(source, cases, language, wall_seconds=WALL))
        resp = batch_client.stub.RunTestsBatch(sandbox_pb2.RunTestsBatchRequest(programs=reqs), timeout=300)
        for (name, source, tests), res in zip(programs, resp.results):
            got = ([verdict_name(res.compile_verdict)] if res.compile_verdict != sandbox_pb2.VERDICT_OK
                   else [verdict(r) for r in res.results])
            assert got == bare_verdicts(language, source, tests), f"{language}/{name}"


def test_a_program_killing_the_sandbox_does_not_fail_the_others(batch_client):
    bomb = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))\n"
    spin = "while True:\n    pass\n"
    ok = "print(input())\n"
    resp = batch(batch_client, [ok, bomb, ok, spin, ok], [{"stdin": "hi", "expected_stdout": "hi"}],
                 wall_seconds=2, memory_mb=128)
    assert [verdict(r.results[0]) for r in resp.results] == ["OK", "MEMORY_LIMIT", "OK", "TIMEOUT", "OK"], \
        [r.results[0].message for r in resp.results]


def test_isolated_mode_runs_each_program_of_a_batch_in_its_own_sandbox(client):
    resp = batch(client, ["import os\nprint(os.getuid())\n", "print(1 / 0)\n", "print(2)\n"],
                 [{"stdin": "", "expected_stdout": "2"}])
    assert resp.execution_mode == "isolated"
    assert [verdict(r.results[0]) for r in resp.results] == ["WRONG_ANSWER", "RUNTIME_ERROR", "OK"]
    assert resp.results[0].results[0].stdout == b"65534\n"


def _request(n: int = 1, **program) -> sandbox_pb2.RunTestsBatchRequest:
    one = SandboxClient.tests_request("print(1)", ["assert True"])
    reqs = [sandbox_pb2.RunTestsRequest() for _ in range(n)]
    for r in reqs:
        r.CopyFrom(one)
    for key, value in program.items():
        setattr(reqs[-1].program, key, value)
    return sandbox_pb2.RunTestsBatchRequest(programs=reqs)


BAD_BATCH = {
    "no programs": (sandbox_pb2.RunTestsBatchRequest(), "programs"),
    "too many programs": (_request(65), "programs"),
    "unknown language in the second": (_request(2, language="cobol"), "programs[1].program.language"),
    "no tests": (sandbox_pb2.RunTestsBatchRequest(programs=[sandbox_pb2.RunTestsRequest(
        program=SandboxClient.request("print(1)"))]), "programs[0].tests"),
}


@pytest.mark.parametrize("mode", ["isolated", "batch"])
@pytest.mark.parametrize("request_, field", BAD_BATCH.values(), ids=BAD_BATCH.keys())
def test_bad_batch_request(request, mode, request_, field):
    c = request.getfixturevalue("client" if mode == "isolated" else "batch_client")
    with pytest.raises(grpc.RpcError) as e:
        c.stub.RunTestsBatch(request_, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(f"{field}:"), e.value.details()


def test_a_group_answer_fits_one_message(batch_client):
    """Five programs printing 15 MiB each (75 MiB, above gRPC's 64 MiB): judged on all of it, the
    group's kept output is capped as one call's (48 MiB), later programs truncated."""
    loud = "import sys\nsys.stdout.write('x' * (15 << 20))\n"
    resp = batch(batch_client, [loud] * 5, [{"stdin": "", "expected_stdout": "x" * 10}], wall_seconds=30,
                 max_output_bytes=16 << 20)
    results = [r.results[0] for r in resp.results]
    assert [verdict(r) for r in results] == ["WRONG_ANSWER"] * 5
    assert sum(len(r.stdout) + len(r.stderr) for r in results) <= 48 << 20
    assert not results[0].output_truncated and results[-1].output_truncated
