"""Every command block of the README runs, as a reader would type it, so the README cannot rot.

Blocks (```bash and ```python fences) run in order in one working folder of their own: it holds a
link to each top-level entry of the checkout (``.venv``, ``services``, ...), so the README's paths work,
while what the blocks write (``runs/``, ``.temper/``, ``my-job.toml``) stays out of the checkout; what one
block starts the next may use, and a stack left up is stopped by PID at the end. ``bash`` blocks run
with ``bash -euo pipefail``, ``python`` blocks as a file with the project's interpreter; both with this
checkout's ``services``/``clients`` first on ``PYTHONPATH``. A python block's ``print(...)  # TEXT``
lines are its expected output: each TEXT must appear in its stdout, in order.

A block preceded by ``<!-- readme-test: skip REASON -->`` does not run; the reason is required and is
shown as the test's skip reason. Running a block starts processes, so these tests are in the
``slow`` tier (`make test-rest`); the checks of the README's markers are fast.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from temper.runtime.launcher import Launcher

REPO = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"(?:<!-- readme-test: (?P<mark>\w+)(?: (?P<reason>[^>]*))? -->\n)?```(?P<lang>bash|python)\n"
                   r"(?P<body>.*?)```", re.S)
EXPECT = re.compile(r"^\s*print\(.*\)\s+# (?P<text>.+)$", re.M)
MARKS = ("", "skip")
WRITTEN = {"runs", ".temper"}  # what the blocks write: never linked from the checkout


@dataclass
class Block:
    lang: str
    body: str
    mark: str
    reason: str
    line: int

    @property
    def expected(self) -> list[str]:
        return [m["text"].strip() for m in EXPECT.finditer(self.body)] if self.lang == "python" else []


def blocks(text: str) -> list[Block]:
    return [Block(m["lang"], m["body"], m["mark"] or "", (m["reason"] or "").strip(), text[:m.start()].count("\n") + 1)
            for m in FENCE.finditer(text)]


README_BLOCKS = blocks((REPO / "README.md").read_text())


def test_the_readme_has_command_blocks_that_run():
    runnable = [b for b in README_BLOCKS if not b.mark]
    assert len(runnable) >= 8 and any(b.lang == "python" for b in runnable)


def test_every_marker_is_known_and_a_skip_says_why():
    for b in README_BLOCKS:
        assert b.mark in MARKS, f"README.md line {b.line}: unknown readme-test mark {b.mark!r}"
        if b.mark == "skip":
            assert len(b.reason) >= 20, f"README.md line {b.line}: a skipped block must say why"
    text = (REPO / "README.md").read_text()
    assert text.count("<!-- readme-test:") == sum(1 for b in README_BLOCKS if b.mark), \
        "a readme-test marker that is not right before a ```bash or ```python fence"


def test_the_harness_parses_markers_and_expected_output():
    text = ("<!-- readme-test: skip needs a GPU node -->\n```bash\nnvidia-smi\n```\n\n```python\n"
            "print(6 * 7)   # 42\nx = 1  # not output\n```\n")
    skipped, program = blocks(text)
    assert (skipped.mark, skipped.reason, skipped.line) == ("skip", "needs a GPU node", 1)
    assert (program.mark, program.lang, program.expected, program.line) == ("", "python", ["42"], 6)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """The readers' folder: the checkout's top-level entries linked in; stopped by PID after the last block."""
    work = tmp_path_factory.mktemp("readme")
    for entry in REPO.iterdir():
        if entry.name not in WRITTEN and entry.name != ".git":
            (work / entry.name).symlink_to(entry)
    yield work
    Launcher(home=work / ".temper").down()


def _run(block: Block, work: Path, index: int) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TEMPER_HOME" and not k.startswith("TEMPER_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "services"), str(REPO / "clients"),
                                         *filter(None, [os.environ.get("PYTHONPATH")])])
    if block.lang == "bash":
        argv = ["bash", "-euo", "pipefail", "-c", block.body]
    else:
        program = work / f"readme_block_{index}.py"
        program.write_text(block.body)
        argv = [sys.executable, str(program)]
    return subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=1200)


def _params():
    out = []
    for i, b in enumerate(README_BLOCKS):
        marks = [pytest.mark.slow] if not b.mark else [pytest.mark.skip(reason=f"README.md line {b.line}: {b.reason}")]
        out.append(pytest.param(i, b, id=f"line{b.line}-{b.lang}", marks=marks))
    return out


@pytest.mark.parametrize(("index", "block"), _params())
def test_readme_block(index: int, block: Block, workdir):
    p = _run(block, workdir, index)
    where = f"README.md line {block.line} ({block.lang})"
    assert p.returncode == 0, (f"{where} failed with {p.returncode}:\n{block.body}\n--- stdout\n{p.stdout[-3000:]}\n"
                               f"--- stderr\n{p.stderr[-3000:]}")
    rest = p.stdout
    for text in block.expected:
        assert text in rest, f"{where}: expected output {text!r} not in (the rest of) its stdout:\n{p.stdout[-3000:]}"
        rest = rest[rest.index(text) + len(text):]
