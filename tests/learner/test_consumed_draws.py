"""Exactly once over replay's at-least-once leases: the learner loop drops a draw it consumed already (the same
group id and times_sampled: a draw given back and made again), trains a deliberate re-draw of a reuse table
(times_sampled counts up), remembers its draws in its checkpoints, and a learner resumed from a checkpoint
forgets the draws after it (their updates died with the old process), so those train again. In process, the
tiny model, no replay."""

from temper.learner.loop import CONSUMED_FILE, LearnerLoop
from temper.learner.trainer import Trainer, TrainerConfig
from temper.models.tiny import build_tiny_model
from temper.v1 import replay_pb2
from tests.builders import tiny_model_group as group


def draw(gid: str, times: int) -> replay_pb2.SampleInfo:
    return replay_pb2.SampleInfo(group_id=gid, times_sampled=times, importance_weight=1.0)


def loop_of(model_dir, ckpt) -> LearnerLoop:
    return LearnerLoop(Trainer(model_dir, TrainerConfig()), replay=None, replicas=[], producer=None, groups_per_step=2,
                       checkpoint_dir=ckpt)


def test_a_draw_consumed_already_is_dropped_a_new_draw_of_the_same_group_trains(tmp_path):
    model_dir = build_tiny_model(tmp_path / "m", seed=0)
    loop = loop_of(model_dir, tmp_path / "ckpt")
    first = loop.train_on([group("a"), group("b")], info=[draw("a", 1), draw("b", 1)])
    assert first.step == 1 and first.group_ids == ["a", "b"] and first.values["dropped_duplicate"] == 0
    # the batch again (its acknowledgement was lost): nothing trains, the loop moves on
    assert loop.train_on([group("b"), group("a")], info=[draw("b", 1), draw("a", 1)]) is None
    assert loop.state.step == 1 and loop.state.dropped_by_reason == {"duplicate": 2}
    assert loop.state.skipped_batches == 0  # not a bad batch
    # half of it again, with a new group: the new one trains, the copy is counted
    mixed = loop.train_on([group("a"), group("c")], info=[draw("a", 1), draw("c", 1)])
    assert mixed.step == 2 and mixed.group_ids == ["c"] and mixed.values["dropped_duplicate"] == 1
    assert mixed.values["dropped_groups"] == 1 and mixed.samples == 2
    # a reuse table's second draw of "a" (times_sampled 2) is a new draw: it trains
    assert loop.train_on([group("a")], info=[draw("a", 2)]).group_ids == ["a"]
    # without replay's draw info (a caller training on groups directly) nothing is deduplicated
    assert loop.train_on([group("a")]).step == 4


def test_checkpoints_carry_the_consumed_draws_and_a_resumed_learner_forgets_the_later_ones(tmp_path):
    model_dir = build_tiny_model(tmp_path / "m", seed=0)
    ckpt = tmp_path / "ckpt"
    loop = loop_of(model_dir, ckpt)
    loop.train_on([group("a"), group("b")], info=[draw("a", 1), draw("b", 1)])
    path, step, _ = loop.checkpoint()
    assert step == 1 and (path / CONSUMED_FILE).exists()
    loop.train_on([group("c"), group("d")], info=[draw("c", 1), draw("d", 1)])  # dies before its checkpoint

    again = loop_of(model_dir, ckpt)
    assert again.resume_from_checkpoint() and again.state.step == 1
    assert again.train_on([group("a"), group("b")], info=[draw("a", 1), draw("b", 1)]) is None  # in step 1
    redone = again.train_on([group("c"), group("d")], info=[draw("c", 1), draw("d", 1)])  # its update was lost
    assert redone.step == 2 and redone.group_ids == ["c", "d"]
