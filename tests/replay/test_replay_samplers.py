"""Samplers and removers of the in-memory table core, checked against their stated distributions.

Statistical checks use Pearson's chi-square test (scipy.stats.chisquare) on seeded draws, and
each is paired with a negative control that the same counts *reject* the nearest wrong
distribution, so the test has the power to fail.
"""

import itertools

import numpy as np
import pytest
from scipy.stats import chisquare

from temper.replay.tables import Removal, Table, TableConfig

P_OK = 1e-3  # a correct sampler fails this 1 time in 1000 seeds; the seeds here are fixed


def table(**config) -> Table:
    return Table("t", TableConfig(seed=config.pop("seed", 0), **config))


def fill(t: Table, priorities, domain: str = "d", version: int = 0, start: int = 0) -> None:
    for k, p in enumerate(priorities, start):
        t.add(k, f"g{k}", domain, version, float(p), b"x" * (k + 1), 0)


def counts(draws, n: int) -> np.ndarray:
    return np.bincount([int(d.group_id[1:]) for d in draws], minlength=n)


def test_prioritized_draws_follow_p_alpha():
    priorities, alpha = np.array([0.1, 0.5, 1.0, 2.0, 4.0, 8.0]), 0.6
    t = table(sampler="prioritized", priority_exponent=alpha, max_times_sampled=0)
    fill(t, priorities)
    draws, removed = t.sample(30_000, beta=1.0)
    assert not removed
    expected = priorities ** alpha / (priorities ** alpha).sum()
    observed = counts(draws, len(priorities))
    assert chisquare(observed, expected * len(draws)).pvalue > P_OK
    # negative control: the same draws are not what alpha = 1 (or uniform) would give
    for wrong in (priorities / priorities.sum(), np.full(6, 1 / 6)):
        assert chisquare(observed, wrong * len(draws)).pvalue < 1e-12
    # every draw reports its exact probability
    for d in draws[:100]:
        assert d.probability == pytest.approx(expected[int(d.group_id[1:])])


def test_importance_weights_follow_beta():
    priorities, alpha, beta = np.array([1.0, 2.0, 3.0, 10.0]), 0.7, 0.4
    t = table(sampler="prioritized", priority_exponent=alpha, max_times_sampled=0)
    fill(t, priorities)
    draws, _ = t.sample(200, beta=beta)
    p = priorities ** alpha / (priorities ** alpha).sum()
    w = (len(p) * p) ** -beta
    w /= w.max()  # normalised by the largest weight in the table, so in (0, 1]
    for d in draws:
        assert d.importance_weight == pytest.approx(w[int(d.group_id[1:])])
    assert max(d.importance_weight for d in draws) == pytest.approx(1.0)  # the rarest item was drawn


def test_uniform_draws_are_uniform():
    t = table(sampler="uniform", max_times_sampled=0)
    fill(t, [1, 100, 0.5, 3, 7, 1, 2, 9])  # priorities do not matter to a uniform sampler
    draws, _ = t.sample(20_000, beta=1.0)
    observed = counts(draws, 8)
    assert chisquare(observed).pvalue > P_OK
    skewed = np.array([1.1, 0.9, 1, 1, 1, 1, 1, 1]) / 8
    assert chisquare(observed, skewed * len(draws)).pvalue < 1e-6
    assert all(d.probability == pytest.approx(1 / 8) and d.importance_weight == 1.0 for d in draws)


def test_zero_priority_is_never_drawn_unless_all_are_zero():
    t = table(sampler="prioritized", priority_exponent=0.0, max_times_sampled=0)  # alpha 0: all equal but 0
    fill(t, [0.0, 1.0, 5.0])
    draws, _ = t.sample(3000, beta=1.0)
    c = counts(draws, 3)
    assert c[0] == 0 and chisquare(c[1:]).pvalue > P_OK
    t = table(sampler="prioritized", max_times_sampled=0)
    fill(t, [0.0, 0.0, 0.0])
    c = counts(t.sample(3000, beta=1.0)[0], 3)
    assert chisquare(c).pvalue > P_OK


def test_batches_draw_one_at_a_time_without_reusing_used_up_items():
    """max_times_sampled = 1: a batch of 2 from priorities (1, 2, 3) is an ordered draw without
    replacement, P(i, j) = w_i / W * w_j / (W - w_i); each draw reports that conditional probability."""
    w = np.array([1.0, 2.0, 3.0])
    pairs = list(itertools.permutations(range(3), 2))
    expected = np.array([w[i] / w.sum() * w[j] / (w.sum() - w[i]) for i, j in pairs])
    observed = np.zeros(len(pairs))
    rng_seed = itertools.count()
    for _ in range(6000):
        t = table(sampler="prioritized", max_times_sampled=1, seed=next(rng_seed))
        fill(t, w)
        (a, b), removed = t.sample(2, beta=1.0)
        i, j = int(a.group_id[1:]), int(b.group_id[1:])
        observed[pairs.index((i, j))] += 1
        assert a.probability == pytest.approx(w[i] / w.sum())
        assert b.probability == pytest.approx(w[j] / (w.sum() - w[i]))
        assert sorted(s for s, _ in removed) == sorted([i, j]) and t.items.n == 1
    assert chisquare(observed, expected * observed.sum()).pvalue > P_OK
    with_replacement = np.array([w[i] * w[j] for i, j in pairs])
    assert chisquare(observed, with_replacement / with_replacement.sum() * observed.sum()).pvalue < 1e-6


@pytest.mark.parametrize("max_times,expected", [(1, ["g0", "g1", "g2"]), (2, ["g0", "g0", "g1", "g1", "g2"])])
def test_fifo_and_lifo_order(max_times, expected):
    t = table(sampler="fifo", max_times_sampled=max_times)
    fill(t, [1, 1, 1, 1])
    draws, _ = t.sample(len(expected), beta=1.0)
    assert [d.group_id for d in draws] == expected
    assert all(d.probability == 1.0 for d in draws)
    t = table(sampler="lifo", max_times_sampled=max_times)
    fill(t, [1, 1, 1, 1])
    lifo = {"g0": "g3", "g1": "g2", "g2": "g1"}
    assert [d.group_id for d in t.sample(len(expected), beta=1.0)[0]] == [lifo[g] for g in expected]


def test_fifo_with_unlimited_samples_repeats_the_oldest():  # Reverb's semantics
    t = table(sampler="fifo", max_times_sampled=0)
    fill(t, [1, 1])
    assert [d.group_id for d in t.sample(3, beta=1.0)[0]] == ["g0"] * 3


@pytest.mark.parametrize("remover,evicted", [("fifo", 0), ("lifo", 3), ("lowest_priority", 1)])
def test_removers_evict_when_full(remover, evicted):
    t = table(remover=remover, max_size=4)
    fill(t, [5, 0.5, 0.5, 2])  # g1 and g2 tie on the lowest priority: the older one goes
    removed = t.add(10, "g10", "d", 0, 1.0, b"y", 0)
    assert removed == [(evicted, Removal.EVICTED)]
    assert t.items.n == 4 and "g10" in t.items.by_group and f"g{evicted}" not in t.items.by_group


def test_domain_quota_evicts_within_the_domain():
    t = table(remover="fifo", max_size=10, domain_quotas={"math": 2, "*": 3})
    fill(t, [1, 1], domain="math")  # g0, g1
    fill(t, [1, 1, 1], domain="code", start=2)  # g2..g4
    removed = t.add(5, "g5", "math", 0, 1.0, b"z", 0)  # math at quota: its oldest (g0) goes, not g2
    assert removed == [(0, Removal.QUOTA)]
    removed = t.add(6, "g6", "code", 0, 1.0, b"z", 0)  # "*" = 3 for code
    assert removed == [(2, Removal.QUOTA)]
    removed = t.add(7, "g7", "text", 0, 1.0, b"z", 0)  # another domain is not touched
    assert removed == []
    s = t.stats(0)
    assert s.domain_counts == {"math": 2, "code": 3, "text": 1}


def test_policy_lag_evicts_and_never_returns_stale_items():
    t = table(sampler="uniform", max_times_sampled=0, max_policy_lag=1)
    for k, v in enumerate([0, 1, 2, 2]):
        t.add(k, f"g{k}", "d", v, 1.0, b"x", 0)
    assert t.observe_version(2) == [(0, Removal.STALE)]  # version 0 < 2 - 1
    assert {d.group_id for d in t.sample(200, beta=1.0)[0]} == {"g1", "g2", "g3"}
    assert sorted(s for s, _ in t.observe_version(3)) == [1]
    assert {d.policy_version for d in t.sample(200, beta=1.0)[0]} == {2}
    assert t.observe_version(1) == [] and t.policy_version == 3  # versions never go back
