"""Fixtures for replay tests that run the real service (`python -m temper.replay` started by the
launcher, next to a real broker)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def replay_model_dir(tmp_path_factory) -> Path:
    """One tiny-model folder for every replay launcher (the launcher builds it once; replay never loads it)."""
    return tmp_path_factory.mktemp("replay-model") / "tiny"
