"""Shipped job files edited for a test: some keys set to other values, the SmolLM2 folder by absolute path."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from temper.models.smollm2 import DEFAULT_DIR
from tests.conftest import REPO

MODEL = REPO / DEFAULT_DIR  # where `make setup` converts SmolLM2-135M-Instruct


def edit_job(text: str, values: Mapping[tuple[str, str], str]) -> str:
    """``text`` with each (table, key) of ``values`` set to its value (a TOML literal), every one of
    them found exactly once, and ``[model] dir`` pointing at MODEL."""
    table, out, seen = "", [], []
    for line in text.splitlines():
        if m := re.match(r"\[([^\]]+)\]\s*$", line):
            table = m.group(1)
        key = line.split("=", 1)[0].strip()
        if (table, key) in values:
            line = f"{key} = {values[(table, key)]}"
            seen.append((table, key))
        elif (table, key) == ("model", "dir"):
            line = f'dir = "{MODEL}"'
        out.append(line)
    assert sorted(seen) == sorted(values), f"keys set {seen}, asked {sorted(values)}"
    return "\n".join(out) + "\n"


def insert_before(text: str, marker: str, block: str) -> str:
    """``text`` with ``block`` inserted before the first ``marker`` (e.g. ``"\n[job.eval]"``: a table of
    ``block`` goes before that one; lines of ``block`` end the table before it), which must be there."""
    head, sep, rest = text.partition(marker)
    assert sep, f"no {marker!r} in the job"
    return head + block + sep + rest


# per-domain-group LoRA adapters on SmolLM2: rank 8 on the attention projections (3.7 MB per adapter in fp32)
LORA = """
lora_rank = 8
lora_alpha = 16.0
lora_target_modules = ["q_proj", "k_proj", "v_proj", "o_proj"]"""


def with_adapters(text: str, adapters: Mapping[str, list[str]]) -> str:
    """A shipped job's ``text`` with a ``[job.adapters]`` table (adapter name -> its domains) before
    ``[job.eval]`` and LORA's lines ending its ``[learner]`` table (the one before ``[replay]``)."""
    table = "\n[job.adapters]\n" + "".join(f"{name} = {json.dumps(list(ds))}\n" for name, ds in adapters.items())
    return insert_before(insert_before(text, "\n[job.eval]", table), "\n\n[replay]", LORA)


def run_job_file(base: Path, text: str, job_timeout: int = 900) -> dict:
    """``temper run`` of the job ``text`` (written to ``base/job.toml``) on a fresh home under ``base``, one
    OpenMP thread per service; its ``summary.json``, once it exited 0 (else the end of its output)."""
    (base / "job.toml").write_text(text)
    runs = base / "runs"
    proc = subprocess.run([sys.executable, "-m", "temper.cli.main", "--home", str(base / "home"), "run", "--config",
                           str(base / "job.toml"), "--runs", str(runs), "--job-timeout", str(job_timeout)],
                          capture_output=True, text=True, timeout=job_timeout + 300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((runs / "latest" / "summary.json").read_text())
