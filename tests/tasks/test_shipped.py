"""The real benchmark sets that registry packages ship (``dataset = "humaneval" | "champ"`` on a ``data.*``
domain, ``temper.tasks.shipped``): every row loads, held-out rows are the same in every run and disjoint from
the training rows, and a mistake in the table names its key."""

from __future__ import annotations

import random

import pytest

from temper import tasks
from temper.runtime.errors import InvalidArgument
from temper.tasks import data, shipped


@pytest.mark.parametrize(("name", "rows", "verifier"), [("humaneval", 164, "code.all_pass"), ("champ", 127, "math")])
def test_each_set_loads_whole_with_held_out_rows_disjoint_from_training(name, rows, verifier):
    config = {"dataset": name, "eval_fraction": 0.2}
    ds = data.load(f"data.{name}", config)
    assert len(ds.train) + len(ds.held_out) == rows and ds.verifier == verifier
    assert not {r.prompt for r in ds.train} & {r.prompt for r in ds.held_out}
    assert len(ds.held_out) == pytest.approx(0.2 * rows, abs=1)
    assert data.load(f"data.{name}", dict(config)).held_out == ds.held_out  # the same rows every time
    task = tasks.make_eval_task(f"data.{name}", random.Random(3), "e", config)
    assert task.metadata["data.split"] == "eval" and task.metadata["verifier"] == verifier
    assert task.prompt.endswith("\n\n" + shipped.SETS[name].instruction)
    assert f"shipped dataset {name} (" in tasks.describe(f"data.{name}", config)


def test_humaneval_rows_are_a_function_to_complete_and_its_check_call():
    task = tasks.make_task("data.he", random.Random(0), "t", {"dataset": "humaneval"})
    assert task.prompt.lstrip().startswith(("def ", "from ", "import ")) and '"""' in task.prompt
    suite = __import__("json").loads(task.reference_answer)
    (test,) = suite["tests"]
    assert "def check(candidate)" in test["assertion"] and test["assertion"].rstrip().splitlines()[-1].startswith("check(")


def test_champ_keeps_closed_form_answers_only():
    kept = [r.answer for r in data.load("data.c", {"dataset": "champ"}).train]
    assert "239" in kept and "2^(n-1)" in kept
    assert not [a for a in kept if "or equivalently" in a or "solutions" in a or a in ("Yes", "No")]
    assert shipped.closed_form("n(n+1)/2") and shipped.closed_form("sqrt(3)/3") and shipped.closed_form("[-1, 1]")
    assert not shipped.closed_form("C(10, 5)") and not shipped.closed_form("0 is the only possible value")


@pytest.mark.parametrize(("config", "field", "message"), [
    ({"dataset": "gsm8k"}, "domain_config[data.x].dataset", "unknown shipped dataset 'gsm8k'"),
    ({"dataset": "humaneval", "path": "mine.jsonl"}, "domain_config[data.x].path", "the shipped dataset humaneval sets it"),
    ({"dataset": "champ", "answer_field": "a"}, "domain_config[data.x].answer_field", "sets it"),
    ({"dataset": "humaneval", "verifier": "math"}, "domain_config[data.x].verifier", "test suites"),
    ({"dataset": "champ", "verifier": "code.all_pass"}, "domain_config[data.x].verifier", "math answers"),
    ({"dataset": "champ", "verifier": "nope"}, "domain_config[data.x].verifier", "unknown verifier"),
    ({"dataset": "champ", "eval_fraction": 1.5}, "domain_config[data.x].eval_fraction", "[0, 1)"),
])
def test_a_mistake_names_its_key(config, field, message):
    with pytest.raises(InvalidArgument) as e:
        data.load("data.x", config)
    assert e.value.field == field and message in str(e.value)


def test_a_set_whose_package_is_missing_names_the_package(monkeypatch):
    monkeypatch.setitem(shipped.SETS, "champ", shipped.SETS["champ"].__class__(
        "champ-dataset==1.0.0", "no_such_module_here", "v0.json", "math", "", "gone"))
    with pytest.raises(InvalidArgument) as e:
        data.load("data.x", {"dataset": "champ"})
    assert e.value.field == "domain_config[data.x].dataset" and "pip install 'champ-dataset==1.0.0'" in str(e.value)
