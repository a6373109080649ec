"""The serving version over inference replicas (temper.scheduler.replicas)."""

from __future__ import annotations

import pytest

from temper.scheduler.replicas import Chunk, ReplicaMismatch, chunk_seed, generate_split, lowest_version, plan_chunks
from temper.runtime.errors import FailedPrecondition
from temper.scheduler.core import Job, JobSpec
from temper.v1 import inference_pb2


def _info(version, vocab=64, lineage="run-a", model="m"):
    return inference_pb2.GetPolicyVersionResponse(policy_version=version, vocab_size=vocab, lineage=lineage,
                                                  model=model)


def test_the_serving_version_is_the_lowest_replicas():
    assert lowest_version({"a:1": _info(5), "b:1": _info(4), "c:1": _info(5)}) == 4
    # a replica never updated (the base model, no lineage yet) is behind, not foreign
    assert lowest_version({"a:1": _info(3), "b:1": _info(0, lineage="")}) == 0


def test_another_models_vocabulary_names_the_replica():
    with pytest.raises(ReplicaMismatch, match=r"replica b:1 serves a vocabulary of 99 tokens, the others 64") as e:
        lowest_version({"a:1": _info(2), "b:1": _info(2, vocab=99, model="other"), "c:1": _info(2)})
    assert e.value.field == "replica b:1"


def test_another_lineage_names_the_replica():
    with pytest.raises(ReplicaMismatch, match=r"replica c:1 serves version 9 of lineage run-b"):
        lowest_version({"a:1": _info(2), "b:1": _info(2), "c:1": _info(9, lineage="run-b")})


def test_no_replica_answered():
    with pytest.raises(ValueError):
        lowest_version({})


# --- one step split over replicas (plan_chunks, generate_split) -------------------------------------------


def test_chunks_keep_every_prompt_once_in_order_and_differ_by_at_most_one():
    for prompts in range(1, 12):
        for replicas in range(1, 6):
            chunks = plan_chunks(prompts, replicas, step_seed=7)
            assert len(chunks) == min(prompts, replicas)
            assert [i for c in chunks for i in range(c.first, c.first + c.count)] == list(range(prompts))
            assert max(c.count for c in chunks) - min(c.count for c in chunks) <= 1
            assert len({c.seed for c in chunks}) == len(chunks)  # distinct seeds within a step
    assert [(c.first, c.count) for c in plan_chunks(5, 2, 0)] == [(0, 3), (3, 2)]  # the larger first


def test_one_replica_is_one_chunk_with_the_steps_own_seed():
    assert plan_chunks(16, 1, step_seed=1234) == [Chunk(0, 16, 1234)]
    assert plan_chunks(16, 3, step_seed=None)[1].seed is None  # an unseeded step stays unseeded
    # deterministic: the same step and first prompt, the same seed; another step, another one
    assert chunk_seed(1234, 6) == chunk_seed(1234, 6) != chunk_seed(1235, 6)


class _Down(Exception):
    pass


def _replica(address, version, calls, fail=False):
    """A replica that answers each prompt with a completion naming it (``fail``: it is down)."""
    def generate(part, seed):
        calls.append((address, list(part), seed))
        if fail:
            raise _Down(address)
        return inference_pb2.GenerateResponse(policy_version=version, results=[
            inference_pb2.PromptResult(completions=[inference_pb2.Completion(text=f"{p}@{address}")]) for p in part])
    return generate


def _texts(split):
    return [c.completions[0].text for r in split.responses for c in r.results]


def test_a_step_is_split_over_every_replica_and_put_back_in_prompt_order():
    calls = []
    prompts = [f"p{i}" for i in range(7)]
    replicas = {a: _replica(a, v, calls) for a, v in [("b:1", 4), ("a:1", 5), ("c:1", 4)]}
    split = generate_split(prompts, 99, replicas, retryable=lambda e: isinstance(e, _Down))
    # chunk i on the i-th replica in sorted order: deterministic
    assert _texts(split) == ["p0@a:1", "p1@a:1", "p2@a:1", "p3@b:1", "p4@b:1", "p5@c:1", "p6@c:1"]
    assert split.served_by == ["a:1", "b:1", "c:1"]
    assert split.prompts_per_replica() == {"a:1": 3, "b:1": 2, "c:1": 2}
    assert [r.policy_version for r in split.responses] == [5, 4, 4]  # each chunk keeps its replica's version
    assert sorted((a, s) for a, _, s in calls) == sorted(zip(["a:1", "b:1", "c:1"], [c.seed for c in split.chunks]))
    assert split.chunks[0].seed == 99
    assert dict(split.calls) == {"a:1": 1, "b:1": 1, "c:1": 1} and not split.failed


def test_one_replica_is_one_call_with_the_steps_seed():
    calls = []
    split = generate_split(["x", "y", "z"], 5, {"a:1": _replica("a:1", 0, calls)}, retryable=lambda e: True)
    assert calls == [("a:1", ["x", "y", "z"], 5)]
    assert _texts(split) == ["x@a:1", "y@a:1", "z@a:1"]


def test_a_failed_replicas_chunk_goes_to_another_and_no_group_is_lost_or_doubled():
    calls = []
    replicas = {"a:1": _replica("a:1", 3, calls), "b:1": _replica("b:1", 3, calls, fail=True),
                "c:1": _replica("c:1", 3, calls)}
    prompts = [f"p{i}" for i in range(6)]
    split = generate_split(prompts, 1, replicas, retryable=lambda e: isinstance(e, _Down))
    texts = _texts(split)
    assert [t.split("@")[0] for t in texts] == prompts  # each prompt once, in order
    assert texts[2:4] == ["p2@c:1", "p3@c:1"]  # b's chunk was answered by the next replica, with its own seed
    assert split.served_by == ["a:1", "c:1", "c:1"]
    assert dict(split.failed) == {"b:1": 1}
    assert [s for a, part, s in calls if part == ["p2", "p3"]] == [split.chunks[1].seed] * 2


def test_every_replica_failing_fails_the_step_with_its_error():
    replicas = {a: _replica(a, 0, [], fail=True) for a in ("a:1", "b:1")}
    with pytest.raises(_Down):
        generate_split(["p0", "p1"], 0, replicas, retryable=lambda e: isinstance(e, _Down))


def test_an_error_that_is_not_retryable_fails_the_step_at_once():
    calls = []
    replicas = {"a:1": _replica("a:1", 0, calls, fail=True), "b:1": _replica("b:1", 0, calls)}
    with pytest.raises(_Down):
        generate_split(["p0", "p1"], 0, replicas, retryable=lambda e: False)
    assert [a for a, _, _ in calls].count("a:1") == 1  # never retried


def test_a_replica_answering_too_few_results_is_named():
    def short(part, seed):
        return inference_pb2.GenerateResponse(results=[inference_pb2.PromptResult()])
    with pytest.raises(FailedPrecondition, match="replica b:1 answered 1 results for 2 prompts"):
        generate_split(["p0", "p1", "p2", "p3"], 0, {"a:1": _replica("a:1", 0, []), "b:1": short},
                       retryable=lambda e: True)


def _chunked_generate(versions):
    """A job's generate that answers a step as one response per replica's chunk (``versions``: each chunk's)."""
    def generate(prompts, s, seed):
        chunks = plan_chunks(len(prompts), len(versions), seed)
        return [inference_pb2.GenerateResponse(policy_version=v, results=[inference_pb2.PromptResult(
            prompt_token_ids=[1], completions=[inference_pb2.Completion(text=prompts[c.first + j], token_ids=[1],
                                                                        logprobs=[-0.1]) for _ in range(s.group_size)])
            for j in range(c.count)]) for c, v in zip(chunks, versions)]
    return generate


def test_a_split_steps_groups_keep_their_prompts_order_and_each_its_chunks_version():
    spec = JobSpec(job_id="j", steps=1, prompts_per_step=5, group_size=3, domains=["toy.copy"])
    published = []
    job = Job(spec, _chunked_generate([7, 6]), published.append, lambda: 7)
    job.run_step(0)
    assert [g.group_id for g in published] == [f"j/s0/p{i}" for i in range(5)]
    for g in published:
        assert {t.completion_text for t in g.trajectories} == {g.task.prompt}  # its own prompt's completions
        assert len({t.policy_version for t in g.trajectories}) == 1  # a group never mixes versions
    assert [g.trajectories[0].policy_version for g in published] == [7, 7, 7, 6, 6]


def test_a_step_answered_short_fails_instead_of_losing_a_group():
    spec = JobSpec(job_id="j", steps=1, prompts_per_step=4, group_size=1, domains=["toy.copy"])

    def short(prompts, s, seed):
        return _chunked_generate([1, 1])(prompts, s, seed)[:1]
    with pytest.raises(FailedPrecondition, match="inference answered 2 results for 4 prompts"):
        Job(spec, short, lambda g: None, lambda: 1).run_step(0)
