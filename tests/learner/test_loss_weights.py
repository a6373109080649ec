"""A group's multi-task loss weight (RolloutGroup.loss_weight, set by the scheduler) multiplies into the
per-group sample weights the trainer applies to the policy loss; a bad one leaves the group out."""

import pytest

from temper.learner.batching import batch_from_groups, screen_groups
from temper.runtime.errors import InvalidArgument
from tests.builders import scored_group


def test_loss_weights_multiply_replays_importance_weights():
    a, b, c = scored_group("a"), scored_group("b"), scored_group("c")
    a.loss_weight, b.loss_weight = 2.0, 0.0  # 0: unset
    assert batch_from_groups([a, b, c], [0.5, 1.0, 0.25]).sample_weights.tolist() == [1.0, 1.0, 0.25]
    assert batch_from_groups([a, b, c]).sample_weights.tolist() == [2.0, 1.0, 1.0]
    b.loss_weight = 0.0
    assert batch_from_groups([b, c]).sample_weights is None  # nothing set: the trainer's unweighted path


@pytest.mark.parametrize("weight", [float("nan"), -1.0, float("inf")])
def test_a_bad_loss_weight_is_refused_naming_the_field(weight):
    a, b = scored_group("a"), scored_group("b")
    b.loss_weight = weight
    with pytest.raises(InvalidArgument) as e:
        batch_from_groups([a, b])
    assert e.value.field == "groups[1].loss_weight"
    kept, dropped = screen_groups([a, b])
    assert [g.group_id for g in kept] == ["a"] and dropped[0].field == "groups[1].loss_weight"
