"""A program's verdict in the sandbox equals what running it unsandboxed gives.

Real programs in all four languages (correct and incorrect solutions, runtime errors, compile
errors, timeouts), each against its test cases, through RunTests; the reference is the same
commands run as bare subprocesses on the host with the same interpreter and compilers.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from temper.sandbox.config import SandboxConfig
from temper.sandbox.core import OutputMatch, outputs_match
from temper.client.sdk import verdict_name
from temper.v1 import sandbox_pb2
from tests.sandbox.helpers import verdict

LANGUAGES = SandboxConfig().language_presets()
HOST_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/tmp"}
WALL = 3.0

SUM = [("1 2\n", "3\n"), ("10 -4\n", "6\n"), ("100000 100000\n", "200000\n")]
NUMBERS = " ".join(str((i * 7919) % 10007) for i in range(5000))
SORT = [(f"5000\n{NUMBERS}\n", " ".join(str(x) for x in sorted((i * 7919) % 10007 for i in range(5000))) + "\n")]
ADD_TESTS = ["assert add(1, 2) == 3\nassert add(-5, 5) == 0\n", "assert add(10**20, 1) == 10**20 + 1\n"]

PROGRAMS = [
    # python3, stdin/stdout
    ("python3", "sum", "a, b = map(int, input().split())\nprint(a + b)\n", SUM),
    ("python3", "wrong", "a, b = map(int, input().split())\nprint(a - b)\n", SUM),
    ("python3", "trailing-space", "a, b = map(int, input().split())\nprint(a + b, end=' \\n\\n')\n", SUM),
    ("python3", "sort", "input()\nprint(*sorted(map(int, input().split())))\n", SORT),
    ("python3", "zero-division", "a, b = map(int, input().split())\nprint(a // (b - b))\n", SUM),
    ("python3", "syntax-error", "def f(:\n    pass\n", SUM[:1]),
    ("python3", "recursion", "def f(n):\n    return f(n + 1)\nf(0)\n", SUM[:1]),
    ("python3", "exit-3", "import sys\nprint(3)\nsys.exit(3)\n", SUM[:1]),
    ("python3", "timeout", "while True:\n    pass\n", SUM[:1]),
    ("python3", "slow-on-big-input", "a, b = map(int, input().split())\nwhile a > 1000:\n    pass\nprint(a + b)\n",
     SUM),
    # python3, assertion scripts
    ("python3", "asserts-correct", "def add(a, b):\n    return a + b\n", ADD_TESTS),
    ("python3", "asserts-wrong", "def add(a, b):\n    return a * b if a < 10 else a + b\n", ADD_TESTS),
    ("python3", "asserts-raises", "def add(a, b):\n    return a + b + None\n", ADD_TESTS),
    ("python3", "asserts-missing-function", "def plus(a, b):\n    return a + b\n", ADD_TESTS),
    # c
    ("c", "sum", "#include <stdio.h>\nint main(void){long a,b;scanf(\"%ld %ld\",&a,&b);printf(\"%ld\\n\",a+b);}\n", SUM),
    ("c", "wrong", "#include <stdio.h>\nint main(void){long a,b;scanf(\"%ld %ld\",&a,&b);printf(\"%ld\\n\",a*b);}\n", SUM),
    ("c", "segfault", "#include <stdio.h>\nint main(void){int *p = 0; printf(\"%d\\n\", *p);}\n", SUM[:1]),
    ("c", "compile-error", "int main(void) { return undefined_name; }\n", SUM[:1]),
    ("c", "exit-1", "int main(void) { return 1; }\n", SUM[:1]),
    ("c", "timeout", "int main(void) { volatile int x = 0; for (;;) x++; }\n", SUM[:1]),
    ("c", "math", "#include <stdio.h>\n#include <math.h>\nint main(void){double a,b;scanf(\"%lf %lf\",&a,&b);"
                  "printf(\"%.0f\\n\", round(sqrt(a*a)) + b);}\n", SUM),
    # cpp
    ("cpp", "sort", "#include <bits/stdc++.h>\nint main(){int n;std::cin>>n;std::vector<int> v(n);for(auto&x:v)std::cin>>x;"
                    "std::sort(v.begin(),v.end());for(int i=0;i<n;i++)std::cout<<v[i]<<(i+1<n?' ':'\\n');}\n", SORT),
    ("cpp", "wrong", "#include <iostream>\nint main(){long a,b;std::cin>>a>>b;std::cout<<a-b<<std::endl;}\n", SUM),
    ("cpp", "throws", "#include <stdexcept>\nint main(){throw std::runtime_error(\"boom\");}\n", SUM[:1]),
    ("cpp", "compile-error", "#include <vector>\nint main(){std::vector<int> v = 5;}\n", SUM[:1]),
    ("cpp", "timeout", "int main(){volatile long x=0; while(true) x++;}\n", SUM[:1]),
    # bash
    ("bash", "sum", "read a b\necho $((a + b))\n", SUM),
    ("bash", "wrong", "read a b\necho $((a * b))\n", SUM),
    ("bash", "exit-1", "echo partial\nexit 1\n", SUM[:1]),
    ("bash", "syntax-error", "if then fi\n", SUM[:1]),
    ("bash", "timeout", "while :; do :; done\n", SUM[:1]),
]


def bare_verdicts(language: str, source: str, tests: list) -> list[str]:
    """The verdicts of running the program unsandboxed: the same commands, as bare subprocesses."""
    lang = LANGUAGES[language]
    with tempfile.TemporaryDirectory() as d:
        Path(d, lang.source_file).write_text(source)
        if lang.compile:
            compiled = subprocess.run(list(lang.compile), cwd=d, env=HOST_ENV, capture_output=True)
            if compiled.returncode != 0:
                return ["COMPILE_ERROR"]
        out = []
        for test in tests:
            if isinstance(test, str):  # assertion script: program + tests, one Python file
                Path(d, "combined.py").write_text(source + "\n" + test)
                command, stdin, expected = ["python3", "combined.py"], b"", None
            else:
                command, stdin, expected = list(lang.run), test[0].encode(), test[1].encode()
            try:
                p = subprocess.run(command, cwd=d, env=HOST_ENV, input=stdin, capture_output=True, timeout=WALL)
            except subprocess.TimeoutExpired:
                out.append("TIMEOUT")
                continue
            if p.returncode != 0:
                last = p.stderr.rstrip().rsplit(b"\n", 1)[-1]
                out.append("WRONG_ANSWER" if expected is None and last.startswith(b"AssertionError") else "RUNTIME_ERROR")
            elif expected is not None and not outputs_match(p.stdout, expected, OutputMatch.TRAILING_WHITESPACE):
                out.append("WRONG_ANSWER")
            else:
                out.append("OK")
        return out


def sandbox_verdicts(client, language: str, source: str, tests: list) -> list[str]:
    cases = [t if isinstance(t, str) else {"stdin": t[0], "expected_stdout": t[1]} for t in tests]
    resp = client.run_tests(source, cases, language, wall_seconds=WALL)
    if resp.compile_verdict != sandbox_pb2.VERDICT_OK:
        return [verdict_name(resp.compile_verdict)]
    return [verdict(r) for r in resp.results]


@pytest.fixture(scope="module")
def both(client):
    """Every program run both ways, in parallel (2 sandboxes run, 2 wait: within the service's queue)."""
    with ThreadPoolExecutor(4) as pool:
        sandboxed = list(pool.map(lambda p: sandbox_verdicts(client, p[0], p[2], p[3]), PROGRAMS))
    with ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        bare = list(pool.map(lambda p: bare_verdicts(p[0], p[2], p[3]), PROGRAMS))
    return {f"{p[0]}/{p[1]}": (s, b) for p, s, b in zip(PROGRAMS, sandboxed, bare)}


@pytest.mark.parametrize("name", [f"{p[0]}/{p[1]}" for p in PROGRAMS])
def test_verdict_equals_unsandboxed(both, name):
    sandboxed, bare = both[name]
    assert sandboxed == bare


def test_the_battery_covers_every_verdict_kind(both):
    seen = {v for s, _ in both.values() for v in s}
    assert {"OK", "WRONG_ANSWER", "RUNTIME_ERROR", "COMPILE_ERROR", "TIMEOUT"} <= seen


def test_compile_once_run_many(client):
    source = "#include <stdio.h>\nint main(void){long a,b;scanf(\"%ld %ld\",&a,&b);printf(\"%ld\\n\",a+b);}\n"
    resp = client.run_tests(source, [{"stdin": i, "expected_stdout": o} for i, o in SUM * 3], "c")
    assert resp.passed == 9 and verdict(resp.compile) == "OK"
    assert resp.compile.wall_seconds > 0  # one compilation, reported once


def test_compile_error_carries_the_compiler_message(client):
    resp = client.execute("int main(void) { return undefined_name; }\n", "c")
    assert verdict(resp) == "COMPILE_ERROR"
    assert b"undefined_name" in resp.stderr and b"error" in resp.stderr


def test_exact_output_match(client):
    source = "print('3 ')\n"
    loose = client.run_tests(source, [{"stdin": "", "expected_stdout": "3\n"}])
    exact = client.run_tests(source, [{"stdin": "", "expected_stdout": "3\n"}], exact_output=True)
    assert verdict(loose.results[0]) == "OK" and verdict(exact.results[0]) == "WRONG_ANSWER"


def test_execute_reports_what_happened(client):
    resp = client.execute("import sys\nprint(input().upper())\nprint('warn', file=sys.stderr)\nsys.exit(4)\n",
                          stdin="shout\n")
    assert verdict(resp) == "RUNTIME_ERROR" and resp.exit_code == 4 and resp.message == "exit status 4"
    assert resp.stdout == b"SHOUT\n" and resp.stderr == b"warn\n"
    assert 0 < resp.wall_seconds < 5 and 0 < resp.cpu_seconds < 5 and resp.peak_memory_bytes > 1 << 20
    killed = client.execute("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n")
    assert verdict(killed) == "RUNTIME_ERROR" and killed.signal == 11 and "SIGSEGV" in killed.message


def test_multiple_files_and_command(client):
    resp = client.execute(None, "python3", files={"main.py": "import helper\nhelper.hello()\n",
                                                  "helper.py": "def hello():\n    print('from helper')\n"})
    assert verdict(resp) == "OK" and resp.stdout == b"from helper\n"
    resp = client.execute(None, "", files={"run.sh": "echo $1"}, command=["bash", "run.sh", "arg"])
    assert verdict(resp) == "OK" and resp.stdout == b"arg\n"


PYTHON_FIDELITY = {
    "main module": (
        "import sys, __main__\nprint(__name__, __file__, sys.argv, sys.path[0], __spec__, __package__,\n"
        "      type(__loader__).__name__, __doc__, __main__.__dict__ is globals())\n"
        "print(sorted(k for k in globals() if k.startswith('__')))\n"),
    "exit paths": (
        "import atexit, sys, threading, time\natexit.register(lambda: print('atexit ran'))\n"
        "threading.Thread(target=lambda: (time.sleep(0.2), print('thread finished'))).start()\n"
        "sys.exit('bye')\n"),
    "traceback": "def f(x):\n    return 1 / x\n\nprint('before')\nf(0)\n",
    "syntax error": "print('never'\n",
    "exit code": "import sys\nsys.stdout.write('partial')\nsys.exit(3)\n",
    "keyboard interrupt": "raise KeyboardInterrupt\n",
    "stdin": "import sys\ndata = sys.stdin.read().split()\nprint(sum(map(int, data)), input if data else None)\n",
}


@pytest.mark.parametrize("source", PYTHON_FIDELITY.values(), ids=PYTHON_FIDELITY.keys())
def test_python_runs_like_python3_main_py(client, source):
    """Python runs go through the pre-started harness; what the program sees and shows is the same."""
    stdin = b"1 2 3\n"
    with tempfile.TemporaryDirectory() as d:
        Path(d, "main.py").write_text(source)
        bare = subprocess.run(["python3", "main.py"], cwd=d, env=HOST_ENV, input=stdin, capture_output=True)
        expected = [x.replace(d.encode(), b"/work") for x in (bare.stdout, bare.stderr)]
    resp = client.execute(source, stdin=stdin)
    code = -resp.signal if resp.signal else resp.exit_code
    assert (code, resp.stdout, resp.stderr) == (bare.returncode, *expected)
