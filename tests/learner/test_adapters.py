"""Per-domain-group LoRA adapters in the trainer (TrainerConfig.lora_adapters): one frozen base, one adapter per
group of domains; a sequence trains only the adapter its group names, micro-batches never mix adapters, the
pushed weights are the adapters alone (scaling folded in), and a checkpoint restores every adapter."""

import copy

import pytest
import torch
from pydantic import ValidationError

from temper.inference.engine import HFEngine
from temper.learner import checkpoint
from temper.learner.batching import batch_from_groups, micro_batches, screen_groups
from temper.learner.trainer import ADAPTER_PREFIX, Trainer, TrainerConfig
from temper.runtime.errors import InvalidArgument
from tests.builders import rollout_group

TIMING = {"train_seconds", "tokens_per_second", "peak_rss_bytes", "peak_memory_bytes"}
CFG = TrainerConfig(lora_rank=4, lora_alpha=8.0, lr=1e-2, lora_adapters=["math", "words"])


def with_adapters(batch, names):
    """``batch`` with group g's sequences on adapter names[g % len(names)] (groups of two adapters interleave)."""
    b = copy.copy(batch)
    b.adapters = [names[int(g) % len(names)] for g in batch.group_index]
    return b


def lora_params(trainer, adapter):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if f".{adapter}." in n}


def test_a_group_trains_only_its_adapter_and_never_the_base(model_dir, batches):
    trainer = Trainer(model_dir, CFG)
    base = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if ".lora_" not in n}
    math0, words0 = lora_params(trainer, "math"), lora_params(trainer, "words")
    assert math0 and words0 and set(trainer.params) == set(p for n, p in trainer.model.named_parameters()
                                                         if ".lora_" in n)
    trainer.step(with_adapters(batches[0], ["math", "words"]))  # both adapters' groups, interleaved
    math1, words1 = lora_params(trainer, "math"), lora_params(trainer, "words")
    assert any(not torch.equal(math0[n], math1[n]) for n in math0)
    assert any(not torch.equal(words0[n], words1[n]) for n in words0)
    trainer.step(with_adapters(batches[1], ["math"]))  # math's groups only: words is left exactly as it was
    assert all(torch.equal(words1[n], p) for n, p in lora_params(trainer, "words").items())
    assert any(not torch.equal(math1[n], p) for n, p in lora_params(trainer, "math").items())
    after = {n: p for n, p in trainer.model.named_parameters() if ".lora_" not in n}
    assert all(torch.equal(base[n], after[n]) for n in base)


def test_one_adapter_of_several_learns_exactly_as_a_single_lora_policy(model_dir, batches):
    """A batch of one adapter's groups: the same loss and update as one LoRA adapter trained alone from the same
    initialisation (the first adapter is initialised as the single one is)."""
    single = Trainer(model_dir, CFG.model_copy(update={"lora_adapters": []}))
    multi = Trainer(model_dir, CFG)
    for b in batches[:2]:
        got, expected = multi.step(with_adapters(b, ["math"])), single.step(b)
        assert {k: v for k, v in got.items() if k not in TIMING} == pytest.approx(
            {k: v for k, v in expected.items() if k not in TIMING}, rel=1e-5, abs=1e-7)
    ref = {n.replace(".default.", ".math."): p for n, p in lora_params(single, "default").items()}
    assert set(ref) == set(lora_params(multi, "math"))
    assert all(torch.allclose(ref[n], p, atol=1e-6) for n, p in lora_params(multi, "math").items())


def test_micro_batches_never_mix_adapters_and_the_step_groups_them(model_dir, batches):
    trainer = Trainer(model_dir, CFG)
    b = with_adapters(batches[0], ["math", "words"])
    ordered = trainer._by_adapter(b)
    assert ordered.adapters == sorted(b.adapters, key=["math", "words"].index)
    assert sorted(ordered.group_ids) == sorted(b.group_ids)
    for budget in (0, 40):
        mbs = micro_batches(ordered, 0, True, 0, budget)
        assert {mb.adapter for mb in mbs} == {"math", "words"}
        assert all(len(set(ordered.adapters[mb.seqs])) == 1 and ordered.adapters[mb.seqs.start] == mb.adapter
                   for mb in mbs)
    assert len(micro_batches(ordered, 0, True, 0, 0)) == 2
    # the logprobs of a sequence are its adapter's: after training, math's and words' differ on the same batch
    trainer.step(b)
    as_math, as_words = trainer.token_logprobs(with_adapters(b, ["math"])), trainer.token_logprobs(
        with_adapters(b, ["words"]))
    assert not torch.allclose(as_math, as_words)


def test_pushed_weights_are_the_adapters_with_their_scaling_folded_in(model_dir, batches):
    trainer = Trainer(model_dir, CFG)
    trainer.step(with_adapters(batches[0], ["math", "words"]))
    pushed = trainer.weights()
    assert pushed and all(n.startswith(ADAPTER_PREFIX) for n in pushed)
    assert {n.split("/")[1] for n in pushed} == {"math", "words"}
    params = dict(trainer.model.named_parameters())
    scale = CFG.lora_alpha / CFG.lora_rank
    for name, t in pushed.items():
        adapter, key = name.removeprefix(ADAPTER_PREFIX).split("/", 1)
        own = params[key.replace(".weight", f".{adapter}.weight")]
        assert torch.equal(t, own.detach() * scale if ".lora_B." in key else own.detach()), name
    # base + B A (scaling folded) is what PEFT's own merge of that adapter gives
    base = trainer.base_weights()
    assert set(base) == set(HFEngine(model_dir).weight_specs())
    merged = copy.deepcopy(trainer.model)
    merged.set_adapter("words")
    merged = merged.merge_and_unload()
    for name, p in merged.named_parameters():
        a = pushed.get(f"{ADAPTER_PREFIX}words/base_model.model.{name.removesuffix('.weight')}.lora_A.weight")
        expected = base[name] if a is None else base[name] + pushed[
            f"{ADAPTER_PREFIX}words/base_model.model.{name.removesuffix('.weight')}.lora_B.weight"] @ a
        assert torch.allclose(p, expected, atol=1e-6), name


def test_a_checkpoint_restores_every_adapter_bit_identically(model_dir, batches, tmp_path):
    a = Trainer(model_dir, CFG)
    a.step(with_adapters(batches[0], ["math", "words"]))
    a.step(with_adapters(batches[1], ["words"]))
    path = checkpoint.save(a, tmp_path / "step-2")
    expected = a.step(with_adapters(batches[2], ["math", "words"]))
    b = Trainer(model_dir, CFG.model_copy(update={"seed": 7}))
    checkpoint.load(b, path)
    got = b.step(with_adapters(batches[2], ["math", "words"]))
    assert {k: v for k, v in got.items() if k not in TIMING} == {k: v for k, v in expected.items() if k not in TIMING}
    pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    assert all(torch.equal(pa[n], pb[n]) for n in pa)


def test_a_sequence_of_an_unknown_adapter_or_of_none_is_refused_naming_it(model_dir, batches):
    trainer = Trainer(model_dir, CFG)
    with pytest.raises(InvalidArgument) as e:
        trainer.step(with_adapters(batches[0], ["math", "poetry"]))
    assert e.value.field == "adapters[4]"
    with pytest.raises(InvalidArgument) as e:
        trainer.step(batches[0])  # no adapter named: which one would it train?
    assert e.value.field == "adapters[0]"
    plain = Trainer(model_dir, TrainerConfig(lora_rank=4))
    with pytest.raises(InvalidArgument) as e:
        plain.step(with_adapters(batches[0], ["math"]))
    assert e.value.field == "adapters[0]"


def test_screen_groups_drops_a_group_of_an_adapter_the_learner_does_not_train():
    groups = [rollout_group(group_id=f"g{i}", n=2, tokens=3, rewards=[1.0, 0.0]) for i in range(4)]
    groups[0].adapter, groups[1].adapter, groups[2].adapter = "math", "poetry", "words"
    kept, dropped = screen_groups(groups, adapters=["math", "words"])
    assert [g.group_id for g in kept] == ["g0", "g2"]
    assert [(d.group_id, d.reason, d.field) for d in dropped] == [
        ("g1", "unknown_adapter", "groups[1].adapter"), ("g3", "unknown_adapter", "groups[3].adapter")]
    kept, dropped = screen_groups(groups)  # a learner of one policy: a group naming any adapter is not its
    assert [g.group_id for g in kept] == ["g3"] and len(dropped) == 3
    batch = batch_from_groups(groups[:1] + groups[2:3])
    assert batch.adapters == ["math", "math", "words", "words"]
    assert batch_from_groups(groups[3:]).adapters is None


@pytest.mark.parametrize("update, field", [
    ({"lora_rank": 0}, "lora_rank"),
    ({"lora_adapters": ["math", "math"]}, "lora_adapters"),
    ({"lora_adapters": ["a/b"]}, "lora_adapters[0]"),
    ({"lora_adapters": [""]}, "lora_adapters[0]"),
    ({"lora_modules_to_save": ["embed_tokens"]}, "lora_modules_to_save"),
])
def test_adapter_settings_that_cannot_work_are_refused_naming_the_field(update, field):
    with pytest.raises(ValidationError, match=field.replace("[", r"\[").replace("]", r"\]")):
        TrainerConfig(**{**CFG.model_dump(), **update})


def test_the_exported_policy_is_the_base_and_each_adapter_as_a_peft_folder(model_dir, batches, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from temper.learner.export import export_policy

    trainer = Trainer(model_dir, CFG)
    trainer.step(with_adapters(batches[0], ["math", "words"]))
    out = tmp_path / "policy"
    export_policy({**trainer.base_weights(), **trainer.adapter_weights()}, model_dir, out, "float32")
    assert sorted(p.name for p in (out / "adapters").iterdir()) == ["math", "words"]
    ids = torch.tensor([batches[0].prompts[0] + batches[0].completions[0]])
    for adapter in ("math", "words"):
        loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32),
                                           out / "adapters" / adapter).eval()
        trainer.model.set_adapter(adapter)
        with torch.no_grad():
            assert torch.allclose(loaded(ids).logits, trainer.model(ids).logits, atol=1e-5), adapter
