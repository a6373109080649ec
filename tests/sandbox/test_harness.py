"""The assertion-test harness cannot be fooled into a pass, and honest programs still pass.

Every attack below runs against a test its function cannot pass honestly (add(2, 2) == 5, ...):
whatever the program does, the verdict must not be OK.
"""

from __future__ import annotations

import pytest

from tests.sandbox.helpers import verdict

WRONG_TEST = "assert add(2, 2) == 5\nassert add(1, 1) == 3\n"

ATTACKS = {
    "sys.exit(0) at import": "import sys\nsys.exit(0)\ndef add(a, b):\n    return a + b\n",
    "SystemExit(0) from the function": "def add(a, b):\n    raise SystemExit(0)\n",
    "os._exit(0) from the function": "import os\ndef add(a, b):\n    os._exit(0)\n",
    "SIGKILL itself": "import os, signal\ndef add(a, b):\n    os.kill(os.getpid(), signal.SIGKILL)\n",
    "prints fake markers": (
        "import os, sys\ndef add(a, b):\n    print('PASSED'); print('OK: all tests passed'); sys.stdout.flush()\n"
        "    os._exit(0)\n"),
    "writes fake reports to every fd": (
        "import os\ndef add(a, b):\n    for fd in range(3, 64):\n        try:\n"
        "            os.write(fd, b'PASS' + bytes(28))\n            os.write(fd, os.urandom(32))\n"
        "        except OSError:\n            pass\n    os._exit(0)\n"),
    "always-equal object": (
        "class Anything:\n    def __eq__(self, other):\n        return True\n    __hash__ = object.__hash__\n"
        "def add(a, b):\n    return Anything()\n"),
    "always-equal int subclass": (
        "class Int(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n"
        "def add(a, b):\n    return Int(a + b)\n"),
    "redefines the checker from a thread": (
        "import threading, sys\n"
        "def add(a, b):\n    return a + b\n"
        "def patch():\n    g = sys.modules['__main__'].__dict__\n    for _ in range(200000):\n"
        "        g['check'] = lambda candidate: None\n"
        "threading.Thread(target=patch, daemon=True).start()\n"),
    "replaces builtins": (
        "import builtins\nbuiltins.AssertionError = type('Nope', (Exception,), {})\n"
        "builtins.int = lambda *a: 5\ndef add(a, b):\n    return a + b\n"),
    "sys.audit(FINISH) then exit": (
        "import os, sys\ndef add(a, b):\n    sys.audit('temper.harness.finish')\n    os._exit(0)\n"),
    "gc hunt for the nonce": (
        "import gc, os\ndef add(a, b):\n    for o in gc.get_objects():\n"
        "        for cell in getattr(o, '__closure__', None) or ():\n            try:\n"
        "                v = cell.cell_contents\n            except ValueError:\n                continue\n"
        "            if isinstance(v, bytearray) and len(v) == 32:\n                os.write(4, bytes(v))\n"
        "                os._exit(0)\n    os._exit(0)\n"),  # passes if the hook did not wipe the nonce
    "frames: re-runs the harness's main": (
        "import sys, types, os\ndef add(a, b):\n    f = sys._getframe()\n    while f.f_back.f_back is not None:\n"
        "        f = f.f_back\n    fn = types.FunctionType(f.f_code, f.f_globals)\n    try:\n        fn()\n"
        "    finally:\n        os._exit(0)\n"),
    "settrace": (
        "import sys\ndef add(a, b):\n    sys.settrace(lambda *args: None)\n    return a + b\n"),
    "ctypes read of memory": (
        "import ctypes, os\ndef add(a, b):\n    ctypes.string_at(id(a), 16)\n    os._exit(0)\n"),
    "/proc/self/mem": (
        "import os\ndef add(a, b):\n    try:\n        open('/proc/self/mem', 'rb')\n    except OSError:\n        pass\n"
        "    os._exit(0)\n"),
    "ptrace from a child": (
        "import ctypes, os, sys\ndef add(a, b):\n    parent = os.getpid()\n    pid = os.fork()\n"
        "    if pid == 0:\n        libc = ctypes.CDLL(None, use_errno=True)\n"
        "        r = libc.ptrace(16, parent, 0, 0)\n"
        "        sys.stderr.write(f'attach={r} errno={ctypes.get_errno()}\\n')\n        os._exit(0)\n"
        "    os.waitpid(pid, 0)\n    return a + b\n"),
    "atexit turns the failure into exit 0": (
        "import atexit, os\natexit.register(lambda: os._exit(0))\ndef add(a, b):\n    return a + b\n"),
}


@pytest.mark.parametrize("source", ATTACKS.values(), ids=ATTACKS.keys())
def test_attack_does_not_pass(client, source):
    resp = client.run_tests(source, [WRONG_TEST], wall_seconds=20)
    assert resp.passed == 0 and verdict(resp.results[0]) != "OK", resp
    assert resp.results[0].message


def test_patched_math_does_not_pass(client):
    source = "import math\nmath.isclose = lambda *a, **k: True\ndef area(r):\n    return 0.0\n"
    resp = client.run_tests(source, ["import math\nassert math.isclose(area(1.0), 3.14159, rel_tol=1e-3)\n"])
    assert resp.passed == 0, resp


def test_always_equal_inside_containers_does_not_pass(client):
    source = ("class Anything:\n    def __eq__(self, other):\n        return True\n"
              "def pairs(n):\n    return [Anything()] * n\ndef table(n):\n    return {'k': [Anything()]}\n")
    resp = client.run_tests(source, ["assert pairs(2) == [1, 2]\n", "assert table(1) == {'k': [7]}\n"])
    assert resp.passed == 0, resp


HONEST = {
    "plain": "def add(a, b):\n    return a + b\n",
    "stdlib that inspects frames": (
        "import collections, dataclasses, enum, typing, logging, warnings\n"
        "Point = collections.namedtuple('Point', 'x y')\nColor = enum.Enum('Color', 'RED GREEN')\n"
        "T = typing.TypeVar('T')\nlogging.basicConfig(level=logging.INFO)\n"
        "def add(a, b):\n    logging.info('adding %s %s', a, b)\n    warnings.warn('careful')\n"
        "    return Point(a, b).x + Point(a, b).y\n"),
    "threads, subprocess, recursion, stdout": (
        "import subprocess, sys, threading\nsys.setrecursionlimit(10000)\n"
        "def fact(n):\n    return 1 if n < 2 else n * fact(n - 1)\n"
        "def add(a, b):\n    out = []\n    t = threading.Thread(target=lambda: out.append(a + b))\n    t.start(); t.join()\n"
        "    subprocess.run(['true'], check=True)\n    print('computing', fact(500) > 0)\n    return out[0]\n"),
    "dataclass with its own equality": (
        "import dataclasses\n@dataclasses.dataclass\nclass Sum:\n    value: int\n"
        "def add(a, b):\n    return Sum(a + b)\n"
        "def check_eq(x, y):\n    return x == y\n"),
    "program guarded by __main__": (
        "def add(a, b):\n    return a + b\nif __name__ == '__main__':\n    print('main ran')\n"),
}


@pytest.mark.parametrize("source", HONEST.values(), ids=HONEST.keys())
def test_honest_programs_pass(client, source):
    test = "assert add(2, 2) == 4\nassert add(-1, 1) == 0\n"
    if "Sum(" in source:
        test = "assert add(2, 2) == Sum(4)\nassert add(1, 1) != Sum(3)\n"
    resp = client.run_tests(source, [test], wall_seconds=20)
    assert resp.passed == 1 and verdict(resp.results[0]) == "OK", resp


def test_wrong_answer_and_runtime_error_are_told_apart(client):
    resp = client.run_tests("def add(a, b):\n    return a - b\n", ["assert add(2, 2) == 4\n", "assert add(1) == 1\n"])
    assert [verdict(r) for r in resp.results] == ["WRONG_ANSWER", "RUNTIME_ERROR"]
    assert b"AssertionError" in resp.results[0].stderr and b"TypeError" in resp.results[1].stderr
    assert b"harness" not in resp.results[0].stderr  # tracebacks show the test, not the harness


def test_stop_on_first_failure(client):
    tests = ["assert add(1, 1) == 2\n", "assert add(1, 1) == 3\n", "assert add(2, 2) == 4\n"]
    resp = client.run_tests("def add(a, b):\n    return a + b\n", tests, stop_on_first_failure=True)
    assert [verdict(r) for r in resp.results] == ["OK", "WRONG_ANSWER"] and resp.passed == 1
