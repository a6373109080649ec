"""Code problems with the user's own test suites: a folder of tests, run by the sandbox, is the reward.

A ``data.<name>`` domain whose verifier is ``tests.pass_fraction`` or ``tests.all_pass`` (or whose
``format`` is ``tests``) draws its problems from ``path``, either

- a folder of problems, one subfolder each (or ``path`` itself is one problem)::

      problems/
        add/
          prompt.md          # the prompt (``prompt_file``; default prompt.md, else prompt.txt)
          tests/             # the tests folder (``tests_dir``)
            test_add.py      # tests: test_*.py and *_test.py, at any depth
            helpers.py       # any other file is copied beside them (support code, data, conftest.py)

- or a ``.jsonl`` file, one problem per row: ``prompt_field`` holds the prompt, ``tests_field``
  (default ``tests``) the problem's tests folder (relative to the JSONL file's folder).

The completion's code is written as ``solution_file`` (default ``solution.py``) next to the tests in
the sandbox's workdir; a test imports it (``from solution import add``) or uses its names directly.

**How the tests run.** The sandbox's Python is the host's ``/usr/bin/python3`` seen read-only through
the sandbox's ``binds``; pytest is not installed there (checked with the real sandbox in
tests/reward/test_suites.py), so the tests do not go through pytest. Each test runs under the sandbox's
assertion harness (``temper.sandbox.harness``) on a fresh copy of the workdir:

- a test file that defines top-level ``test_*`` functions gives one test per function (the file's top
  level runs first, then the function);
- a file without any is one test (a plain assert script);
- a test passes only if it exits 0 *and* runs to its end: the harness's nonce check, so a solution
  that calls ``os._exit(0)`` or ``sys.exit(0)`` on import, or an always-equal object, passes nothing.

What pytest alone gives is refused when the folder is loaded, naming the file: ``import pytest``,
test functions with parameters (fixtures), ``unittest`` test cases (``unittest.main()`` exits early, so
it could never pass).

The task's ``reference_answer`` carries the whole suite as JSON (``pack``), so the reward service needs
nothing from the job's disk: ``{"solution_file", "files": {path: text}, "tests": [[file, function]],
"wall_seconds"}`` (function "" = the whole file). ``temper.reward.verifiers.suites`` reads it.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

from temper.runtime.errors import InvalidArgument, require
from temper.runtime.jsonl import jsonl_rows

VERIFIERS = ("tests.pass_fraction", "tests.all_pass")
OPTIONS = ("tests_dir", "prompt_file", "solution_file", "tests_field", "wall_seconds")
PROMPT_FILES = ("prompt.md", "prompt.txt")
MAX_FILES = 60  # the sandbox takes 64 files a request: these, main.py and the solution
MAX_SUITE_BYTES = 512 << 10  # the sandbox takes 1 MiB of files a request: the rest is the solution's
MAX_TESTS = 256  # [reward.code] max_tests' default
MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\.py")


def uses_suites(config: dict) -> bool:
    """Whether a data domain's table declares a tests-folder domain (by its verifier, tests.*, or format)."""
    return str(config.get("verifier", "")).startswith("tests.") or config.get("format") == "tests"


def instruction(config: dict) -> str:
    """What is appended to every prompt unless the table sets ``instruction``."""
    return (f"Answer with the complete Python file {config.get('solution_file', 'solution.py')} in a ```python "
            "code block.")


def check_options(config: dict, field: str) -> None:
    """InvalidArgument naming the option for a bad value of this module's options."""
    require(config.get("verifier") in VERIFIERS, f"{field}.verifier",
            f"a tests-folder domain (format tests) is scored by one of {list(VERIFIERS)}, got "
            f"{config.get('verifier')!r}")
    require(config.get("format", "auto") in ("auto", "tests"), f"{field}.format",
            f"the verifier {config['verifier']} scores a tests-folder domain: format must be 'tests' (or 'auto'), "
            f"got {config.get('format')!r}")
    for option in ("tests_dir", "prompt_file", "solution_file", "tests_field"):
        if option in config:
            require(isinstance(config[option], str) and bool(config[option].strip()), f"{field}.{option}",
                    f"must be a non-empty string, got {config[option]!r}")
    solution = config.get("solution_file", "solution.py")
    require(MODULE_NAME.fullmatch(solution) is not None, f"{field}.solution_file",
            f"must be a Python module file name such as solution.py (tests import it), got {solution!r}")
    wall = config.get("wall_seconds", 0)
    require(isinstance(wall, int | float) and not isinstance(wall, bool) and wall >= 0, f"{field}.wall_seconds",
            f"must be a number of seconds >= 0 (0: the sandbox's default), got {wall!r}")
    for option in ("split", "eval_split"):
        require(option not in config, f"{field}.{option}", "a tests-folder domain has no splits (use eval_fraction "
                                                           "or eval_path)")


def problems(path: Path, config: dict, field: str, what: str = "path") -> list[tuple[str, str, str]]:
    """(prompt, packed suite, where) per problem of ``path`` (a folder of problems or a JSONL file);
    ``field``: the domain's table, ``what``: the option naming ``path`` (path or eval_path)."""
    if path.is_dir():
        return _folder_problems(path, config, field, what)
    require(path.suffix.lower() in (".jsonl", ".ndjson"), f"{field}.{what}",
            f"{path} is a file: a tests-folder domain reads a folder of problems or a .jsonl file of them")
    return _jsonl_problems(path, config, field, what)


def _folder_problems(path: Path, config: dict, field: str, what: str) -> list[tuple[str, str, str]]:
    dirs = [path] if _prompt_file(path, config) else sorted(d for d in path.iterdir() if d.is_dir())
    out = []
    for d in dirs:
        prompt_path = _prompt_file(d, config)
        if prompt_path is None:
            if d.name.startswith("."):
                continue
            wanted = config.get("prompt_file") or " or ".join(PROMPT_FILES)
            raise InvalidArgument(f"problem folder {d} has no prompt file ({wanted})", field=f"{field}.prompt_file")
        prompt = _text(prompt_path, f"{field}.prompt_file").strip()
        require(bool(prompt), f"{field}.prompt_file", f"{prompt_path} is empty")
        tests = d / config.get("tests_dir", "tests")
        out.append((prompt, pack(tests, config, f"{field}.tests_dir"), f"problem {d.name} ({d})"))
    require(bool(out), f"{field}.{what}", f"{path} holds no problem folders (each: a {PROMPT_FILES[0]} and a "
                                        f"{config.get('tests_dir', 'tests')}/ folder)")
    return out


def _jsonl_problems(path: Path, config: dict, field: str, what: str) -> list[tuple[str, str, str]]:
    prompt_field = config.get("prompt_field")
    require(bool(prompt_field), f"{field}.prompt_field", "required: the column of the JSONL file holding the prompt")
    tests_field = config.get("tests_field", "tests")
    out = []
    rows = jsonl_rows(_text(path, f"{field}.{what}").splitlines(), lambda n, line_no, e: InvalidArgument(
        f"{path} row {n} (line {line_no}): not JSON: {e}", field=f"{field}.{what}"))
    for n, line_no, row in rows:
        where = f"{path} row {n} (line {line_no})"
        require(isinstance(row, dict), f"{field}.{what}", f"{where}: a row must be an object of fields")
        prompt, tests = row.get(prompt_field), row.get(tests_field)
        require(isinstance(prompt, str) and bool(prompt.strip()), f"{field}.prompt_field",
                f"{where}: {prompt_field!r} must be a non-empty string (its fields: {sorted(row)})")
        require(isinstance(tests, str) and bool(tests.strip()), f"{field}.tests_field",
                f"{where}: {tests_field!r} must name the problem's tests folder (its fields: {sorted(row)})")
        folder = Path(tests).expanduser()
        folder = folder if folder.is_absolute() else path.parent / folder
        out.append((prompt.strip(), pack(folder, config, f"{field}.tests_field", where),
                    f"row {n} (line {line_no})"))
    require(bool(out), f"{field}.{what}", f"{path} has no rows")
    return out


def _prompt_file(d: Path, config: dict) -> Path | None:
    names = [config["prompt_file"]] if config.get("prompt_file") else PROMPT_FILES
    return next((d / n for n in names if (d / n).is_file()), None)


def _text(path: Path, field: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise InvalidArgument(f"{path} is not UTF-8 text (the sandbox gets the tests folder as text)",
                              field=field) from None


def is_test_file(name: str) -> bool:
    return name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py"))


def pack(folder: Path, config: dict, field: str, where: str = "") -> str:
    """The suite of one tests folder as the task's reference_answer (JSON; see the module doc)."""
    at = f"{where}: " if where else ""
    require(folder.is_dir(), field, f"{at}no tests folder {folder}")
    solution = config.get("solution_file", "solution.py")
    files: dict[str, str] = {}
    tests: list[list[str]] = []
    size = 0
    for p in sorted(f for f in folder.rglob("*") if f.is_file()):
        rel = p.relative_to(folder).as_posix()
        if "__pycache__" in rel.split("/") or rel.endswith(".pyc"):
            continue
        require(rel not in (solution, "main.py"), field,
                f"{at}{p}: the tests folder may not hold {rel} (the solution is written there as {solution}, "
                "imported by main.py)")
        text = _text(p, field)
        size += len(text.encode())
        files[rel] = text
        if is_test_file(p.name):
            tests += [[rel, fn] for fn in _test_functions(text, p, field)]
    require(len(files) <= MAX_FILES, field, f"{at}{folder} holds {len(files)} files; at most {MAX_FILES}")
    require(size <= MAX_SUITE_BYTES, field, f"{at}{folder} holds {size} bytes; at most {MAX_SUITE_BYTES}")
    require(bool(tests), field, f"{at}{folder} holds no tests (test_*.py or *_test.py files)")
    require(len(tests) <= MAX_TESTS, field, f"{at}{folder} holds {len(tests)} tests; at most {MAX_TESTS}")
    return json.dumps({"solution_file": solution, "files": files, "tests": tests,
                       "wall_seconds": config.get("wall_seconds", 0)})


def _test_functions(text: str, path: Path, field: str) -> list[str]:
    """The test functions of a test file (its top-level ``test*`` functions), or [""]: the file is one test."""
    try:
        tree = ast.parse(text, str(path))
    except SyntaxError as e:
        raise InvalidArgument(f"{path} line {e.lineno}: not valid Python: {e.msg}", field=field) from None
    no_pytest = ("the sandbox's Python has no pytest: tests run as plain Python under the sandbox's assertion "
                 "harness (plain asserts; test_* functions without parameters)")
    for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        for name in names:
            top = name.split(".")[0]
            require(top != "pytest", field, f"{path} line {node.lineno} imports pytest: {no_pytest}")
            require(top != "unittest", field, f"{path} line {node.lineno} imports unittest: unittest.main() exits "
                                              f"before the harness sees the file end; {no_pytest}")
    functions = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test"):
            require(isinstance(node, ast.FunctionDef), field, f"{path} line {node.lineno}: {node.name} is async; "
                                                              "test functions must be plain functions")
            a = node.args
            require(not (a.posonlyargs or a.args or a.vararg or a.kwonlyargs or a.kwarg), field,
                    f"{path} line {node.lineno}: {node.name} takes parameters (pytest fixtures?); {no_pytest}")
            functions.append(node.name)
    return list(dict.fromkeys(functions)) or [""]  # a redefined name is one test, as in pytest
