"""The one builder of RolloutGroups and trajectories for every test.

``trajectory`` makes one completion; ``rollout_group`` an unscored group of them (what the
scheduler publishes and the reward service scores); ``scored_group`` the same with rewards set
(what replay stores and the learner trains on). Token ids and logprobs are drawn from ``seed``
so groups are reproducible. ``tiny_model_group``: a fixed scored group the tiny model trains on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from temper.v1 import common_pb2


def trajectory(group_id: str = "g", index: int = 0, *, tokens: int = 2, text: str = "", version: int = 0,
               reward: float | common_pb2.Reward | None = None, temperature: float = 0.0, vocab: int = 50_000,
               rng: np.random.Generator | None = None, **fields) -> common_pb2.Trajectory:
    """One completion: ``tokens`` token ids below ``vocab`` with logprobs < 0, drawn from ``rng``;
    ``reward``: its total (status OK) or a whole Reward, None leaves it unscored; ``fields`` set (or override) any
    other Trajectory field, e.g. a malformed value a test needs."""
    rng = rng if rng is not None else np.random.default_rng(index)
    t = common_pb2.Trajectory(trajectory_id=f"{group_id}/{index}", group_id=group_id, policy_version=version,
                              prompt_token_ids=[1, 2, 3], completion_token_ids=rng.integers(0, vocab, tokens).tolist(),
                              completion_logprobs=(-rng.random(tokens) - 1e-3).tolist(), completion_text=text,
                              sampling_temperature=temperature)
    if isinstance(reward, common_pb2.Reward):
        t.reward.CopyFrom(reward)
    elif reward is not None:
        t.reward.CopyFrom(common_pb2.Reward(total=float(reward), status=common_pb2.REWARD_STATUS_OK))
    for name, value in fields.items():
        if isinstance(value, list | tuple):
            t.ClearField(name)
            getattr(t, name).extend(value)
        elif hasattr(value, "CopyFrom"):
            getattr(t, name).CopyFrom(value)
        else:
            setattr(t, name, value)
    return t


def rollout_group(domain: str = "toy.copy", reference: str = "", texts: Sequence[str] | None = None, *,
                  group_id: str = "g", prompt: str = "", metadata: Mapping[str, str] | None = None,
                  n: int | None = None, tokens: int | Sequence[int] = 0, version: int = 0,
                  rewards: Sequence[float] | None = None, seed: int = 0, job_id: str = "", step: int = 0,
                  trajectories: Sequence[common_pb2.Trajectory] | None = None) -> common_pb2.RolloutGroup:
    """``n`` trajectories (default: one per text in ``texts``, else 2) of ``tokens`` completion tokens
    each (an int, or one count per trajectory); ``rewards``: one total per trajectory (status OK),
    None leaves them unscored; ``trajectories``: these instead (e.g. from ``trajectory``)."""
    if trajectories is None:
        n = len(texts) if texts is not None else (n if n is not None else 2)
        counts = [tokens] * n if isinstance(tokens, int) else list(tokens)
        assert len(counts) == n and (rewards is None or len(rewards) == n), "one count / reward per trajectory"
        rng = np.random.default_rng(seed)
        trajectories = [trajectory(group_id, k, tokens=counts[k], text=texts[k] if texts is not None else "",
                                   version=version, reward=None if rewards is None else rewards[k], rng=rng)
                        for k in range(n)]
    return common_pb2.RolloutGroup(group_id=group_id, job_id=job_id, step=step, trajectories=list(trajectories),
                                   task=common_pb2.Task(domain=domain, prompt=prompt, reference_answer=reference,
                                                        metadata=dict(metadata or {})))


def scored_group(group_id: str, n: int = 2, domain: str = "toy.copy", version: int = 0, tokens: int = 2,
                 seed: int = 0, rewards: Sequence[float] | None = None) -> common_pb2.RolloutGroup:
    """A scored group of ``n`` trajectories; rewards alternate 0, 1, 0, ... unless given."""
    return rollout_group(domain, group_id=group_id, n=n, tokens=tokens, version=version, seed=seed,
                         rewards=rewards if rewards is not None else [float(k % 2) for k in range(n)])


def tiny_model_group(group_id: str) -> common_pb2.RolloutGroup:
    """Two answers (rewards 1 and 0) of fixed tokens in the tiny model's vocabulary (temper.models.tiny), for
    learner steps on it."""
    def traj(reward):
        return common_pb2.Trajectory(prompt_token_ids=[2, 5, 6], completion_token_ids=[7, 3],
                                     completion_logprobs=[-1.0, -0.5], sampling_temperature=1.0,
                                     reward=common_pb2.Reward(total=reward, status=common_pb2.REWARD_STATUS_OK))
    return common_pb2.RolloutGroup(group_id=group_id, job_id="j", trajectories=[traj(1.0), traj(0.0)])
