"""ExportPolicy writes the policy in the dtype it was served in (push_dtype) unless asked for another: a
policy trained in fp32 at a small lr from a bf16 folder is not rounded back to where it started."""

import json

import torch
from safetensors.torch import load_file

from temper.learner.loop import LearnerLoop
from temper.learner.trainer import Trainer, TrainerConfig
from temper.models.tiny import build_tiny_model


def test_the_default_export_is_what_was_served_and_another_dtype_is_on_request(tmp_path):
    model_dir = build_tiny_model(tmp_path / "m", seed=0)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))  # stored as bf16
    trainer = Trainer(model_dir, TrainerConfig(push_dtype="fp32"))
    with torch.no_grad():  # a step's worth of change, far below bf16's resolution near 1
        for p in trainer.model.parameters():
            p.add_(1e-5)
    loop = LearnerLoop(trainer, replay=None, replicas=[], producer=None, groups_per_step=1, model_dir=model_dir)
    path, *_ = loop.export_policy(str(tmp_path / "served"))
    assert json.loads((path / "config.json").read_text())["dtype"] == "float32"
    exported, weights = load_file(str(path / "model.safetensors")), trainer.weights()
    assert exported.keys() == weights.keys() and all(torch.equal(exported[n], weights[n]) for n in weights)
    path, *_ = loop.export_policy(str(tmp_path / "bf16"), "bfloat16")
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in load_file(str(path / "model.safetensors")).values())
