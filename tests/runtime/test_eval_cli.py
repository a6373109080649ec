"""`temper eval` on a model folder alone, and `temper run` refusing bad input before anything starts."""

import json
import subprocess
import sys

from temper.models.tiny import build_tiny_model
import pytest

pytestmark = pytest.mark.slow  # starts processes

TEMPER = [sys.executable, "-m", "temper.cli.main"]


def _temper(home, *args):
    return subprocess.run([*TEMPER, "--home", str(home), *args], capture_output=True, text=True, timeout=600)


def test_eval_a_model_folder(tmp_path):
    model = build_tiny_model(tmp_path / "tiny", layers=1)
    out = tmp_path / "eval.json"
    r = _temper(tmp_path / "home", "eval", "--model", str(model), "--domains", "toy.copy", "toy.next",
                "--size", "20", "--max-tokens", "2", "--engine", "hf", "--out", str(out))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    result = json.loads(out.read_text())
    assert set(result["accuracy"]) == {"toy.copy", "toy.next"}
    assert all(0.0 <= a <= 1.0 for a in result["accuracy"].values())
    assert result["chat_template"] is False and result["generated_tokens"] > 0
    # toy problems carry reference answers: what always giving the most common one scores, and accuracy on the rest
    assert set(result["majority_share"]) == {"toy.copy", "toy.next"}
    assert all(0.0 < share <= 1.0 for share in result["majority_share"].values())
    assert all(0.0 <= a <= 1.0 for a in result["accuracy_beyond_majority"].values())
    assert "toy.copy" in r.stdout and not (tmp_path / "tiny" / "temper-tiny-recipe.json").exists()


def test_eval_refuses_a_folder_that_is_not_a_model(tmp_path):
    r = _temper(tmp_path / "home", "eval", "--model", str(tmp_path), "--domains", "toy.copy")
    assert r.returncode == 1 and "--model" in r.stderr and "config.json" in r.stderr


def _run_config(tmp_path, text):
    config = tmp_path / "job.toml"
    config.write_text(text)
    return _temper(tmp_path / "home", "--config", str(config), "run", "--runs", str(tmp_path / "runs"))


def test_run_refuses_bad_input_before_anything_starts(tmp_path):
    cases = [
        ('[model]\ndir = "/nonexistent/model"\n', "model.dir"),
        ('[model]\npreset = "tiny"\nwidth = 3\n', "model.width"),
        ('[job]\nstepz = 3\n[model]\npreset = "tiny"\n', "job.stepz"),
        ('[job]\ndomains = ["rg.chain_sum"]\n[job.domain_config."rg.chain_sum"]\nmin_terms = 2\nmax_terms = 2\n'
         'min_digits = 1\nmax_digits = 1\n[job.eval]\nsize = 150\n[model]\npreset = "tiny"\n', "eval.size"),
        ('[job]\nchat_template = true\n[model]\npreset = "tiny"\n', "job.chat_template"),
    ]
    for text, field in cases:
        r = _run_config(tmp_path, text)
        assert r.returncode == 1 and field in r.stderr, (field, r.stderr[-1500:])
        assert not (tmp_path / "home" / "state.json").exists() and not (tmp_path / "home" / "logs").exists()
