"""The SDK (clients/temper/client) is a leaf: it imports nothing of the services and no torch, and
installs and imports alone from its own declared dependencies."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

CLIENT = REPO / "clients" / "temper" / "client"
ALLOWED_TEMPER = ("temper.client", "temper.v1")  # its own package and the generated code it ships


def _imports(path: Path) -> list[tuple[str, int]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: stays inside temper.client
                continue
            found.append((node.module or "", node.lineno))
    return found


def test_the_sdk_imports_nothing_of_the_services():
    sources = sorted(CLIENT.rglob("*.py"))
    assert sources, CLIENT
    bad = [f"{p.relative_to(REPO)}:{line}: {name}" for p in sources for name, line in _imports(p)
           if (name == "temper" or name.startswith("temper.")) and not name.startswith(ALLOWED_TEMPER)
           or name.split(".")[0] in ("torch", "transformers", "vllm", "numpy")]
    assert not bad, bad


@pytest.mark.slow
def test_the_client_package_installs_and_imports_alone(tmp_path):
    """``pip install ./clients`` into a fresh venv (its declared dependencies, from the machine's
    package index), then the SDK imports without torch."""
    # a copy (pip builds in the source tree, leaving build/ behind); protos/ beside it, as in the repository
    for folder in ("clients", "protos"):
        shutil.copytree(REPO / folder, tmp_path / "src" / folder, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    pip = subprocess.run([str(py), "-m", "pip", "install", "-q", str(tmp_path / "src" / "clients")],
                         capture_output=True, text=True, timeout=600)
    assert pip.returncode == 0, pip.stdout[-3000:] + pip.stderr[-3000:]
    check = subprocess.run([str(py), "-c", "import sys, temper.client.sdk, temper.v1.sandbox_pb2; "
                            "assert 'torch' not in sys.modules, 'torch imported'; print(temper.client.sdk.__file__)"],
                           capture_output=True, text=True, timeout=120, cwd=tmp_path, env={"PATH": "/usr/bin:/bin"})
    assert check.returncode == 0, check.stderr
    assert str(venv) in check.stdout  # the installed copy, not the source tree
