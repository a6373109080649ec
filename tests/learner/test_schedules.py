"""LR schedules, the KL back-off of the LR, and the adaptive KL coefficient, by hand."""

import math

import pytest

from temper.learner.schedules import KLController, LRController, lr_factor


def test_warmup_then_constant_linear_cosine():
    assert [lr_factor(s, "constant", 4, 0, 0.0) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    # decay over steps 4..14 (10 steps): half way at step 9
    assert lr_factor(4, "linear", 4, 14, 0.0) == 1.0
    assert math.isclose(lr_factor(9, "linear", 4, 14, 0.0), 0.5)
    assert math.isclose(lr_factor(9, "cosine", 4, 14, 0.0), 0.5)
    assert math.isclose(lr_factor(6, "cosine", 4, 14, 0.0), 0.5 * (1 + math.cos(math.pi * 0.2)))
    assert lr_factor(14, "linear", 4, 14, 0.0) == 0.0
    assert math.isclose(lr_factor(100, "cosine", 4, 14, 0.1), 0.1)  # floor after the end
    assert math.isclose(lr_factor(9, "linear", 4, 14, 0.2), 0.6)
    with pytest.raises(ValueError):
        lr_factor(5, "exponential", 0, 10, 0.0)


def test_lr_backs_off_while_kl_overshoots_and_recovers_up_to_the_schedule():
    c = LRController(base_lr=1e-3, kl_target=0.01, factor=2.0, min_scale=0.1)
    assert c.lr(0) == 1e-3
    c.observe_kl(0.05)  # > 2 x target: halve
    assert math.isclose(c.lr(0), 5e-4)
    c.observe_kl(0.015)  # within [target / 2, 2 x target]: keep
    assert math.isclose(c.lr(0), 5e-4)
    for _ in range(10):
        c.observe_kl(1.0)
    assert math.isclose(c.scale, 0.1)  # floor
    for _ in range(10):
        c.observe_kl(0.001)  # < target / 2: grow back, never above the schedule
    assert c.scale == 1.0
    off = LRController(base_lr=1e-3)
    off.observe_kl(100.0)
    assert off.scale == 1.0
    c.scale = 0.25
    restored = LRController(base_lr=1e-3)
    restored.load_state_dict(c.state_dict())
    assert restored.scale == 0.25


def test_adaptive_kl_coefficient_follows_ziegler():
    c = KLController(coef=0.1, target=0.01, horizon=100)
    c.update(kl=0.02, n=10)  # error clip(2 - 1) = 0.2 -> beta * (1 + 0.2 * 10 / 100)
    assert math.isclose(c.coef, 0.1 * 1.02)
    c.update(kl=0.005, n=10)  # error -0.5 -> clipped to -0.2
    assert math.isclose(c.coef, 0.1 * 1.02 * 0.98)
    c.update(kl=0.011, n=100)  # error 0.1, n = horizon
    assert math.isclose(c.coef, 0.1 * 1.02 * 0.98 * 1.1)
    fixed = KLController(coef=0.1)
    fixed.update(kl=5.0, n=1000)
    assert fixed.coef == 0.1
