"""The [model] table: any HF causal-LM folder or the tiny recipe, checked before anything starts."""

import json
import shutil
from pathlib import Path

import pytest

from temper.models import check_model_dir, check_service_tables, resolve_model
from temper.models.smollm2 import DEFAULT_DIR
from temper.models.tiny import build_tiny_model
from temper.runtime.errors import InvalidArgument
from temper.runtime.launcher import Launcher

SMOLLM2 = Path(__file__).resolve().parents[2] / DEFAULT_DIR


def _field(excinfo) -> str:
    return excinfo.value.field


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in folder.iterdir()}


def test_tiny_preset_is_built_in_home_once(tmp_path):
    info = resolve_model({"preset": "tiny", "hidden_size": 64, "layers": 1}, home=tmp_path)
    assert info.dir == tmp_path.resolve() / "models" / "tiny" and info.preset == "tiny"
    assert info.tokenizer_vocab_size <= info.model_vocab_size and info.eos_token_ids
    before = _snapshot(info.dir)
    assert resolve_model({"preset": "tiny", "hidden_size": 64, "layers": 1}, home=tmp_path).dir == info.dir
    assert _snapshot(info.dir) == before  # same recipe: not rebuilt


@pytest.mark.skipif(not (SMOLLM2 / "config.json").exists(), reason="SmolLM2 not prepared (make setup)")
def test_a_real_model_folder_is_used_as_it_is_and_never_written():
    before = _snapshot(SMOLLM2.resolve())
    info = resolve_model({"dir": str(SMOLLM2)})
    assert info.preset == "" and info.architecture == "LlamaForCausalLM"
    assert info.model_vocab_size == 49152 and info.tokenizer_vocab_size <= 49152
    assert info.eos_token_ids == (2,) and info.has_chat_template
    assert _snapshot(SMOLLM2.resolve()) == before
    with pytest.raises(InvalidArgument) as e:  # the tiny recipe refuses to overwrite it
        resolve_model({"preset": "tiny", "dir": str(SMOLLM2)})
    assert _field(e) == "model.dir" and "refusing to overwrite" in str(e.value)
    assert _snapshot(SMOLLM2.resolve()) == before


@pytest.mark.parametrize("table, field", [
    ({"dir": "x", "hidden": 3}, "model.hidden"),
    ({"preset": "huge"}, "model.preset"),
    ({"dir": "/nonexistent/model"}, "model.dir"),
    ({}, "model.dir"),
    ({"dir": "/tmp", "layers": 2}, "model.layers"),
    ({"preset": "tiny", "layers": 0}, "model.layers"),
    ({"preset": "tiny", "hidden_size": 64, "heads": 3}, "model.heads"),
])
def test_bad_tables_name_the_field(tmp_path, table, field):
    with pytest.raises(InvalidArgument) as e:
        resolve_model(table, home=tmp_path)
    assert _field(e) == field, str(e.value)


def test_not_a_causal_lm_and_vocab_mismatch_are_refused(tmp_path):
    tiny = build_tiny_model(tmp_path / "tiny", layers=1)
    assert check_model_dir(tiny).architecture == "LlamaForCausalLM"
    bert = tmp_path / "bert"
    shutil.copytree(tiny, bert)
    (bert / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertForMaskedLM"]}))
    with pytest.raises(InvalidArgument, match="not a causal LM") as e:
        check_model_dir(bert)
    assert _field(e) == "model.dir"
    small = tmp_path / "small"
    shutil.copytree(tiny, small)
    config = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**config, "vocab_size": 8}))
    with pytest.raises(InvalidArgument, match="tokenizer/vocab mismatch"):
        check_model_dir(small)
    no_weights = tmp_path / "no-weights"
    shutil.copytree(tiny, no_weights)
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(InvalidArgument, match="no safetensors"):
        check_model_dir(no_weights)


def test_service_tables_may_not_name_another_folder(tmp_path):
    check_service_tables({"inference": {"model_dir": str(tmp_path)}}, tmp_path)
    with pytest.raises(InvalidArgument) as e:
        check_service_tables({"learner": {"model_dir": "/elsewhere"}}, tmp_path)
    assert _field(e) == "learner.model_dir"


def test_launcher_refuses_a_bad_model_before_starting_anything(tmp_path):
    config = tmp_path / "job.toml"
    config.write_text('[model]\ndir = "/nonexistent/model"\n')
    launcher = Launcher(home=tmp_path / "home", config=config)
    with pytest.raises(InvalidArgument) as e:
        launcher.up(["inference"])
    assert _field(e) == "model.dir"
    assert launcher.load() is None  # no broker, no service: nothing recorded
