"""Per-domain-group LoRA adapters through the real loop, as `temper run` runs it: real processes, real broker, the
tiny model. The job's [job.adapters] table puts each toy domain in its own adapter; the launcher gives the names to
the learner (one adapter each over the frozen base) and to inference (serves them), the scheduler tags every group
and prompt with its domain's adapter. Checked: every group trained (none dropped for its adapter), inference
generated with the adapters the learner trains (the on-policy ratio stays 1: behaviour logprobs = the learner's),
both adapters learnt and differ, the base never moved, and the exported policy is the base plus one PEFT folder per
adapter that transformers + PEFT load."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.e2e.jobfiles import run_job_file

pytestmark = pytest.mark.e2e

STEPS = 8
JOB = f"""
[job]
steps = {STEPS}
prompts_per_step = 8
group_size = 4
domains = ["toy.copy", "toy.next"]
max_tokens = 2

[job.adapters]
copying = ["toy.copy"]
counting = ["toy.next"]

[job.eval]
size = 4
seed = 99

[model]
preset = "tiny"

[inference]
engine = "hf"

[learner]
lora_rank = 4
lora_alpha = 8.0
lora_target_modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
lr = 0.1
"""


@pytest.fixture(scope="module")
def summary(tmp_path_factory):
    return run_job_file(tmp_path_factory.mktemp("adapters-job"), JOB, job_timeout=600)


def test_every_group_trains_its_domains_adapter_and_inference_generates_with_it(summary):
    steps = summary["steps"]
    assert [s["policy_version"] for s in steps] == list(range(1, STEPS + 1))
    for s in steps:
        v = s["values"]
        assert v.get("dropped_groups", 0) == 0 and v.get("dropped_unknown_adapter", 0) == 0, v
        # on-policy: the learner's logprobs of each sample before its update are the ones inference sampled
        # with; had inference generated without the adapters (or with the other's), they would differ once an
        # adapter has learnt (by 0.1-0.2 nats per token at this lr)
        assert v["logprob_diff_abs_mean"] < 1e-4, (s["policy_version"], v["logprob_diff_abs_mean"])
    assert {d for s in steps for d in s["domain_mean_reward"]} == {"toy.copy", "toy.next"}
    assert set(summary["eval"]["after"]["accuracy"]) == {"toy.copy", "toy.next"}
    # JobStatus names each domain's adapter (summary.json's sampling table is the job's last status)
    assert {d["domain"]: d["adapter"] for d in summary["sampling"]["domains"]} == {"toy.copy": "copying",
                                                                                   "toy.next": "counting"}


def test_the_exported_policy_is_the_untouched_base_and_one_peft_folder_per_adapter(summary):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    policy = summary["policy"]["path"]
    base = load_file(f"{policy}/model.safetensors")
    start = load_file(f"{summary['model_dir']}/model.safetensors")
    assert set(base) == set(start) and all(torch.equal(base[n], start[n].to(base[n].dtype)) for n in base)
    folders = {}
    for name in ("copying", "counting"):
        config = json.loads(Path(f"{policy}/adapters/{name}/adapter_config.json").read_text())
        assert config["r"] == 4 and config["lora_alpha"] == 4  # the scaling is folded into lora_B
        folders[name] = load_file(f"{policy}/adapters/{name}/adapter_model.safetensors")
        assert any(t.abs().max() > 0 for k, t in folders[name].items() if ".lora_B." in k), name  # it learnt
    assert folders["copying"].keys() == folders["counting"].keys()
    assert any(not torch.equal(folders["copying"][k], folders["counting"][k]) for k in folders["copying"])
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(policy), f"{policy}/adapters/copying")
    assert model(torch.tensor([[1, 5, 6]])).logits.isfinite().all()
