"""Generates the protobuf code into the package before setuptools collects it (build_protos.py).

The build environment has grpcio-tools (pyproject's build-system.requires); the .proto files
are the repository's protos/ (or a protos/ folder beside this file, in an sdist).
"""

import sys
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import build_protos  # noqa: E402

build_protos.generate(HERE.parent / "protos" if (HERE.parent / "protos").is_dir() else HERE / "protos", HERE)
setup()
