"""Process rewards in the learner: step ends mapped to tokens, the bad-group rule for step layouts,
and a real step of process_grpo on the tiny model whose advantages come from the step rewards."""

import pytest
import torch

from temper.learner.batching import batch_from_groups, screen_groups
from temper.learner.loop import LearnerLoop
from temper.learner.steps import StepTokens
from temper.learner.trainer import Trainer, TrainerConfig
from temper.models.tiny import build_tiny_model, build_tokenizer
from temper.reward.steps import split_steps, step_end_chars
from temper.v1 import common_pb2

OK = common_pb2.REWARD_STATUS_OK


@pytest.fixture(scope="module")
def tokens():
    return StepTokens(build_tokenizer())


def ids(tok, text: str) -> list[int]:
    return tok.tokenizer(text, add_special_tokens=False)["input_ids"]


def test_step_ends_map_to_the_token_that_finishes_each_step(tokens):
    # word-level tokenizer: "1 + 2 = 3" decodes to 1, 3, 5, 7, 9 characters after 1..5 tokens
    text = "1 + 2 = 3"
    steps = split_steps(text, " = ")
    assert steps == ["1 + 2", " = 3"] and step_end_chars(steps) == [5, 9]
    assert tokens.token_ends(ids(tokens, text), [5, 9]) == [2, 4]
    # one word per step; an EOS the text does not show belongs to the last step
    eos = tokens.tokenizer.eos_token_id
    assert tokens.token_ends([*ids(tokens, "5 7 3"), eos], step_end_chars(split_steps("5 7 3", " "))) == [0, 1, 3]
    # a step that ended inside a prefilled prefix (offset 0) ends at the first token; two steps may share a token
    assert step_end_chars(["copy ", "5", " 7"], skip=5) == [0, 1, 3]
    assert tokens.token_ends(ids(tokens, "5 7"), [0, 1, 3]) == [0, 0, 1]


def traj(text: str, tok: StepTokens, total: float, steps=(), ends=(), eos=True) -> common_pb2.Trajectory:
    completion = ids(tok, text) + ([tok.tokenizer.eos_token_id] if eos else [])
    return common_pb2.Trajectory(prompt_token_ids=[2, 18, 5, 6, 7], completion_token_ids=completion,
                                 completion_logprobs=[-1.0] * len(completion), completion_text=text,
                                 sampling_temperature=1.0,
                                 reward=common_pb2.Reward(total=total, status=OK, step_rewards=list(steps),
                                                          step_end_chars=list(ends)))


def test_step_layout_of_a_batch_and_the_fallback_to_the_total(tokens):
    g = common_pb2.RolloutGroup(group_id="g", trajectories=[
        traj("7 3", tokens, 0.5, steps=[1.0, 0.0], ends=[1, 3]), traj("2", tokens, 0.0)])
    b = batch_from_groups([g], step_tokens=tokens)
    assert b.step_rewards == [[1.0, 0.0], []] and b.step_ends == [[0, 2], []]  # "7", " 3" + EOS
    b.validate()
    inputs = b.step_inputs()
    assert inputs["step_seq"].tolist() == [0, 0] and inputs["step_ends"].tolist() == [0, 2]
    assert batch_from_groups([g]).step_rewards is None  # an estimator without steps: nothing laid out
    assert b.subset([1]).step_rewards == [[]]


def test_a_step_layout_that_disagrees_is_a_bad_group_only_for_step_estimators(tokens):
    good = common_pb2.RolloutGroup(group_id="good", trajectories=[
        traj("7 3", tokens, 0.5, steps=[1.0, 0.0], ends=[1, 3]), traj("2", tokens, 0.0)])
    bad = [common_pb2.RolloutGroup(group_id="count", trajectories=[traj("7 3", tokens, 0.5, steps=[1.0, 0.0], ends=[3])]),
           common_pb2.RolloutGroup(group_id="order", trajectories=[traj("7 3", tokens, 0.5, steps=[1.0, 0.0], ends=[3, 1])]),
           common_pb2.RolloutGroup(group_id="past", trajectories=[traj("7 3", tokens, 0.5, steps=[1.0], ends=[9])]),
           common_pb2.RolloutGroup(group_id="nan", trajectories=[traj("7 3", tokens, 0.5, steps=[float("nan")], ends=[3])])]
    kept, dropped = screen_groups([good, *bad], steps=True)
    assert [g.group_id for g in kept] == ["good"]
    assert [(d.group_id, d.reason, d.field) for d in dropped] == [
        ("count", "invalid", "groups[1].trajectories[0].reward.step_end_chars"),
        ("order", "invalid", "groups[2].trajectories[0].reward.step_end_chars"),
        ("past", "invalid", "groups[3].trajectories[0].reward.step_end_chars"),
        ("nan", "invalid", "groups[4].trajectories[0].reward.step_rewards")]
    assert "1 step ends for 2 step rewards" in dropped[0].detail
    kept, dropped = screen_groups([good, *bad], steps=False)  # grpo never reads them
    assert len(kept) == 5 and not dropped


def test_process_grpo_step_trains_on_step_rewards_and_drops_a_bad_group(tmp_path):
    trainer = Trainer(build_tiny_model(tmp_path / "m", seed=0), TrainerConfig(advantage="process_grpo", epochs=1))
    assert trainer.step_tokens is not None
    loop = LearnerLoop(trainer, replay=None, replicas=[], producer=None, groups_per_step=2)
    tok = trainer.step_tokens
    good = common_pb2.RolloutGroup(group_id="good", job_id="j", trajectories=[
        traj("7 3", tok, 0.5, steps=[1.0, 0.0], ends=[1, 3]), traj("7 7", tok, 1.0, steps=[1.0, 1.0], ends=[1, 3]),
        traj("2", tok, 0.0)])
    bad = common_pb2.RolloutGroup(group_id="bad", job_id="j", trajectories=[
        traj("7 3", tok, 0.5, steps=[1.0, 0.0], ends=[3]), traj("2", tok, 0.0)])
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    metrics = loop.train_on([good, bad])
    assert metrics is not None and metrics.step == 1
    v = metrics.values
    assert v["step_reward_trajectories"] == 2 and v["step_rewards"] == 4 and v["dropped_invalid"] == 1
    assert loop.state.dropped_by_reason == {"invalid": 1}
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    # the group's steps 1, 0 | 1, 1 | fallback 0: mean 0.6, std 0.4899 -> per token of "7 3 <eos>":
    # (1 - 0.6 + 0 - 0.6) / s, then (0 - 0.6) / s twice; the outcome totals (0.5, 1.0, 0.0) never enter
    s = (sum((x - 0.6) ** 2 for x in [1, 0, 1, 1, 0]) / 5) ** 0.5
    assert v["advantage_min"] == pytest.approx(-0.6 / s, rel=1e-4)
    assert v["advantage_max"] == pytest.approx(0.8 / s, rel=1e-4)  # "7 7 <eos>": token 0 sees both steps


def test_process_grpo_refuses_kl_in_the_reward():
    for name in ("process_grpo", "grpo_process"):
        with pytest.raises(ValueError, match=f"kl_in: {name}"):
            TrainerConfig(advantage=name, kl_coef=0.1, kl_in="reward")
    TrainerConfig(advantage="gae_step", kl_coef=0.1, kl_in="reward")  # GAE takes dense token rewards


def test_step_ends_with_a_byte_level_bpe_tokenizer():
    """Tokens that span a delimiter or split a multi-byte character: each step still ends at the first
    token whose decoded prefix holds the whole step."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    corpus = ["First, 3 + 4 = 7.\n\nThen 7 * 2 = 14.\n\nSo the answer is 14.", "Café: 2 € each.\n\nTotal 4 €."] * 20
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus, vocab_size=300, min_frequency=2, special_tokens=["<eos>"])
    tok = StepTokens(PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<eos>"))
    for text in [*set(corpus), "Café 3 + 4\n\n= 7 €\n\n\n\nSo 7.\n\n"]:
        token_ids = tok.tokenizer(text, add_special_tokens=False)["input_ids"]
        steps = split_steps(text, "\n\n")
        ends = tok.token_ends(token_ids, step_end_chars(steps))
        assert ends[-1] == len(token_ids) - 1 and ends == sorted(ends)
        for i, k in enumerate(ends[:-1]):
            done = "".join(steps[:i + 1])
            assert tok.tokenizer.decode(token_ids[:k + 1]).startswith(done)
            assert not tok.tokenizer.decode(token_ids[:k]).startswith(done)


def test_gae_step_trains_policy_and_critic_on_step_rewards(tmp_path):
    trainer = Trainer(build_tiny_model(tmp_path / "m", seed=0), TrainerConfig(advantage="gae_step", epochs=1))
    assert trainer.critic is not None and trainer.step_tokens is not None
    tok = trainer.step_tokens
    group = common_pb2.RolloutGroup(group_id="g", job_id="j", trajectories=[
        traj("7 3", tok, 0.5, steps=[1.0, 0.0], ends=[1, 3]), traj("2", tok, 0.0)])
    batch = batch_from_groups([group], step_tokens=tok)
    v = trainer.step(batch)
    # the critic starts at 0 (zero head) and gamma = 1: returns are each token's rewards still ahead:
    # 1, 0, 0 for "7 3 <eos>" (step 1 ends at token 0), and the fallback total 0 for "2 <eos>"
    assert v["return_mean"] == pytest.approx(1 / 5, abs=1e-6)
    assert v["step_reward_trajectories"] == 1 and v["step_rewards"] == 2 and v["value_loss"] > 0
