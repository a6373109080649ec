"""The user's own datasets on disk as domains ``data.<name>``: each row is a prompt, its reference answer,
and the job names the reward verifier that scores it.

A data domain is declared by its table, ``[job.domain_config."data.NAME"]``:

- ``path`` (required): a ``.jsonl`` file (one JSON object per line), a ``.csv`` file (a header row), a
  ``.parquet`` file (needs pyarrow) or a folder written by Hugging Face ``datasets``' ``save_to_disk``
  (needs datasets). A relative path is taken from the job file's folder (``resolve_paths``).
- ``format``: ``auto`` (by the suffix; a folder is ``hf``) | ``jsonl`` | ``csv`` | ``parquet`` | ``hf``.
- ``prompt_field`` (required): the column holding the prompt.
- ``answer_field``: the column holding the reference answer (required unless the verifier needs none).
  For the code verifier (``code.all_pass`` / ``code.pass_fraction``) it is the test suite the sandbox
  runs: a list of tests (``{"stdin", "expected_stdout"}`` or ``{"assertion"}``), the suite object of
  ``temper.reward.verifiers.code``, or that object as a JSON string.
- ``verifier`` (required): a reward component (``exact_answer``, ``math``, ``code.all_pass``, ...). Each task
  carries it as ``metadata["verifier"]``, so the reward service scores the row with it (the ``data``
  domain spec's model components, e.g. ``rm``, still apply).
- ``instruction``: appended to every prompt after a blank line (e.g. "Put your final answer in \\boxed{}.").
- ``dataset``: a real benchmark set that a registry package ships (``humaneval``, ``champ``; see
  ``temper.tasks.shipped``), in place of ``path``, ``format``, ``prompt_field`` and ``answer_field``; its
  verifier and instruction are the defaults of ``verifier`` and ``instruction``.
- A folder of code problems with their own tests (``verifier`` ``tests.pass_fraction`` / ``tests.all_pass``,
  ``format`` ``tests``): ``path`` is the folder (or a JSONL of prompts and tests folders), a problem's tests
  folder run by the sandbox is its reward; options ``tests_dir``, ``prompt_file``, ``solution_file``,
  ``tests_field``, ``wall_seconds`` (see ``temper.tasks.suites``).
- Held-out rows for the job's evaluation, at most one way: ``eval_fraction`` (this fraction of the distinct
  prompts: those with the smallest hash of their text, so the same ones in every run whatever the row
  order, and a prompt that repeats stays on one side), ``eval_path`` (a second file, the same format), or
  ``eval_split`` (a split of a ``datasets`` folder; ``split`` names the trained one, default ``train``).

Training draws only training rows; the evaluation (``make_eval_task``) only held-out rows. Every row is
checked when the dataset is loaded (at the job's validation, before any service starts): a missing file,
a field no row has, a row without the prompt or answer (named by row and line), an unusable test suite,
an unknown verifier, an empty dataset are each an InvalidArgument naming the option.
"""

from __future__ import annotations

import csv
import functools
import hashlib
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from temper.runtime.errors import InvalidArgument, require
from temper.runtime.jsonl import jsonl_rows
from temper.tasks import shipped, suites
from temper.v1 import common_pb2

PREFIX = "data."
FORMATS = ("auto", "jsonl", "csv", "parquet", "hf")
OPTIONS = ("path", "format", "prompt_field", "answer_field", "verifier", "instruction", "split", "eval_split",
           "eval_path", "eval_fraction", "dataset")
REQUIRED = ("path", "prompt_field", "verifier")
# verifiers that read more of a task than its reference answer (reasoning-gym rebuilds its own entry)
NOT_FOR_DATA = {"reasoning_gym": "it rebuilds reasoning-gym's own entries; use an rg.<family> domain"}
ROW_KEY = "data.row"  # task metadata: where the task's row is in its file ("row 3 (line 4)")
SPLIT_KEY = "data.split"  # task metadata: "train" or "eval" (a held-out row)
MAX_ANSWER_CHARS = 1 << 20
MISSING_PACKAGE = {"parquet": "pyarrow", "hf": "datasets"}


@dataclass(frozen=True)
class Row:
    prompt: str
    answer: str
    where: str  # "row 3 (line 4)": how an error names it


@dataclass(frozen=True)
class Dataset:
    path: str
    format: str
    train: tuple[Row, ...]
    held_out: tuple[Row, ...]
    held_out_from: str  # "" (none), "eval_fraction 0.2", the eval file, "split test"
    verifier: str
    prompt_field: str
    answer_field: str
    shipped: str = ""  # the shipped set's name (``dataset``), "" for the user's own file

    def describe(self) -> str:
        held = f"{len(self.held_out)} held out ({self.held_out_from})" if self.held_out else "none held out"
        if self.format == "tests":
            n_tests = sum(len(json.loads(r.answer)["tests"]) for r in self.train + self.held_out)
            return (f"tests-folder problems {self.path}: {len(self.train) + len(self.held_out)} problems with "
                    f"{n_tests} tests, {len(self.train)} train, {held}; verifier {self.verifier} (each test a plain "
                    "Python run under the sandbox's assertion harness: the sandbox's Python has no pytest)")
        if self.shipped:
            s = shipped.SETS[self.shipped]
            return (f"shipped dataset {self.shipped} ({s.describe}; {s.package}, {self.path}): "
                    f"{len(self.train) + len(self.held_out)} rows, {len(self.train)} train, {held}; "
                    f"verifier {self.verifier}")
        answer = f", answer {self.answer_field!r}" if self.answer_field else ""
        return (f"dataset {self.path} ({self.format}): {len(self.train) + len(self.held_out)} rows, "
                f"{len(self.train)} train, {held}; prompt {self.prompt_field!r}{answer}; verifier {self.verifier}")


def declared(domain: str) -> bool:
    """Whether ``domain`` names a dataset domain (its table in domain_config declares it)."""
    return domain.startswith(PREFIX) and len(domain) > len(PREFIX)


def resolve_paths(domain_config: dict, base: Path) -> dict:
    """``domain_config`` with the relative ``path`` / ``eval_path`` of every data domain taken from ``base``
    (the job file's folder), so the scheduler reads the same file whatever its working directory."""
    out = {}
    for domain, options in domain_config.items():
        if declared(domain) and isinstance(options, dict):
            options = dict(options)
            for key in ("path", "eval_path"):
                if isinstance(options.get(key), str) and options[key] and not Path(options[key]).expanduser().is_absolute():
                    options[key] = str((base / options[key]).resolve())
        out[domain] = options
    return out


def check_config(domain: str, config: dict, field: str = "domain_config") -> None:
    load(domain, config, field)


def describe(domain: str, config: dict) -> str:
    return load(domain, config).describe()


def make_task(domain: str, rng: random.Random, task_id: str, config: dict | None = None) -> common_pb2.Task:
    """A training row of the dataset, drawn uniformly."""
    ds = load(domain, _required(domain, config))
    i = rng.randrange(len(ds.train))
    return _task(domain, ds, ds.train[i], task_id, "train")


def make_eval_task(domain: str, rng: random.Random, task_id: str, config: dict | None = None) -> common_pb2.Task:
    """A held-out row, drawn uniformly; InvalidArgument when the dataset holds none out."""
    field = f"domain_config[{domain}]"
    ds = load(domain, _required(domain, config), field)
    require(len(ds.held_out) > 0, f"{field}.eval_fraction",
            f"{domain} is evaluated but holds no rows out: set eval_fraction (or eval_path, or eval_split for a "
            "datasets folder; a dataset only evaluated, in eval.extra_domains: eval_path = its own path), or leave "
            "the job's evaluation off (eval.size = 0)")
    i = rng.randrange(len(ds.held_out))
    return _task(domain, ds, ds.held_out[i], task_id, "eval")


def difficulty_ladder(domain: str) -> None:
    return None  # a dataset has no difficulty knobs of its own


def _required(domain: str, config: dict | None) -> dict:
    require(bool(config), f"domain_config[{domain}]", "a data.* domain is declared by its table: path, "
                                                      "prompt_field, answer_field, verifier")
    return config


def _task(domain: str, ds: Dataset, row: Row, task_id: str, split: str) -> common_pb2.Task:
    return common_pb2.Task(task_id=task_id, domain=domain, prompt=row.prompt, reference_answer=row.answer,
                           metadata={"verifier": ds.verifier, ROW_KEY: row.where, SPLIT_KEY: split})


# -- loading and validation ------------------------------------------------------------------------

def load(domain: str, config: dict, field: str = "") -> Dataset:
    """The dataset ``config`` declares, every row checked; read once per version of its files (path, size,
    mtime), so a draw costs a dictionary lookup and a stat."""
    field = field or f"domain_config[{domain}]"
    require(isinstance(config, dict), field, "must be a table (path, prompt_field, answer_field, verifier)")
    if "dataset" in config:
        config = _shipped_config(config, field)
    try:
        key = json.dumps(config, sort_keys=True)
    except (TypeError, ValueError):
        raise InvalidArgument("options must be strings and numbers", field=field) from None
    return _dataset(domain, field, key, _stamp(config.get("path")), _stamp(config.get("eval_path")))


def _shipped_config(config: dict, field: str) -> dict:
    """``dataset = NAME``'s table with the options the set stands for filled in (``temper.tasks.shipped``); the
    verifier is checked with the rest of the table, once per dataset version (``_dataset``)."""
    name = config["dataset"]
    require(isinstance(name, str) and name in shipped.SETS, f"{field}.dataset",
            f"unknown shipped dataset {name!r}; one of {sorted(shipped.SETS)}")
    for option in shipped.REPLACED:
        require(option not in config, f"{field}.{option}",
                f"the shipped dataset {name} sets it; leave {option} out (or declare your own file without dataset)")
    s = shipped.SETS[name]
    return {**config, "path": str(shipped.path(name, f"{field}.dataset")), "format": "shipped",
            "prompt_field": shipped.PROMPT_FIELD, "answer_field": shipped.ANSWER_FIELD,
            "verifier": config.get("verifier", s.verifier), "instruction": config.get("instruction", s.instruction)}


def _check_shipped_verifier(name: str, verifier: str, field: str) -> None:
    """A shipped set's references are test suites or answers: its verifier must be of the same kind."""
    from temper.reward.verifiers.registry import verifier_of

    code = verifier_of(shipped.SETS[name].verifier).name == "code"
    require((verifier_of(verifier).name == "code") == code, field,
            f"{name}'s reference answers are {'test suites' if code else 'math answers'}: "
            f"{'a code verifier (code.all_pass, code.pass_fraction)' if code else 'a verifier of answers'}, "
            f"got {verifier!r}")


def _stamp(path) -> str:
    """What changes when the file does (a folder: any file in it)."""
    if not isinstance(path, str) or not path:
        return ""
    p = Path(path).expanduser()
    if not p.exists():
        return "missing"
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file())
    return json.dumps([(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files])


@functools.lru_cache(maxsize=1024)  # a job may declare hundreds of datasets
def _dataset(domain: str, field: str, key: str, stamp: str, eval_stamp: str) -> Dataset:
    config = json.loads(key)
    folders = suites.uses_suites(config)  # a folder of problems with their own tests (temper.tasks.suites)
    allowed = OPTIONS + suites.OPTIONS if folders else OPTIONS
    for option in sorted(config):
        if option in suites.OPTIONS and not folders:
            raise InvalidArgument(f"only for a tests-folder domain (verifier one of {list(suites.VERIFIERS)})",
                                  field=f"{field}.{option}")
        require(option in allowed, f"{field}.{option}", f"unknown option; a data.* domain takes {list(allowed)}")
    for option in sorted(set(OPTIONS) - {"eval_fraction"}):
        if option in config:
            require(isinstance(config[option], str), f"{field}.{option}", f"must be a string, got {config[option]!r}")
    # the verifier first: it decides which other options are required
    require("verifier" in config, f"{field}.verifier", "required")
    verifier = config["verifier"]
    needs_reference = _check_verifier(verifier, f"{field}.verifier")
    if config.get("dataset"):
        _check_shipped_verifier(config["dataset"], verifier, f"{field}.verifier")
    for option in ("path",) if folders else REQUIRED:
        require(option in config, f"{field}.{option}", "required")
    if folders:
        suites.check_options(config, field)
    answer_field = config.get("answer_field", "")
    require(bool(answer_field) or not needs_reference or folders, f"{field}.answer_field",
            f"required: the verifier {verifier} checks a reference answer")
    fraction = config.get("eval_fraction", 0.0)
    require(isinstance(fraction, int | float) and not isinstance(fraction, bool) and 0 <= fraction < 1,
            f"{field}.eval_fraction", f"must be a number in [0, 1), got {fraction!r}")
    ways = [k for k in ("eval_path", "eval_split") if config.get(k)] + (["eval_fraction"] if fraction else [])
    require(len(ways) <= 1, f"{field}.{ways[-1] if ways else 'eval_fraction'}",
            f"held-out rows come one way only; {' and '.join(ways)} are both set")
    fmt = config.get("format", "auto")
    from_set = bool(config.get("dataset"))
    require(fmt in FORMATS or folders or from_set, f"{field}.format", f"must be one of {list(FORMATS)}, got {fmt!r}")
    path = _existing(config["path"], f"{field}.path")
    fmt = "tests" if folders else "shipped" if from_set else _format(path, fmt, f"{field}.format")
    require(fmt == "hf" or not (config.get("split") or config.get("eval_split")), f"{field}.split",
            "split / eval_split name the splits of a datasets folder (format hf)")
    eval_path = _existing(config["eval_path"], f"{field}.eval_path") if config.get("eval_path") else None
    return _read_dataset(config, field, path, eval_path, fmt, needs_reference)


def _check_verifier(name: str, field: str) -> bool:
    """Whether the verifier needs a reference answer; InvalidArgument naming ``field`` for an unknown one."""
    from temper.reward.verifiers.registry import component_names, verifier_of

    usable = [c for c in component_names() if c not in NOT_FOR_DATA]
    require(name not in NOT_FOR_DATA, field, f"{name} cannot score a dataset row: {NOT_FOR_DATA.get(name)}")
    require(name in usable, field, f"unknown verifier {name!r}; one of {usable}")
    return verifier_of(name).needs_reference


def _existing(path: str, field: str) -> Path:
    require(bool(path), field, "must name a file or a datasets folder")
    p = Path(path).expanduser()
    require(p.exists(), field, f"no such file or folder: {p}")
    return p.resolve()


def _format(path: Path, fmt: str, field: str) -> str:
    if fmt == "auto":
        if path.is_dir():
            fmt = "hf"
        else:
            by_suffix = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".parquet": "parquet"}
            fmt = by_suffix.get(path.suffix.lower(), "")
            require(bool(fmt), field, f"cannot tell the format of {path.name} from its suffix; set format to one of "
                                      f"{list(FORMATS[1:])}")
    require((fmt == "hf") == path.is_dir(), field,
            f"{path} is {'a folder' if path.is_dir() else 'a file'}; format {fmt} reads "
            f"{'a datasets folder' if fmt == 'hf' else 'a file'}")
    package = MISSING_PACKAGE.get(fmt)
    if package:
        try:
            __import__(package)
        except ImportError:
            raise InvalidArgument(f"reading {'Parquet' if fmt == 'parquet' else 'a Hugging Face datasets folder'} "
                                  f"needs the Python package {package!r}, which is not installed here "
                                  f"(pip install {package}); JSONL and CSV need nothing", field=field) from None
    return fmt


def _read_dataset(config: dict, field: str, path: Path, eval_path: Path | None, fmt: str,
                  needs_reference: bool) -> Dataset:
    from temper.reward.verifiers.registry import verifier_of

    prompt_field, answer_field = config.get("prompt_field") or "", config.get("answer_field") or ""
    verifier, instruction = config["verifier"], config.get("instruction") or ""
    code_suites = verifier_of(verifier).name == "code"

    def rows_of(p: Path, split: str, what: str) -> list[Row]:
        if fmt == "tests":
            said = config.get("instruction", suites.instruction(config))  # instruction = "" appends nothing
            return [Row(f"{prompt}\n\n{said}" if said else prompt, suite, where)
                    for prompt, suite, where in suites.problems(p, config, field, what)]
        raw = (list(shipped.rows(config["dataset"], f"{field}.dataset")) if fmt == "shipped" else
               list(_read(p, fmt, split, f"{field}.{what}")))
        require(len(raw) > 0, f"{field}.{what}", f"{p}{f' split {split}' if split else ''} has no rows")
        return [_row(values, where, p, prompt_field, answer_field, code_suites, instruction, needs_reference, field)
                for values, where in raw]

    rows = rows_of(path, config.get("split") or "", "path")
    held_out: list[Row] = []
    held_out_from = ""
    if eval_path is not None:
        held_out, held_out_from = rows_of(eval_path, "", "eval_path"), str(eval_path)
    elif config.get("eval_split"):
        held_out, held_out_from = rows_of(path, config["eval_split"], "eval_split"), f"split {config['eval_split']}"
    elif config.get("eval_fraction"):
        fraction = float(config["eval_fraction"])
        prompts = sorted({r.prompt for r in rows}, key=lambda p: hashlib.blake2b(p.encode(), digest_size=8).digest())
        n = math.ceil(fraction * len(prompts))
        require(n < len(prompts), f"{field}.eval_fraction",
                f"holding out {n} of {len(prompts)} distinct prompts leaves none to train on")
        chosen = set(prompts[:n])
        held_out = [r for r in rows if r.prompt in chosen]
        rows = [r for r in rows if r.prompt not in chosen]
        held_out_from = f"eval_fraction {fraction:g}"
    return Dataset(str(path), fmt, tuple(rows), tuple(held_out), held_out_from, verifier, prompt_field, answer_field,
                   config.get("dataset") or "")


def _row(values, where: str, path: Path, prompt_field: str, answer_field: str, code_suites: bool, instruction: str,
         needs_reference: bool, field: str) -> Row:
    if not isinstance(values, dict):
        raise InvalidArgument(f"{path} {where}: a row must be an object of fields, got {type(values).__name__}",
                              field=f"{field}.path")
    prompt = values.get(prompt_field)
    if not (isinstance(prompt, str) and prompt.strip()):  # the common case costs one check
        if prompt is None:
            raise InvalidArgument(f"{path} {where} has no field {prompt_field!r} (its fields: {sorted(values)})",
                                  field=f"{field}.prompt_field")
        if not (_scalar(prompt) and str(prompt).strip()):
            raise InvalidArgument(f"{path} {where}: {prompt_field!r} must be a non-empty string, got {prompt!r}"[:300],
                                  field=f"{field}.prompt_field")
        prompt = str(prompt)
    if instruction:
        prompt = f"{prompt}\n\n{instruction}"
    answer = ""
    if answer_field:
        value = values.get(answer_field)
        if value is None:
            raise InvalidArgument(f"{path} {where} has no field {answer_field!r} (its fields: {sorted(values)})",
                                  field=f"{field}.answer_field")
        answer = _answer(value, code_suites, f"{path} {where}", f"{field}.answer_field")
        if needs_reference and not answer.strip():
            raise InvalidArgument(f"{path} {where}: {answer_field!r} is empty", field=f"{field}.answer_field")
    return Row(prompt, answer, where)


def _scalar(value) -> bool:
    return isinstance(value, str | int | float) and not isinstance(value, bool)


def _answer(value, code_suite: bool, at: str, field: str) -> str:
    """The reference answer as the verifier reads it: the text, or for the code verifier its JSON test suite."""
    if code_suite:
        from temper.reward.verifiers.code import parse_suite

        suite = {"tests": value} if isinstance(value, list) else value
        text = suite if isinstance(suite, str) else json.dumps(suite)
        try:
            parse_suite(text, "tests", "python3", 1 << 30, 0)
        except InvalidArgument as e:
            raise InvalidArgument(f"{at}: not a test suite the sandbox can run: {e}", field=field) from None
        return text
    if not _scalar(value):
        raise InvalidArgument(f"{at}: the answer must be a string or a number, got {type(value).__name__}", field=field)
    text = str(value)
    if len(text) > MAX_ANSWER_CHARS:
        raise InvalidArgument(f"{at}: the answer is longer than {MAX_ANSWER_CHARS} characters", field=field)
    return text


def _read(path: Path, fmt: str, split: str, field: str):
    """(row, where) pairs of the file; a row is a dict of its fields."""
    if fmt == "jsonl":
        with path.open(encoding="utf-8") as f:
            for n, line_no, row in jsonl_rows(f, lambda n, line_no, e: InvalidArgument(
                    f"{path} line {line_no}: not JSON: {e}", field=field)):
                yield row, f"row {n} (line {line_no})"
    elif fmt == "csv":
        with path.open(encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f)
            require(bool(reader.fieldnames), field, f"{path}: no header row")
            for n, row in enumerate(reader, 1):
                # a value the header has no column for lands under None; a short row leaves fields None
                require(None not in row, field, f"{path} row {n} (line {reader.line_num}): more values than the "
                                                f"header's {len(reader.fieldnames)} columns")
                yield {k: v for k, v in row.items() if v is not None}, f"row {n} (line {reader.line_num})"
    elif fmt == "parquet":
        import pyarrow.parquet as pq

        for n, row in enumerate(pq.read_table(path).to_pylist(), 1):
            yield row, f"row {n}"
    else:
        import datasets

        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            split = split or "train"
            require(split in loaded, field, f"{path} has no split {split!r}; its splits: {sorted(loaded)}")
            loaded = loaded[split]
        else:
            require(not split, field, f"{path} is a single dataset, not a DatasetDict: it has no split {split!r}")
        for n, row in enumerate(loaded, 1):
            yield row, f"row {n}"
