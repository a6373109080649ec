"""score_group / score_or_mark: components and totals, bad groups named by field (no service)."""

import pytest

from temper.reward.core import score_group, score_or_mark
from temper.runtime.errors import InvalidArgument
from temper.v1 import common_pb2
from tests.builders import rollout_group


def _group(domain="toy.copy", reference="4", texts=("4", "5")):
    return rollout_group(domain, reference, list(texts), group_id="g1")


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


def test_oversized_completion_names_the_trajectory():
    g = _group(texts=("4", "x" * (2 << 20)))
    with pytest.raises(InvalidArgument) as e:
        score_group(g)
    assert e.value.field == "group.trajectories[1].completion_text"
