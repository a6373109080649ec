"""Shared-prompt layout (a prompt tree under a 4-D attention mask): every completion token's
log-prob, entropy and gradient equal those of the sequence in a row of its own, for groups that
share a prompt, groups split across micro-batches, packed or one unit per row, completions of one
token; a whole training step lands on the same weights; the layout computes each prompt once."""

import random

import pytest
import torch

from temper.learner.batching import Batch, layout, micro_batches, shared_prompt_layout
from temper.learner.trainer import Trainer, TrainerConfig
from temper.models.tiny import build_tiny_model
from tests.learner.test_memory_and_devices import straightforward


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


def grouped_batch(seed: int, groups: int, group_size: int, vocab: int, prompt=(2, 20), completion=(1, 12)) -> Batch:
    """``groups`` prompts, each sampled ``group_size`` times (consecutive, as the loop lays groups out)."""
    g = random.Random(seed)
    prompts, completions = [], []
    for _ in range(groups):
        p = [g.randrange(4, vocab) for _ in range(g.randint(*prompt))]
        for _ in range(group_size):
            prompts.append(list(p))
            completions.append([g.randrange(4, vocab) for _ in range(g.randint(*completion))])
    n, total = len(prompts), sum(map(len, completions))
    return Batch(prompts, completions, -torch.rand(total, generator=torch.Generator().manual_seed(seed)) * 3 - 0.01,
                 torch.tensor([0.7 if i % 3 else 1.0 for i in range(n)]),
                 torch.tensor([float(g.random() < 0.5) for _ in range(n)]), torch.arange(n) // group_size,
                 torch.zeros(n, dtype=torch.long), ["x"] * n, "j")


def trainer(model_dir, **kw) -> Trainer:
    return Trainer(model_dir, TrainerConfig(**{"autocast": "fp32", "device": "cpu", "gradient_checkpointing": False,
                                               **kw}))


@pytest.mark.parametrize("packing,micro_batch_tokens", [(True, 0), (False, 0), (True, 40), (False, 25)])
def test_logprobs_entropy_and_gradients_equal_one_row_per_sequence(model_dir, packing, micro_batch_tokens):
    batch = grouped_batch(0, groups=4, group_size=4, vocab=25)
    t = trainer(model_dir, packing=packing, micro_batch_tokens=micro_batch_tokens, share_prompts=True)
    assert t.share_prompts
    plain = trainer(model_dir, share_prompts=False).model  # same seed and folder: same weights
    mbs = t._micro_batches(batch)
    if micro_batch_tokens:
        assert len(mbs) > 1
    out = [t._logprobs(t.model, mb, entropy_grad=True) for mb in mbs]
    lp, ent = torch.cat([o[0] for o in out]), torch.cat([o[1] for o in out])
    ref_lp, ref_ent = straightforward(plain, batch)
    assert lp.shape == ref_lp.shape
    assert (lp - ref_lp).abs().max().item() < 1e-5
    assert ((ent - ref_ent).abs() / ref_ent.abs().clamp(min=1.0)).max().item() < 1e-5
    w = torch.randn(lp.shape, generator=torch.Generator().manual_seed(1))
    ((lp * w).sum() + (ent * w).sum()).backward()
    ((ref_lp * w).sum() + (ref_ent * w).sum()).backward()
    theirs = dict(plain.named_parameters())
    for name, p in t.model.named_parameters():
        q = theirs[name]
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6 * max(1.0, q.grad.abs().max().item())), name


def test_a_training_step_lands_on_the_same_weights_and_metrics(model_dir):
    batch = grouped_batch(1, groups=3, group_size=5, vocab=25)
    shared, plain = trainer(model_dir, share_prompts=True), trainer(model_dir, share_prompts=False)
    m_shared, m_plain = shared.step(batch), plain.step(batch)
    for k in ("loss", "policy_loss", "entropy", "approx_kl", "grad_norm"):
        assert m_shared[k] == pytest.approx(m_plain[k], rel=1e-4, abs=1e-6), k
    # AdamW's first update is ~lr * sign(grad): where a gradient is ~0 round-off can move it by a
    # fraction of lr (measured: up to 0.002 lr on 0.05 % of the weights), so the bound is 1 % of lr
    theirs = dict(plain.model.named_parameters())
    for name, p in shared.model.named_parameters():
        assert (p - theirs[name]).abs().max().item() < 0.01 * shared.config.lr, name
    # the prompt counted once per group: 3 prompts + every completion but its last token
    assert m_shared["input_tokens"] == sum(map(len, batch.prompts[::5])) + sum(len(c) - 1 for c in batch.completions)
    assert m_plain["input_tokens"] == sum(map(len, batch.prompts)) + sum(map(len, batch.completions))


def test_critic_values_equal_one_row_per_sequence(model_dir):
    batch = grouped_batch(2, groups=2, group_size=3, vocab=25)
    t = trainer(model_dir, advantage="gae", share_prompts=True)
    shared = torch.cat([t._values(mb) for mb in t._micro_batches(batch)])
    t.share_prompts = False
    plain = torch.cat([t._values(mb) for mb in t._micro_batches(batch)])
    assert torch.allclose(shared, plain, atol=1e-5)


def test_layout_shares_each_prompt_once_and_masks_siblings_apart():
    prompts = [[5, 6, 7]] * 3 + [[8, 9]]
    completions = [[10, 11], [12], [13, 14, 15], [16, 17]]
    x = shared_prompt_layout(prompts, completions, torch.ones(4), pad_id=0, packing=True, capacity=64)
    assert x.input_ids.shape[0] == 1 and x.real_tokens == 3 + (1 + 0 + 2) + 2 + 1
    row = x.input_ids[0].tolist()
    assert row[:6] == [5, 6, 7, 10, 13, 14] or row[3:9] == [5, 6, 7, 10, 13, 14]
    start = row.index(5)
    mask = x.attention_mask[0, 0]
    a, b1, b2 = start + 3, start + 4, start + 5  # sibling 1's token 10; sibling 3's tokens 13, 14
    assert mask[b2, b1] and mask[b2, start] and not mask[b1, a] and not mask[b2, a]
    assert x.position_ids[0, b1] == 3 and x.position_ids[0, b2] == 4
    # every first completion token is predicted by the prompt's last position
    first = [0, 2, 3]
    assert all(int(x.cols[k]) == start + 2 for k in first)
    assert x.targets.tolist() == [t for c in completions for t in c]
    # sequences with different prompts never see each other
    other = row.index(8)
    assert not mask[other:other + 3, start:start + 6].any() and not mask[start:start + 6, other:other + 3].any()


def test_micro_batch_budget_counts_a_prompt_once_per_micro_batch():
    batch = grouped_batch(3, groups=2, group_size=4, vocab=25, prompt=(10, 10), completion=(5, 5))
    # per group: 10 + 4 * 4 = 26 positions shared, 4 * 15 = 60 not
    assert len(micro_batches(batch, 0, True, 0, 26, share_prompts=True)) == 2
    assert len(micro_batches(batch, 0, True, 0, 26, share_prompts=False)) == 8
    assert sum(mb.real_tokens for mb in micro_batches(batch, 0, False, 0, 0, share_prompts=True)) == 52
    assert sum(mb.real_tokens for mb in [layout(batch.prompts, batch.completions, batch.temperatures, 0, False)]) == 120


def test_a_micro_batch_without_shared_prompts_keeps_the_plain_layout():
    batch = grouped_batch(4, groups=3, group_size=1, vocab=25)
    (mb,) = micro_batches(batch, 0, True, 0, 0, share_prompts=True)
    assert mb.attention_mask is None or mb.attention_mask.dim() == 2  # no prompt tree: no 4-D mask
    assert mb.real_tokens == sum(map(len, batch.prompts)) + sum(map(len, batch.completions))
