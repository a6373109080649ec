import random

import pytest

from temper.reward.core import score_group, score_or_mark
from temper.runtime.errors import InvalidArgument
from temper.tasks import toy
from temper.v1 import common_pb2


@pytest.mark.parametrize("domain", sorted(toy.GENERATORS))
def test_generated_answers_are_right(domain):
    rng = random.Random(1)
    for _ in range(50):
        task = toy.make_task(domain, rng, "t")
        words = task.prompt.split()
        digits = [int(w) for w in words if w.isdigit()]
        expected = {"toy.copy": digits[-1], "toy.next": (digits[-1] + 1) % 10, "toy.add": sum(digits)}[domain]
        assert task.reference_answer == str(expected)


def test_exact_answer_reward():
    assert toy.exact_answer_reward("7", "7") == 1.0
    assert toy.exact_answer_reward(" 7 3", "7") == 1.0  # answer = first word
    assert toy.exact_answer_reward("3 7", "7") == 0.0
    assert toy.exact_answer_reward("", "7") == 0.0
    assert toy.exact_answer_reward("77", "7") == 0.0


def _group(domain="toy.copy", reference="4", texts=("4", "5")):
    return common_pb2.RolloutGroup(group_id="g1", task=common_pb2.Task(domain=domain, reference_answer=reference),
                                   trajectories=[common_pb2.Trajectory(completion_text=t) for t in texts])


def test_score_group_sets_components_and_total():
    scored = score_group(_group())
    assert [t.reward.total for t in scored.trajectories] == [1.0, 0.0]
    comp = scored.trajectories[0].reward.components[0]
    assert comp.name == "exact_answer" and comp.status == common_pb2.REWARD_STATUS_OK


@pytest.mark.parametrize("group,field", [
    (_group(domain="nope"), "group.task.domain"),
    (_group(reference=""), "group.task.reference_answer"),
    (_group(texts=()), "group.trajectories"),
])
def test_bad_groups_name_the_field(group, field):
    with pytest.raises(InvalidArgument) as e:
        score_group(group)
    assert e.value.field == field
    marked = score_or_mark(group)
    assert all(t.reward.status == common_pb2.REWARD_STATUS_ERROR for t in marked.trajectories)


def test_task_registry_dispatches_every_family():
    from temper import tasks

    names = tasks.domains()
    assert {"toy.copy", "math.inequality", "code.fibonacci", "rg.countdown"} <= set(names)
    assert "rg.composite" not in names  # needs a list of families to mix
    rng = random.Random(0)
    for domain in ("toy.next", "math.fraction_sum", "code.sum_numbers", "rg.basic_arithmetic"):
        task = tasks.make_task(domain, rng, "t")
        assert task.domain == domain and task.prompt
    for bad in ("nope", "math.nope", "rg.nope", ""):
        with pytest.raises(InvalidArgument) as e:
            tasks.make_task(bad, rng, "t")
        assert e.value.field == "domains"


def test_oversized_completion_names_the_trajectory():
    g = _group(texts=("4", "x" * (2 << 20)))
    with pytest.raises(InvalidArgument) as e:
        score_group(g)
    assert e.value.field == "group.trajectories[1].completion_text"
