"""Fixtures of the learner's tests: the tiny model (seed 0) and toy batches it generated."""

import random

import pytest
import torch

from temper.inference.engine import HFEngine
from temper.models.tiny import build_tiny_model
from tests.learner.toyloop import generate_batch


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def batches(model_dir):
    engine = HFEngine(model_dir)
    rng = random.Random(0)
    out = [generate_batch(engine, rng, groups=8, group_size=4, seed=i) for i in range(3)]
    for b in out:  # the untrained model rarely earns a reward: give every step a learning signal
        b.rewards = torch.tensor([float(rng.random() < 0.4) for _ in b.rewards])
    return out
