"""Fixtures of the inference tests: tiny models built locally, engines of both kinds, teacher forcing.

vLLM writes compiled kernels to its caches; they go to one temporary folder per session, shared
with the server processes the tests start (they inherit the environment).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch
from transformers import AutoModelForCausalLM

from temper.inference.engine import build_engine
from temper.models.tiny import build_tiny_model

ENGINES = ["hf", "vllm"]
# vLLM's CPU attention needs head_dim 32, 64, ...: hidden 64 / 2 heads
TINY = dict(hidden_size=64, layers=2, heads=2)


@pytest.fixture(scope="session", autouse=True)
def vllm_env():
    cache = tempfile.mkdtemp(prefix="temper-vllm-cache-")
    env = {"VLLM_CACHE_ROOT": os.path.join(cache, "vllm"), "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield env
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    shutil.rmtree(cache, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=3, **TINY)


def make_engine(kind: str, model_dir, **options):
    if kind == "vllm":
        options = {"dtype": "float32", "kv_cache_memory_bytes": 32 << 20, **options}
    return build_engine(kind, model_dir, **options)


@pytest.fixture(scope="module", params=ENGINES)
def engine(request, tiny_dir):
    """One engine of each kind per test module, on the tiny model (fp32, as the learner)."""
    e = make_engine(request.param, tiny_dir)
    yield e
    e.close()


@pytest.fixture(scope="module")
def teacher(tiny_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
