"""Job configurations shipped with Temper, loaded as package resources (``temper run --job NAME``).

Each is a complete TOML file: a ``[job]`` table for the scheduler plus one table per service.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

DEFAULT = "toy"


def names() -> list[str]:
    return sorted(p.name.removesuffix(".toml") for p in resources.files(__name__).iterdir()
                  if p.name.endswith(".toml"))


def path(name: str = DEFAULT) -> Path:
    """The file of the shipped job ``name`` (a real file: the package is installed unzipped)."""
    if name not in names():
        raise ValueError(f"unknown job {name!r}; shipped jobs: {', '.join(names())}")
    return Path(str(resources.files(__name__) / f"{name}.toml"))
