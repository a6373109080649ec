"""Fixtures for replay tests that run the real service (`python -m temper.replay` started by the
launcher, next to a real broker)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def replay_model_dir(tmp_path_factory) -> Path:
    """The [model] dir of the replay launchers' configs: replay declares no model_dir, so nothing is built there."""
    return tmp_path_factory.mktemp("replay-model") / "tiny"
