"""Prioritized replay in the loop, as real processes (broker, inference, replay, learner).

The learner samples a prioritized table with replacement, applies the draws' importance
weights, and after each step sends every group's mean |advantage| as its new priority. A group
whose rewards are all equal has no learning signal: its priority becomes 0 and the table never
draws it again, while groups with a signal keep being drawn.
"""

from collections import Counter

import pytest

from temper.client.sdk import InferenceClient, LearnerClient, ReplayClient
from temper.runtime.launcher import Launcher, pid_alive
from tests.conftest import wait_until
from tests.learner.test_service import make_groups

CONFIG = """
[model]
preset = "tiny"
dir = "{model_dir}"

[learner]
epochs = 1
groups_per_step = 4
priority_signal = "mean_abs_advantage"

[replay]
ingest_tables = []

[replay.tables.default]
sampler = "prioritized"
max_times_sampled = 0
priority_exponent = 1.0
importance_sampling_exponent = 1.0
seed = 3

[inference]
engine = "hf"
"""
STEPS = 20  # 80 draws: a flat group escapes them all with probability < (7/8)^80 ~ 2e-5


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    base = tmp_path_factory.mktemp("learner-prio")
    config = base / "temper.toml"
    config.write_text(CONFIG.format(model_dir=base / "model"))
    launcher = Launcher(home=base / "home", config=config)
    state = launcher.up(["inference", "replay", "learner"])
    yield launcher
    pids = [p.pid for p in launcher.load().services.values()] + [state.broker.pid]
    launcher.down()
    assert not [p for p in pids if pid_alive(p)], "processes left behind"


def test_learner_priorities_move_sampling(stack):
    addr = {n: p.address for n, p in stack.load().services.items()}
    inference, replay, learner = (InferenceClient(addr["inference"]), ReplayClient(addr["replay"]),
                                  LearnerClient(addr["learner"]))
    groups = make_groups(inference, 8, seed=11, job_id="prio")
    flat, signal = groups[:4], groups[4:]
    for g in flat:  # every sample scored alike: advantages 0
        for t in g.trajectories:
            t.reward.total = 0.0
    for g in signal:  # one sample of four rewarded
        for k, t in enumerate(g.trajectories):
            t.reward.total = 1.0 if k == 0 else 0.0
    assert replay.insert(groups).inserted == 8
    wait_until(lambda: learner.status().step >= STEPS, 300, what=f"{STEPS} learner steps")
    learner.pause()
    draws = replay.sample_batch(256, timeout_ms=10_000)  # with replacement: the table's distribution now
    drawn = Counter(i.group_id for i in draws.info)
    priority = {i.group_id: i.priority for i in draws.info}
    assert not drawn.keys() & {g.group_id for g in flat}, f"flat groups drawn after their update: {drawn}"
    assert drawn.keys() == {g.group_id for g in signal}, drawn
    # the learner's signal replaced the insert-time priority (1.0), and the weights follow it
    assert all(p > 0 and p != 1.0 for p in priority.values()), priority
    p_min = min(priority.values())
    for i in draws.info:
        assert abs(i.importance_weight - p_min / i.priority) < 1e-9  # (p_min / p_i) ** (alpha * beta), both 1
    learner.resume()
