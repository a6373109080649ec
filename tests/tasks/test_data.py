"""Dataset domains (``data.<name>``): rows become tasks carrying the declared verifier; held-out rows never
train; every bad input is refused at validation, naming the option (and the file and row)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from temper import tasks
from temper.runtime.errors import InvalidArgument
from temper.scheduler.core import JobSpec
from temper.tasks import data

ROWS = [{"question": f"copy {a} {b} {c}", "answer": str(c)} for a, b, c in
        [(1, 2, 3), (4, 5, 6), (7, 8, 9), (1, 1, 1), (2, 2, 2), (3, 3, 3), (0, 4, 8), (9, 9, 0), (5, 1, 2), (6, 6, 7)]]


def write_jsonl(path: Path, rows: list, blank_line_at: int | None = None) -> Path:
    lines = [json.dumps(r) if not isinstance(r, str) else r for r in rows]
    if blank_line_at is not None:
        lines.insert(blank_line_at, "")
    path.write_text("\n".join(lines) + "\n")
    return path


def config(path: Path, **over) -> dict:
    return {"path": str(path), "prompt_field": "question", "answer_field": "answer", "verifier": "exact_answer",
            **over}


def refused(domain: str, cfg: dict) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as e:
        tasks.check_config(domain, cfg, field=f"domain_config[{domain}]")
    return e.value


def test_jsonl_rows_become_tasks_with_the_declared_verifier(tmp_path):
    cfg = config(write_jsonl(tmp_path / "rows.jsonl", ROWS, blank_line_at=3))  # blank lines are skipped
    rng = random.Random(0)
    drawn = [tasks.make_task("data.copy", rng, f"t{i}", cfg) for i in range(200)]
    by_prompt = {r["question"]: r["answer"] for r in ROWS}
    assert {t.prompt for t in drawn} == set(by_prompt)  # every row, nothing else
    for t in drawn:
        assert t.domain == "data.copy" and t.reference_answer == by_prompt[t.prompt]
        assert t.metadata["verifier"] == "exact_answer" and t.metadata[data.SPLIT_KEY] == "train"
    fourth = next(t for t in drawn if t.prompt == "copy 1 1 1")
    assert fourth.metadata[data.ROW_KEY] == "row 4 (line 5)"  # line 4 is the blank one


def test_csv_numbers_and_instruction(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text("id,problem,solution\n1,What is 2 + 3?,5\n2,\"Halve 1, then double it\",1\n")
    cfg = {"path": str(path), "prompt_field": "problem", "answer_field": "solution", "verifier": "math",
           "instruction": "Put your final answer in \\boxed{}."}
    ds = data.load("data.arith", cfg)
    assert [(r.prompt, r.answer) for r in ds.train] == [
        ("What is 2 + 3?\n\nPut your final answer in \\boxed{}.", "5"),
        ("Halve 1, then double it\n\nPut your final answer in \\boxed{}.", "1")]
    assert ds.format == "csv" and ds.describe().startswith(f"dataset {path} (csv): 2 rows, 2 train, none held out")
    numeric = write_jsonl(tmp_path / "n.jsonl", [{"q": 12, "a": 3.5}])
    row = data.load("data.n", {"path": str(numeric), "prompt_field": "q", "answer_field": "a",
                               "verifier": "math"}).train[0]
    assert (row.prompt, row.answer) == ("12", "3.5")


def test_eval_fraction_holds_out_distinct_prompts_the_same_way_every_time(tmp_path):
    rows = ROWS + [ROWS[0], ROWS[0]]  # a repeated prompt stays on one side
    a = data.load("data.copy", config(write_jsonl(tmp_path / "a.jsonl", rows), eval_fraction=0.3))
    b = data.load("data.copy", config(write_jsonl(tmp_path / "b.jsonl", list(reversed(rows))), eval_fraction=0.3))
    held = {r.prompt for r in a.held_out}
    assert len(held) == 3 and held == {r.prompt for r in b.held_out}  # ceil(0.3 * 10) distinct; order-free
    assert not held & {r.prompt for r in a.train}
    assert len(a.train) + len(a.held_out) == len(rows)
    cfg = config(tmp_path / "a.jsonl", eval_fraction=0.3)
    rng = random.Random(1)
    assert {tasks.make_task("data.copy", rng, "t", cfg).prompt for _ in range(300)} == {r.prompt for r in a.train}
    evals = [tasks.make_eval_task("data.copy", rng, "e", cfg) for _ in range(100)]
    assert {t.prompt for t in evals} == held and all(t.metadata[data.SPLIT_KEY] == "eval" for t in evals)


def test_the_jobs_held_out_set_comes_only_from_held_out_rows(tmp_path):
    train, held = ROWS[:7], ROWS[7:]
    cfg = config(write_jsonl(tmp_path / "train.jsonl", train),
                 eval_path=str(write_jsonl(tmp_path / "held.jsonl", held)))
    spec = JobSpec.from_dict({"domains": ["data.copy"], "domain_config": {"data.copy": cfg}, "eval": {"size": 3}})
    spec.validate()
    sets = spec.eval_sets()  # the scheduler's disjointness check runs here too
    assert {t.prompt for t in sets.sets["data.copy"]} == {r["question"] for r in held}
    assert not any(sets.holds(r["question"]) for r in train)
    with pytest.raises(InvalidArgument) as e:  # more held-out problems asked than there are
        JobSpec.from_dict({"domains": ["data.copy"], "domain_config": {"data.copy": cfg},
                           "eval": {"size": 4}}).eval_sets()
    assert e.value.field == "eval.size"
    no_held = JobSpec.from_dict({"domains": ["data.copy"], "domain_config": {"data.copy": config(tmp_path / "train.jsonl")},
                                 "eval": {"size": 2}})
    no_held.validate()
    with pytest.raises(InvalidArgument) as e:
        no_held.eval_sets()
    assert e.value.field == "domain_config[data.copy].eval_fraction" and "holds no rows out" in e.value.message


def test_a_prompt_in_both_files_is_never_trained_on(tmp_path):
    cfg = config(write_jsonl(tmp_path / "train.jsonl", ROWS[:5]),
                 eval_path=str(write_jsonl(tmp_path / "held.jsonl", ROWS[4:6])))  # ROWS[4] in both
    spec = JobSpec.from_dict({"domains": ["data.copy"], "domain_config": {"data.copy": cfg}, "eval": {"size": 2}})
    sets = spec.eval_sets()
    from temper.scheduler.evaluation import draw_training_task

    rng = random.Random(0)
    drawn = {draw_training_task("data.copy", rng, "t", cfg, sets)[0].prompt for _ in range(200)}
    assert drawn == {r["question"] for r in ROWS[:4]}


def test_code_rows_carry_a_test_suite(tmp_path):
    rows = [{"prompt": "Print the sum of two integers read from stdin.",
             "tests": [{"stdin": "1 2\n", "expected_stdout": "3\n"}]},
            {"prompt": "Define sq(x).", "tests": {"tests": [{"assertion": "assert sq(3) == 9"}], "wall_seconds": 2}},
            {"prompt": "Define one().", "tests": json.dumps({"tests": [{"assertion": "assert one() == 1"}]})}]
    cfg = {"path": str(write_jsonl(tmp_path / "code.jsonl", rows)), "prompt_field": "prompt", "answer_field": "tests",
           "verifier": "code.all_pass"}
    suites = [json.loads(r.answer) for r in data.load("data.code", cfg).train]
    assert suites[0] == {"tests": rows[0]["tests"]} and suites[1] == rows[1]["tests"]
    assert suites[2] == json.loads(rows[2]["tests"])
    bad = write_jsonl(tmp_path / "bad.jsonl", [rows[0], {"prompt": "x", "tests": [{"stdin": "1"}]}])
    e = refused("data.code", {**cfg, "path": str(bad)})
    assert e.field == "domain_config[data.code].answer_field"
    assert "row 2 (line 2)" in e.message and "expected_stdout" in e.message


def test_relative_paths_are_taken_from_the_job_files_folder(tmp_path):
    (tmp_path / "sub").mkdir()
    write_jsonl(tmp_path / "sub" / "rows.jsonl", ROWS)
    resolved = tasks.resolve_paths({"data.copy": config(Path("sub/rows.jsonl"), eval_path="sub/rows.jsonl"),
                                    "rg.chain_sum": {"path": "untouched"}}, tmp_path)
    assert resolved["data.copy"]["path"] == str(tmp_path / "sub" / "rows.jsonl")
    assert resolved["data.copy"]["eval_path"] == str(tmp_path / "sub" / "rows.jsonl")
    assert resolved["rg.chain_sum"] == {"path": "untouched"}


@pytest.mark.parametrize("case,option,words", [
    ("missing file", "path", "no such file"),
    ("unknown option", "colour", "unknown option"),
    ("no verifier", "verifier", "required"),
    ("unknown verifier", "verifier", "unknown verifier 'telepathy'"),
    ("reasoning-gym verifier", "verifier", "rg.<family>"),
    ("unknown prompt field", "prompt_field", "row 1 (line 1) has no field 'problem'"),
    ("unknown answer field", "answer_field", "has no field 'solution'"),
    ("row without its answer", "answer_field", "row 3 (line 3) has no field 'answer'"),
    ("empty prompt", "prompt_field", "row 2 (line 2): 'question' must be a non-empty string"),
    ("empty answer", "answer_field", "row 2 (line 2): 'answer' is empty"),
    ("answer is a list", "answer_field", "a string or a number"),
    ("empty file", "path", "has no rows"),
    ("not JSON", "path", "line 2: not JSON"),
    ("row not an object", "path", "a row must be an object"),
    ("unknown suffix", "format", "cannot tell the format"),
    ("fraction too big", "eval_fraction", "[0, 1)"),
    ("fraction takes every row", "eval_fraction", "leaves none to train on"),
    ("two held-out sources", "eval_fraction", "one way only"),
    ("split of a file", "split", "datasets folder"),
    ("short CSV row", "answer_field", "row 2 (line 3) has no field 'answer'"),
    ("long CSV row", "path", "more values than the header"),
])
def test_bad_input_is_refused_naming_the_option(tmp_path, case, option, words):
    good = write_jsonl(tmp_path / "rows.jsonl", ROWS[:3])
    cfg = config(good)
    if case == "missing file":
        cfg["path"] = str(tmp_path / "nope.jsonl")
    elif case == "unknown option":
        cfg["colour"] = "blue"
    elif case == "no verifier":
        del cfg["verifier"]
    elif case == "unknown verifier":
        cfg["verifier"] = "telepathy"
    elif case == "reasoning-gym verifier":
        cfg["verifier"] = "reasoning_gym"
    elif case == "unknown prompt field":
        cfg["prompt_field"] = "problem"
    elif case == "unknown answer field":
        cfg["answer_field"] = "solution"
    elif case == "row without its answer":
        cfg["path"] = str(write_jsonl(tmp_path / "r.jsonl", [*ROWS[:2], {"question": "copy 1 2 3"}]))
    elif case == "empty prompt":
        cfg["path"] = str(write_jsonl(tmp_path / "r.jsonl", [ROWS[0], {"question": " ", "answer": "1"}]))
    elif case == "empty answer":
        cfg["path"] = str(write_jsonl(tmp_path / "r.jsonl", [ROWS[0], {"question": "copy 1", "answer": ""}]))
    elif case == "answer is a list":
        cfg["path"] = str(write_jsonl(tmp_path / "r.jsonl", [{"question": "copy 1", "answer": ["1"]}]))
    elif case == "empty file":
        (tmp_path / "r.jsonl").write_text("\n\n")
        cfg["path"] = str(tmp_path / "r.jsonl")
    elif case == "not JSON":
        cfg["path"] = str(write_jsonl(tmp_path / "r.jsonl", [ROWS[0], "{oops"]))
    elif case == "row not an object":
        cfg["path"] = str(write_jsonl(tmp_path / "r.jsonl", [["copy 1", "1"]]))
    elif case == "unknown suffix":
        (tmp_path / "rows.txt").write_text("x")
        cfg["path"] = str(tmp_path / "rows.txt")
    elif case == "fraction too big":
        cfg["eval_fraction"] = 1.0
    elif case == "fraction takes every row":
        cfg["eval_fraction"] = 0.9
    elif case == "two held-out sources":
        cfg.update(eval_fraction=0.2, eval_path=str(good))
    elif case == "split of a file":
        cfg["split"] = "train"
    elif case in ("short CSV row", "long CSV row"):
        (tmp_path / "r.csv").write_text("question,answer\ncopy 1 2 3,3\n" + ("copy 4\n" if case.startswith("short")
                                                                             else "copy 4,4,extra\n"))
        cfg["path"] = str(tmp_path / "r.csv")
    e = refused("data.copy", cfg)
    assert e.field == f"domain_config[data.copy].{option}", (e.field, e.message)
    assert words in e.message, e.message


def test_a_job_refuses_an_undeclared_dataset_domain(tmp_path):
    with pytest.raises(InvalidArgument) as e:
        JobSpec.from_dict({"domains": ["data.mine"]}).validate()
    assert e.value.field == "domain_config[data.mine]" and "declare it" in e.value.message
    with pytest.raises(InvalidArgument) as e:
        JobSpec.from_dict({"domains": ["data."]}).validate()
    assert e.value.field == "domains"
    ok = JobSpec.from_dict({"domains": ["toy.copy", "data.mine"],
                            "domain_config": {"data.mine": config(write_jsonl(tmp_path / "r.jsonl", ROWS))}})
    ok.validate()
    assert ok.sampling_plan()  # the sampling policy takes the dataset domain like any other


def test_parquet_and_datasets_folders_need_their_package(tmp_path):
    path = tmp_path / "rows.parquet"
    try:
        import pyarrow
        import pyarrow.parquet as pq
    except ImportError:
        path.write_bytes(b"PAR1")
        e = refused("data.pq", config(path))
        assert e.field == "domain_config[data.pq].format" and "'pyarrow'" in e.message and "pip install" in e.message
    else:
        pq.write_table(pyarrow.Table.from_pylist(ROWS), path)
        assert [r.prompt for r in data.load("data.pq", config(path)).train] == [r["question"] for r in ROWS]
    folder = tmp_path / "hf"
    try:
        import datasets
    except ImportError:
        folder.mkdir()
        e = refused("data.hf", config(folder))
        assert e.field == "domain_config[data.hf].format" and "'datasets'" in e.message
    else:
        datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:7]),
                              "test": datasets.Dataset.from_list(ROWS[7:])}).save_to_disk(str(folder))
        ds = data.load("data.hf", config(folder, eval_split="test"))
        assert len(ds.train) == 7 and len(ds.held_out) == 3
