"""Shipped job files edited for a test: some keys set to other values, the SmolLM2 folder by absolute path."""

from __future__ import annotations

import re
from collections.abc import Mapping

from temper.models.smollm2 import DEFAULT_DIR
from tests.conftest import REPO

MODEL = REPO / DEFAULT_DIR  # where `make setup` converts SmolLM2-135M-Instruct


def edit_job(text: str, values: Mapping[tuple[str, str], str]) -> str:
    """``text`` with each (table, key) of ``values`` set to its value (a TOML literal), every one of
    them found exactly once, and ``[model] dir`` pointing at MODEL."""
    table, out, seen = "", [], []
    for line in text.splitlines():
        if m := re.match(r"\[([^\]]+)\]\s*$", line):
            table = m.group(1)
        key = line.split("=", 1)[0].strip()
        if (table, key) in values:
            line = f"{key} = {values[(table, key)]}"
            seen.append((table, key))
        elif (table, key) == ("model", "dir"):
            line = f'dir = "{MODEL}"'
        out.append(line)
    assert sorted(seen) == sorted(values), f"keys set {seen}, asked {sorted(values)}"
    return "\n".join(out) + "\n"
